"""False alarms (healthy runs) and catches (gamed runs) of the reward-hacking signals, replayed on finished runs: the
gold watch's rule (``steadyrl.guards.gold_watch.replay``, the same code the live watch runs) over each run's
``metrics.jsonl`` at the shipped ``guards.quatro.gold`` defaults (``--rule before``: the rule before its noise model,
z 0 and regression off, in cells named ``<scenario>-rule-before``), and the doctor's three reward-hacking rules
(``eval_falls``: eval accuracy below its best while the reward rose; ``length_drift``: completion length off by
``DoctorConfig.length_ratio`` while the reward rises; ``clipped_rise``: more completions truncated while the reward
rises) run on the history as it stood every ``--every`` steps, as a monitor would have run them during training; and
the doctor's findings on the whole run (``doctor``: severity:mode, every mode).

The rule reads only logged rows (the periodic eval's ``eval/accuracy`` and TRL's ``reward``), so a run made without
the watch is judged exactly as the watch would have judged it while it trained, up to its first action (a replay
cannot roll back). Runs laid out as ``bench_precision.py`` writes them: ``RUNS/<scenario>/<variant>-s<seed>/``.
Per run: ``evals``, ``falling`` (evals counted towards a confirmation), ``alarms`` (confirmed falls, gamed or
regressed: on a healthy run each is a false alarm), ``first_alarm_step``, ``first_<rule>_step`` for each doctor rule
(None: it never fired) and ``run_commit`` (the commit the run itself was made at).

    python scripts/gold_replay.py /tmp/runs --scenarios healthy-demo healthy-lr3e-5 healthy-lr3e-4 \\
        --results docs/results/gold_false_alarms.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import experiments as X

from steadyrl import metrics as M
from steadyrl.evidence.doctor import RULES, diagnose, doctor_config_for
from steadyrl.evidence.history import History, load_history
from steadyrl.guards.gold_watch import CONFIRMED, GoldConfig, eval_points, replay

RULES_BY_NAME: dict[str, dict[str, Any]] = {"shipped": {}, "before": {"z": 0.0, "regression": False}}
RUN = re.compile(r"^(?P<variant>[\w-]+)-s(?P<seed>\d+)$")
SIGNALS = {  # the doctor's reward-hacking rules, by the metric each reads first
    "eval_falls": M.EVAL_ACCURACY,
    "length_drift": M.COMPLETIONS_MEAN_LENGTH,
    "clipped_rise": M.COMPLETIONS_CLIPPED_RATIO,
}
METRICS = ("evals", "falling", "alarms", "first_alarm_step", *(f"first_{s}_step" for s in SIGNALS), "doctor",
           "run_commit")  # fmt: skip


def first_hits(history: History, folder: Path, every: int) -> dict[str, int | None]:
    """The first step at which each doctor reward-hacking rule fires on the history logged up to it (every ``every``
    steps and at the last one)."""
    config = doctor_config_for(folder)
    rules = {name: next(r for r in RULES if r.mode == "reward_hacking" and r.reads[0] == first)
             for name, first in SIGNALS.items()}  # fmt: skip
    found: dict[str, int | None] = dict.fromkeys(SIGNALS)
    last = history.last_step
    for step in [*range(every, last, every), last]:
        prefix = History(
            [r for r in history.rows if r["step"] <= step], [e for e in history.events if e["step"] <= step]
        )
        for name, rule in rules.items():
            if found[name] is None and any(True for _ in rule.condition(prefix, config)):
                found[name] = step
    return found


def judge(folder: Path, config: GoldConfig, every: int) -> dict[str, Any]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    verdicts, history = replay(rows, config), load_history(folder)
    alarms = [step for step, verdict in verdicts if verdict in CONFIRMED]
    environment = folder / "environment.json"
    commit = json.loads(environment.read_text()).get("steadyrl_commit") if environment.is_file() else None
    return {
        "evals": len(eval_points(rows)),
        "falling": sum(verdict == "falling" for _, verdict in verdicts),
        "alarms": len(alarms),
        "first_alarm_step": alarms[0] if alarms else None,
        **{f"first_{name}_step": step for name, step in first_hits(history, folder, every).items()},
        "doctor": [f"{f.severity}:{f.mode}" for f in diagnose(history, doctor_config_for(folder))],
        "run_commit": commit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, help="the bench's --out folder")
    ap.add_argument("--scenarios", nargs="+", required=True)
    ap.add_argument("--every", type=int, default=10, help="run the doctor's rules every N steps of each history")
    ap.add_argument("--model", default="tiny-llama-0.9m (SFT checkpoint)", help="the runs' model, for the results")
    ap.add_argument("--results", default=None)
    ap.add_argument("--merge", action="store_true")
    ap.add_argument("--rule", choices=list(RULES_BY_NAME), default="shipped",
                    help="the gold watch's rule to replay: today's, or the one before its noise model (z 0, "
                    "regression off); 'before' cells are named <scenario>-rule-before")  # fmt: skip
    args = ap.parse_args()
    config = GoldConfig(**RULES_BY_NAME[args.rule])
    head = ["scenario", "variant", "runs", "evals per run", "gold watch alarms", "evals counted as falling"]
    head += [f"runs with {name}" for name in SIGNALS] + ["runs with any doctor finding"]
    cells, lines = [], ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for scenario in args.scenarios:
        found: dict[str, dict[int, dict[str, Any]]] = {}
        for folder in sorted((args.runs / scenario).iterdir()):
            match = RUN.match(folder.name)
            if match and (folder / "metrics.jsonl").is_file():
                found.setdefault(match["variant"], {})[int(match["seed"])] = judge(folder, config, args.every)
        for variant, runs in sorted(found.items()):
            seeds = sorted(runs)
            summaries = [runs[s] for s in seeds]
            name = scenario + ("-rule-before" if args.rule == "before" else "")
            cells.append(X.cell(name, variant, seeds, summaries, METRICS, died=lambda r: False))
            evals = sorted({r["evals"] for r in summaries})
            alarms = sum(r["alarms"] > 0 for r in summaries)
            falling = sum(r["falling"] for r in summaries)
            doctor = " | ".join(str(sum(r[f"first_{n}_step"] is not None for r in summaries)) for n in SIGNALS)
            found_any = sum(bool(r["doctor"]) for r in summaries)
            lines.append(
                f"| {name} | {variant} | {len(seeds)} | {evals} | {alarms} | {falling} | {doctor} | {found_any} |"
            )
    table = "\n".join(lines)
    print(table)
    if args.results:
        doc = X.results_doc(
            "gold_false_alarms",
            cells,
            command=X.script_command("gold_replay.py"),
            sha=X.commit(),
            model=args.model,
            steps="per run",
            gold_config={k: getattr(config, k) for k in ("drop", "z", "confirm", "reward_slack", "regression")},
            every=args.every,
            table=table,
        )
        X.write_results(args.results, doc, merge=args.merge)


if __name__ == "__main__":
    main()
