"""What the auto KL target would be under other calibration rules, from runs already made (no training).

QUATRO's ``target: auto`` sets the target to 10 x the mean per-token KL of steps 11-20, with beta at
``trainer.beta`` until then. A run of plain TRL at the same beta (``bench_stability.py``'s "plain TRL", logged every
step) is the trajectory every rule sees during its window, so its logged KL tells what target each rule would
set, and how that compares with the KL the run went on to spend. Rules:

    current   10 x mean KL, steps 11-20 (the shipped rule)
    w21-40    10 x mean KL, steps 21-40 (a longer, later window)
    median    10 x median KL, steps 11-20
    entropy   mean token entropy of steps 1-10 (a level the reward has not moved yet)

and for each run the KL it spent: the mean of its last 20 steps and the largest 10-step mean after step 20.

    python scripts/kl_calibration.py runs/base --scenarios clean,repetition_reward \
        --results docs/results/kl_calibration.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

from steadyrl.evidence.history import load_history  # noqa: E402

RATIO = 10.0
RULES = ("current", "w21-40", "median", "entropy")


def by_step(history: Any, name: str) -> dict[int, float]:
    steps, values = history.series(name)
    return {int(s): float(v) for s, v in zip(steps, values, strict=True)}


def calibration(kl: dict[int, float], entropy: dict[int, float]) -> dict[str, float]:
    """Each rule's target from one run's per-step KL and entropy (steps 1-based)."""

    def window(a: int, b: int) -> list[float]:
        return [kl[s] for s in range(a, b + 1)]

    return {
        "current": RATIO * statistics.fmean(window(11, 20)),
        "w21-40": RATIO * statistics.fmean(window(21, 40)),
        "median": RATIO * statistics.median(window(11, 20)),
        "entropy": statistics.fmean(entropy[s] for s in range(1, 11)),
    }


def spent(kl: dict[int, float]) -> dict[str, float]:
    """The KL a run spent: mean of its last 20 steps, and its largest 10-step mean after step 20."""
    last = max(kl)
    return {
        "kl_last20": statistics.fmean(kl[s] for s in range(last - 19, last + 1)),
        "kl_max10": max(statistics.fmean(kl[s] for s in range(t, t + 10)) for t in range(21, last - 8)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="a bench_stability.py --out folder")
    ap.add_argument("--variant", default="plain_trl", help="run-folder prefix of the variant (default plain_trl)")
    ap.add_argument("--scenarios", default="clean,repetition_reward")
    ap.add_argument("--results", default=None, help="write the RESULTS.md-format JSON here")
    args = ap.parse_args()
    cells, lines = [], ["| scenario | seed | " + " | ".join(RULES) + " | KL last 20 | KL max 10-step | accuracy |"]
    lines.append("|---" * (len(RULES) + 5) + "|")
    for scenario in args.scenarios.split(","):
        runs = sorted(Path(args.out).glob(f"{args.variant}-{scenario}-s*"), key=lambda p: int(p.name.rsplit("s", 1)[1]))
        seeds, metrics, accuracy = [], {k: [] for k in (*RULES, "kl_last20", "kl_max10")}, []
        for run in runs:
            history = load_history(run)
            kl, entropy = by_step(history, "kl"), by_step(history, "entropy")
            row = {**calibration(kl, entropy), **spent(kl)}
            result = run / "eval_results.json"
            acc = json.loads(result.read_text())["accuracy"] if result.is_file() else None
            seeds.append(int(run.name.rsplit("s", 1)[1]))
            accuracy.append(acc)
            for key, value in row.items():
                metrics[key].append(value)
            cells_text = " | ".join(f"{row[k]:.3f}" for k in (*RULES, "kl_last20", "kl_max10"))
            lines.append(f"| {scenario} | {seeds[-1]} | {cells_text} | {acc} |")
        runs = [{"accuracy": a, **{k: v[i] for k, v in metrics.items()}} for i, a in enumerate(accuracy)]
        cells.append(X.cell(scenario, args.variant.replace("_trl", ""), seeds, runs, list(metrics)))
    print("\n".join(lines))
    if args.results:
        doc = X.results_doc("kl_calibration", cells, command=X.script_command("kl_calibration.py"),
                            sha="analysis of the runs in " + args.out, packages=False, steps=None,
                            model="tiny-llama-0.9m (SFT checkpoint of configs/tiny/sft.yaml)")  # fmt: skip
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
