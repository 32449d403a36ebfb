"""The gold watch's false alarms and catches on simulated histories: the real rule (``GoldDetector``, the code the
live watch runs) over evals drawn from its noise model, at the shipped ``guards.quatro.gold`` settings and at the rule
before the noise model (``z: 0, regression: false``: drop 0.05 below the luckiest eval, the reward "held" when not
below its level at that eval); ``z-3.5`` is the shipped rule with z 3.5.

Plateau cells (``plateau-p<p>-n<n>``): a run that stopped improving. Each eval scores n fresh samples of a 0/1 metric
whose true level is p (a sampled eval, or a fresh random subset), logged with its standard error as PeriodicEval logs
it (the per-sample std / sqrt(n)); between two evals ``--every`` training rewards drawn around a flat mean (std
``--reward-std``). ``false_alarm_share_at_<k>``: the share of ``--runs`` runs with any confirmed fall (a rollback)
within their first k evals.

TRL-eval cells (``trl-plateau-P<prompts>-G<generations>``, ``trl-fall-<rate>``; the shipped rule only): the
watch on TRL's own eval from Python (``steadyrl.trainers.gold.trl_eval_se``). The eval set is fixed (TRL's
``eval_dataset``): P prompts whose own success rates are drawn once per run (uniform on [0, 1]: mean 0.5, prompts
that differ as much as they can), each eval samples G completions per prompt; the logged std is over all P x G
scores and the watch's se is std / sqrt(P). Only the completions vary between evals, so this se over-states the
noise: few false alarms, and a fall must be deeper to be confirmed (the fall cells: every prompt's rate falls by
``rate`` per eval, P 100, G 8).

Fall cells (``fall-<rate>``): p = 0.6 for 10 evals, then the true level falls by ``rate`` per eval (to 0) while the
training reward rises (a gamed reward), n = 200. ``evals_to_catch``: the median and the 95th percentile of the evals
from the first eval after the fall began to the confirmation; ``caught_share``: the runs confirmed within 10 evals.

    python scripts/gold_simulate.py --runs 4000 --results /tmp/sim.json
    python scripts/merge_results.py docs/results/gold_false_alarms.json /tmp/sim.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

from steadyrl.callbacks.periodic_eval import sample_mean_se  # noqa: E402
from steadyrl.guards.gold_watch import CONFIRMED, GoldConfig, GoldDetector, mean_se  # noqa: E402

# the shipped rule, the same at z 3.5 (what the budget rules out), and the rule before the noise model
VARIANTS = {"shipped": {}, "z-3.5": {"z": 3.5}, "before-noise-model": {"z": 0.0, "regression": False}}
EVAL_COUNTS = (10, 20, 30, 50)
SIZES = (100, 200, 500, 1000)
LEVELS = (0.2, 0.5, 0.8)
FALL_RATES = (0.05, 0.1, 0.2)


def eval_point(rng: np.random.Generator, level: float, n: int) -> tuple[float, float]:
    """(mean, standard error) of n fresh 0/1 scores with success probability ``level``, as PeriodicEval logs them."""
    k = int(rng.binomial(n, level))
    return k / n, sample_mean_se(float(k), float(k), float(n))  # 0/1 scores: the sum of squares is the sum


def rewards(rng: np.random.Generator, mean: float, every: int, std: float) -> tuple[float, float]:
    return mean_se(list(rng.normal(mean, std, size=every)))


def first_alarm(detector: GoldDetector, points: list[tuple[float, float, float, float]]) -> int | None:
    """The 1-based index of the first confirmed fall, None when none."""
    for i, (gold, se, reward, reward_se) in enumerate(points, start=1):
        if detector.update(20 * i, gold, reward, se, reward_se) in CONFIRMED:
            return i
    return None


def plateau_cell(variant: str, level: float, n: int, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    config = GoldConfig(**VARIANTS[variant])
    firsts = []
    for _ in range(args.runs):
        points = [(*eval_point(rng, level, n), *rewards(rng, 0.5, args.every, args.reward_std)) for _ in range(50)]
        firsts.append(first_alarm(GoldDetector.from_config(config), points))
    shares = {
        f"false_alarm_share_at_{k}": sum(f is not None and f <= k for f in firsts) / args.runs for k in EVAL_COUNTS
    }
    return {
        "scenario": f"plateau-p{level}-n{n}",
        "variant": variant,
        "seeds": [seed],
        "died": [False],
        "accuracy": [None],
        "metrics": {"runs": [args.runs], **{k: [v] for k, v in shares.items()}},
    }


def fall_cell(variant: str, rate: float, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    config = GoldConfig(**VARIANTS[variant])
    lags = []
    for _ in range(args.runs):
        points = []
        for i in range(30):
            level = 0.6 if i < 10 else max(0.0, 0.6 - rate * (i - 9))
            reward_mean = 0.5 if i < 10 else 0.5 + 0.02 * (i - 9)
            points.append((*eval_point(rng, level, 200), *rewards(rng, reward_mean, args.every, args.reward_std)))
        first = first_alarm(GoldDetector.from_config(config), points)
        lags.append(None if first is None else first - 10)  # evals after the last plateau eval
    caught = sorted(lag for lag in lags if lag is not None and lag >= 1)
    early = sum(lag is not None and lag < 1 for lag in lags)
    metrics = {
        "runs": [args.runs],
        "caught_share": [sum(lag <= 10 for lag in caught) / args.runs],
        "alarm_before_the_fall_share": [early / args.runs],
        "evals_to_catch_median": [statistics.median(caught) if caught else None],
        "evals_to_catch_p95": [caught[math.ceil(0.95 * len(caught)) - 1] if caught else None],
    }
    return {
        "scenario": f"fall-{rate}",
        "variant": variant,
        "seeds": [seed],
        "died": [False],
        "accuracy": [None],
        "metrics": metrics,
    }


TRL_SHAPES = ((50, 4), (50, 8), (200, 4), (200, 8))  # (eval prompts, completions per prompt)


def trl_eval_point(rng: np.random.Generator, prompt_levels: np.ndarray, generations: int) -> tuple[float, float]:
    """(mean, se) of TRL's eval: ``generations`` 0/1 completions per prompt at its own level; se = the std of all the
    scores over sqrt(prompts), as ``trl_eval_se`` reads the logged std."""
    k = rng.binomial(generations, prompt_levels)
    mean = float(k.sum()) / (len(prompt_levels) * generations)
    return mean, math.sqrt(mean * (1.0 - mean)) / math.sqrt(len(prompt_levels))


def trl_cell(prompts: int, generations: int, rate: float | None, args: argparse.Namespace, seed: int) -> dict:
    """A plateau (``rate`` None) or a fall on TRL's eval (module docstring), the shipped rule."""
    rng = np.random.default_rng(seed)
    firsts = []
    for _ in range(args.runs):
        base = rng.uniform(0.0, 1.0, size=prompts)
        points = []
        for i in range(50 if rate is None else 30):
            drop = 0.0 if rate is None or i < 10 else rate * (i - 9)
            reward_mean = 0.5 if rate is None or i < 10 else 0.5 + 0.02 * (i - 9)
            gold = trl_eval_point(rng, np.clip(base - drop, 0.0, 1.0), generations)
            points.append((*gold, *rewards(rng, reward_mean, args.every, args.reward_std)))
        firsts.append(first_alarm(GoldDetector.from_config(GoldConfig()), points))
    if rate is None:
        name = f"trl-plateau-P{prompts}-G{generations}"
        metrics = {f"false_alarm_share_at_{k}": [sum(f is not None and f <= k for f in firsts) / args.runs]
                   for k in EVAL_COUNTS}  # fmt: skip
    else:
        name = f"trl-fall-{rate}"
        caught = sorted(f - 10 for f in firsts if f is not None and f > 10)
        metrics = {
            "caught_share": [sum(lag <= 10 for lag in caught) / args.runs],
            "alarm_before_the_fall_share": [sum(f is not None and f <= 10 for f in firsts) / args.runs],
            "evals_to_catch_median": [statistics.median(caught) if caught else None],
            "evals_to_catch_p95": [caught[math.ceil(0.95 * len(caught)) - 1] if caught else None],
        }
    return {"scenario": name, "variant": "shipped", "seeds": [seed], "died": [False], "accuracy": [None],
            "metrics": {"runs": [args.runs], **metrics}}  # fmt: skip


