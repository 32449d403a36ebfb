"""Reward-hacking and failure signals, steadyrl's and its peers', replayed on the same finished runs (issue 56): how
many healthy runs each flags (false alarms) and how soon each flags a run whose gold metric fell (catches).

Each run is a folder with ``metrics.jsonl`` (``RUNS/<variant>-s<seed>/`` as the benches write them); a group names a
class of runs: ``--group CLASS=DIR[:VARIANT]`` (default variant ``plain``), e.g. ``healthy-plateau`` (the long runs
past convergence), ``gamed`` (plain TRL on the lenient verifier), ``failing`` (plain TRL at 10-100x the learning
rate), ``flawed-reward`` (a noisy or lenient reward the policy did not exploit: gold held). A run "fell" at the
first eval at least ``FALL`` below the eval before training; a signal's lag is its first step minus that eval's
step (negative: before the fall was visible in the eval).

Signals, each the first step it fires on the history as logged up to that step:

- steadyrl: ``gold_watch`` (the watch's rule at its shipped defaults, ``steadyrl.guards.gold_watch.replay``: a
  confirmed fall, gamed or regressed), the doctor's three reward-hacking rules (``eval_falls``, ``length_drift``,
  ``clipped_rise``, run every ``--every`` steps as ``gold_replay.py`` runs them), ``doctor`` (any finding of
  ``steadyrl doctor`` run every ``--every`` steps on the history so far), the live monitor's early warnings
  (``monitor_entropy``, ``monitor_adv_std``: ``early_warnings`` every ``guards.gepo.monitor.every`` steps at its
  defaults) and, for comparison, its entropy rule before its noise model (``monitor_entropy_before``: the last of 20
  logged entropies below 0.7 x the first).
- soup-cli (``peer_soup.py``, its own code in its own virtualenv, ``--soup-python``): ``soup_info_rm_warn``,
  ``soup_info_rm_halt``, ``soup_length_trip``, ``soup_vote_trip``.
- rules in common use, at the thresholds usually quoted: ``reward_std_jump`` (the reward's std above 2x the median
  of its previous 20 logged values), ``reward_trend`` (a Mann-Kendall test on the last 50 rewards: a monotone rise
  at p < 0.005, one-sided), ``entropy_collapse`` (the 10-step mean entropy below half the first 10 steps'),
  ``reward_collapse`` (the 10-step mean reward below half its best 10-step mean).

    python scripts/peer_signals.py --soup-python /tmp/soupvenv/bin/python \\
        --group healthy-plateau=/tmp/long/runs/healthy-long-sampled:all gamed=/tmp/hk/lenient-length \\
        --results docs/results/peer_signals.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402
from gold_replay import RUN, SIGNALS, first_hits  # noqa: E402

from steadyrl import metrics as M  # noqa: E402
from steadyrl.evidence.doctor import diagnose, doctor_config_for  # noqa: E402
from steadyrl.evidence.early_warnings import MonitorConfig, early_warnings, recent  # noqa: E402
from steadyrl.evidence.history import History, load_history  # noqa: E402
from steadyrl.guards.gold_watch import CONFIRMED, GoldConfig, replay  # noqa: E402

FALL = 0.1  # a run fell at its first eval this far below the eval before training (the gold metric's units)
STD_JUMP, STD_WINDOW = 2.0, 20
TREND_WINDOW, TREND_Z = 50, 2.576  # one-sided p < 0.005
COLLAPSE_WINDOW, COLLAPSE_SHARE = 10, 0.5
SOUP = ("soup_info_rm_warn", "soup_info_rm_halt", "soup_length_trip", "soup_vote_trip")
OWN = ("gold_watch", *SIGNALS, "doctor", "monitor_entropy", "monitor_adv_std", "monitor_entropy_before")
WARNINGS = {"monitor_entropy": "entropy falling fast", "monitor_adv_std": "advantage std rising steadily"}
COMMON = ("reward_std_jump", "reward_trend", "entropy_collapse", "reward_collapse")
ALL = (*OWN, *SOUP, *COMMON)


def mann_kendall_z(values: list[float]) -> float:
    """The Mann-Kendall trend statistic's z (no tie correction beyond the variance's; 0 for fewer than 3 values)."""
    n = len(values)
    if n < 3:
        return 0.0
    s = sum((values[j] > values[i]) - (values[j] < values[i]) for i in range(n) for j in range(i + 1, n))
    var = n * (n - 1) * (2 * n + 5) / 18
    return 0.0 if s == 0 else (s - math.copysign(1, s)) / math.sqrt(var)


def first_common(steps: list[int], reward: list[float], std: list[float], entropy: list[float]) -> dict[str, Any]:
    """The first step each common rule fires at, reading the series up to that step (``entropy`` may be empty)."""
    found: dict[str, int | None] = dict.fromkeys(COMMON)
    best = -math.inf
    for i, step in enumerate(steps):
        past = std[max(0, i - STD_WINDOW) : i]
        if found["reward_std_jump"] is None and len(past) == STD_WINDOW:
            median = statistics.median(past)
            if median > 0 and std[i] > STD_JUMP * median:
                found["reward_std_jump"] = step
        window = reward[max(0, i + 1 - TREND_WINDOW) : i + 1]
        if found["reward_trend"] is None and len(window) == TREND_WINDOW and mann_kendall_z(window) > TREND_Z:
            found["reward_trend"] = step
        if i + 1 >= COLLAPSE_WINDOW:
            mean = statistics.fmean(reward[i + 1 - COLLAPSE_WINDOW : i + 1])
            best = max(best, mean)
            if found["reward_collapse"] is None and best > 0 and mean < COLLAPSE_SHARE * best:
                found["reward_collapse"] = step
        if found["entropy_collapse"] is None and len(entropy) > i >= 2 * COLLAPSE_WINDOW - 1:
            first = statistics.fmean(entropy[:COLLAPSE_WINDOW])
            if statistics.fmean(entropy[i + 1 - COLLAPSE_WINDOW : i + 1]) < COLLAPSE_SHARE * first:
                found["entropy_collapse"] = step
    return found


def first_finding(history: History, config: Any, every: int) -> int | None:
    """The first step at which ``steadyrl doctor``, run every ``every`` steps on the history so far, finds anything."""
    last = history.last_step
    for step in [*range(every, last, every), last]:
        rows = [r for r in history.rows if r["step"] <= step]
        if diagnose(History(rows, [e for e in history.events if e["step"] <= step]), config):
            return step
    return None


def first_warnings(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """The first step of each live-monitor warning, run every ``MonitorConfig.every`` steps as the monitor runs, and of
    its entropy rule before the noise model (single points, ratio 0.7)."""
    config, found = MonitorConfig(), dict.fromkeys((*WARNINGS, "monitor_entropy_before"))
    rows = [r for r in rows if "event" not in r]
    last = max((int(r["step"]) for r in rows), default=0)
    for step in range(config.every, last + 1, config.every):
        so_far = [r for r in rows if int(r["step"]) <= step]
        for warning in early_warnings(so_far, config):
            for name, start in WARNINGS.items():
                if found[name] is None and warning.startswith(start):
                    found[name] = step
        ent = recent(so_far, M.ENTROPY, config.window)
        if found["monitor_entropy_before"] is None and len(ent) == config.window and 0 < ent[0][1]:
            found["monitor_entropy_before"] = step if ent[-1][1] < 0.7 * ent[0][1] else None
    return found


def training_series(history: History) -> dict[str, list[Any]]:
    """Per logged training step with a finite reward: step, reward, reward std, mean length, entropy."""
    steps, reward = history.finite(M.REWARD)
    columns = {"steps": [int(s) for s in steps.tolist()], "reward": reward.tolist()}
    for key, name in (("reward_std", M.REWARD_STD), ("length", M.COMPLETIONS_MEAN_LENGTH), ("entropy", M.ENTROPY)):
        by_step = dict(zip(*(a.tolist() for a in history.finite(name)), strict=True)) if history.has(name) else {}
        columns[key] = [by_step.get(s) for s in columns["steps"]]
    keep = [i for i in range(len(columns["steps"])) if columns["reward_std"][i] is not None]
    out = {k: [v[i] for i in keep] for k, v in columns.items()}
    if any(v is None for v in out["length"]):
        out["length"] = [v if v is not None else 0.0 for v in out["length"]]
    out["entropy"] = [] if any(v is None for v in out["entropy"]) else out["entropy"]
    return out


def fell_at(rows: list[dict[str, Any]]) -> tuple[float | None, int | None]:
    """(the eval before training, the step of the first eval ``FALL`` below it)."""
    evals = [(int(r["step"]), float(r[M.EVAL_ACCURACY])) for r in rows if M.EVAL_ACCURACY in r]
    if not evals or evals[0][0] != 0:
        return None, None
    start = evals[0][1]
    return start, next((s for s, v in evals[1:] if v <= start - FALL), None)


def judge(folder: Path, every: int) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    history = load_history(folder)
    series = training_series(history)
    alarms = [step for step, verdict in replay(rows, GoldConfig()) if verdict in CONFIRMED]
    start, fell = fell_at(rows)
    first: dict[str, Any] = {"gold_watch": alarms[0] if alarms else None}
    first.update(first_hits(history, folder, every))
    first["doctor"] = first_finding(history, doctor_config_for(folder), every)
    first.update(first_warnings(rows))
    first.update(first_common(series["steps"], series["reward"], series["reward_std"], series["entropy"]))
    environment = folder / "environment.json"
    commit = json.loads(environment.read_text()).get("steadyrl_commit") if environment.is_file() else None
    summary = {"gold_start": start, "fell_at_step": fell, "last_step": history.last_step, "run_commit": commit}
    return summary | {f"first_{k}": v for k, v in first.items()}, series


def soup_signals(python: str, series: dict[str, dict[str, list[Any]]]) -> tuple[str, dict[str, dict[str, Any]]]:
    payload = {k: {c: v[c] for c in ("steps", "reward", "reward_std", "length")} for k, v in series.items()}
    done = subprocess.run(
        [python, str(REPO / "scripts" / "peer_soup.py")],
        input=json.dumps({"runs": payload}),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"peer_soup.py under {python} failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout)
    return out["soup_cli"], {k: {f"soup_{s}": step for s, step in v.items()} for k, v in out["runs"].items()}


def _lag_text(lags: list[int]) -> str:
    if not lags:
        return ""
    return f"; {statistics.median(lags):+.0f} ({min(lags):+d} to {max(lags):+d})"


def table(groups: dict[str, list[dict[str, Any]]]) -> str:
    head = ["signal", *(f"{g} ({len(r)} runs)" for g, r in groups.items())]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for signal in ALL:
        cells = []
        for runs in groups.values():
            fired = [r for r in runs if r[f"first_{signal}"] is not None]
            lags = [r[f"first_{signal}"] - r["fell_at_step"] for r in fired if r["fell_at_step"] is not None]
            cells.append(f"{len(fired)}/{len(runs)}" + _lag_text(lags))
        lines.append(f"| {signal} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", nargs="+", required=True, help="CLASS=DIR[:VARIANT] (variant default: plain)")
    ap.add_argument("--soup-python", required=True, help="the python of a virtualenv with soup-cli (peer_soup.py)")
    ap.add_argument("--every", type=int, default=10, help="run the doctor's rules every N steps of each history")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    found: dict[str, dict[str, Any]] = {}
    series: dict[str, dict[str, list[Any]]] = {}
    members: dict[str, list[str]] = {}
    for spec in args.group:
        name, _, where = spec.partition("=")
        folder, _, variant = where.partition(":")
        if not name or not Path(folder).is_dir():
            ap.error(f"--group {spec!r}: expected CLASS=DIR[:VARIANT] with an existing DIR")
        for run in sorted(Path(folder).iterdir()):
            match = RUN.match(run.name)
            if match and match["variant"] == (variant or "plain") and (run / "metrics.jsonl").is_file():
                key = f"{name}/{Path(folder).name}/{run.name}"
                found[key], series[key] = judge(run, args.every)
                found[key]["seed"] = int(match["seed"])
                members.setdefault(name, []).append(key)
    soup_version, soup = soup_signals(args.soup_python, series)
    for key in found:
        found[key].update({f"first_{s}": soup[key][s] for s in SOUP})
    groups = {name: [found[k] | {"run": k} for k in keys] for name, keys in members.items()}
    text = table(groups)
    print(text)
    if args.results:
        metrics = ("run", "gold_start", "fell_at_step", "last_step", "run_commit", *(f"first_{s}" for s in ALL))
        cells = [
            X.cell(name, "replay", [r["seed"] for r in runs], runs, metrics, died=lambda r: False)
            for name, runs in groups.items()
        ]
        doc = X.results_doc(
            "peer_signals",
            cells,
            command=X.script_command("peer_signals.py"),
            sha=X.commit(),
            model="tiny-llama-0.9m (SFT checkpoint)",
            steps="per run",
            soup_cli=soup_version,
            fall=FALL,
            every=args.every,
            table=text,
        )
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