def table(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| eval samples n | true level p | rule | "
        + " | ".join(f"runs with a rollback, {k} evals" for k in EVAL_COUNTS)
        + " |",
        "|---|---|---|" + "---|" * len(EVAL_COUNTS),
    ]
    for c in cells:
        if c["scenario"].startswith("plateau-"):
            _, p, n = c["scenario"].split("-")
            shares = " | ".join(f"{100 * c['metrics'][f'false_alarm_share_at_{k}'][0]:.1f} %" for k in EVAL_COUNTS)
            lines.append(f"| {n[1:]} | {p[1:]} | {c['variant']} | {shares} |")
    lines += [
        "",
        "| fall per eval (n 200) | rule | caught within 10 evals | evals to catch: median, p95 | alarm before"
        " the fall |",
        "|---|---|---|---|---|",
    ]
    for c in cells:
        if c["scenario"].startswith(("fall-", "trl-fall-")):
            m = c["metrics"]
            trl_eval = c["scenario"].startswith("trl")
            where = c["scenario"].removeprefix("trl-fall-") + " (TRL eval, P 100, G 8)" * trl_eval
            lines.append(
                f"| {where.removeprefix('fall-')} | {c['variant']} | {100 * m['caught_share'][0]:.1f} % | "
                f"{m['evals_to_catch_median'][0]}, {m['evals_to_catch_p95'][0]} | "
                f"{100 * m['alarm_before_the_fall_share'][0]:.1f} % |"
            )
    trl = [c for c in cells if c["scenario"].startswith("trl-plateau-")]
    if trl:
        heads = " | ".join(f"runs with a rollback, {k} evals" for k in EVAL_COUNTS)
        lines += ["", f"| TRL eval: prompts P, completions G | {heads} |", "|---|" + "---|" * len(EVAL_COUNTS)]
        for c in trl:
            _, _, prompts, gens = c["scenario"].split("-")
            shares = " | ".join(f"{100 * c['metrics'][f'false_alarm_share_at_{k}'][0]:.1f} %" for k in EVAL_COUNTS)
            lines.append(f"| {prompts[1:]}, {gens[1:]} | {shares} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=4000, help="simulated runs per cell")
    ap.add_argument("--every", type=int, default=20, help="training rewards logged between two evals")
    ap.add_argument("--reward-std", type=float, default=0.05, help="the std of one step's mean training reward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-eval", action="store_true", help="add the TRL-eval cells (module docstring)")
    ap.add_argument("--only-trl-eval", action="store_true", help="the TRL-eval cells alone (to merge into a file)")
    ap.add_argument("--results", type=Path, help="write the RESULTS.md file here")
    args = ap.parse_args()
    cells = []
    for variant in VARIANTS:
        for i, (level, n) in enumerate((p, n) for p in LEVELS for n in SIZES):
            cells.append(plateau_cell(variant, level, n, args, args.seed + i))
        for j, rate in enumerate(FALL_RATES):
            cells.append(fall_cell(variant, rate, args, args.seed + 100 + j))
    if args.trl_eval or args.only_trl_eval:
        cells = [] if args.only_trl_eval else cells
        for i, (prompts, gens) in enumerate(TRL_SHAPES):
            cells.append(trl_cell(prompts, gens, None, args, args.seed + 200 + i))
        for j, rate in enumerate(FALL_RATES):
            cells.append(trl_cell(100, 8, rate, args, args.seed + 300 + j))
    text = table(cells)
    print(text)
    if args.results:
        doc = X.results_doc(
            "gold_false_alarms",
            cells,
            command=X.script_command("gold_simulate.py"),
            sha=X.commit(),
            model="none (simulated eval histories)",
            steps="per run",
            table=text,
            gold_config=GoldConfig().__dict__,
            every=args.every,
        )
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
