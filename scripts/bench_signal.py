"""Signal-layer benchmark: GRADE / GEPO under heavy-tailed (Cauchy) reward noise, against plain TRL.

For each variant x scale_rewards x seed, trains GRPO from one SFT checkpoint on the arithmetic task with
reward = exact_match + Cauchy noise, then reports the grad-norm coefficient of variation, the final greedy
exact-match accuracy (noise-free) and its seed-to-seed std. "plain TRL" is steadyrl with every guard off,
which tests/integration/test_equivalence.py shows is bit-identical to trl.GRPOTrainer.

    python scripts/bench_signal.py --sft runs/tiny-sft/final            # full matrix, writes docs/benchmarks.md
    python scripts/bench_signal.py --sft runs/tiny-sft/final --quick    # 2 variants, 1 seed, few steps
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

VARIANTS = {
    "plain TRL (guards off)": [],
    "GRADE whitening only": ["guards.grade.enabled=true", "guards.grade.clip=false", "guards.grade.centring_beta=0"],
    "GRADE full": ["guards.grade.enabled=true"],
    "GEPO advantage": ["guards.gepo.enabled=true", "guards.gepo.spike.enabled=false"],
    "GRADE + GEPO": ["guards.grade.enabled=true", "guards.gepo.enabled=true"],
}


def train_command(
    sft: str, out: Path, variant: list[str], scale: str, seed: int, steps: int, noise: float
) -> list[str]:
    rewards = (
        f"rewards=[{{name: noisy, fn: 'steadyrl.faults:exact_match_cauchy', kwargs: {{scale: {noise}, seed: {seed}}}}},"
        " {fn: exact_match, weight: 0.0}]"
    )
    return X.train_command(
        REPO / "configs/tiny/grpo.yaml", f"model.path={sft}",
        f"trainer.output_dir={out}", f"trainer.max_steps={steps}", f"trainer.seed={seed}",
        f"trainer.scale_rewards={scale}", 'trainer.save_strategy="no"', "trainer.logging_steps=1",
        rewards, "eval.metric=exact_match", *variant,
    )  # fmt: skip


def summarise(job: X.Job, run: X.Outcome) -> dict:
    """Accuracy and the coefficient of variation of the logged grad norms (metrics.jsonl, full precision)."""
    if run.status != "ok":
        return {"died": True, "wall_s": run.wall_s}
    norms = X.finite(run.history.series("grad_norm")[1].tolist())
    mean = statistics.fmean(norms)
    return {
        "died": False,
        "accuracy": run.eval["accuracy"],
        "grad_norm_cv": statistics.pstdev(norms) / mean if mean else float("nan"),
        "wall_s": run.wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="SFT checkpoint (e.g. runs/tiny-sft/final from scripts/demo.sh)")
    ap.add_argument("--out", default="runs/bench-signal")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--noise", type=float, default=1.0, help="Cauchy scale added to the 0/1 reward")
    ap.add_argument("--workers", "--jobs", type=int, default=2, help="runs at a time")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before a run is killed (counted as died)")
    ap.add_argument("--quick", action="store_true", help="2 variants, 1 seed, 20 steps, scale_rewards=group")
    ap.add_argument("--doc", default=None, help="markdown file to write the table to")
    args = ap.parse_args()
    variants = dict(VARIANTS)
    scales, seeds, steps = ["group", "none"], list(range(args.seeds)), args.steps
    if args.quick:
        variants = {k: VARIANTS[k] for k in ("plain TRL (guards off)", "GRADE + GEPO")}
        scales, seeds, steps = ["group"], [0], 20
    root = Path(args.out)

    def slug(name: str) -> str:
        return name.split(" (")[0].replace(" + ", "+").replace(" ", "_").lower()

    jobs = []
    for name in variants:
        for scale in scales:
            for seed in seeds:
                out = root / f"{slug(name)}-{scale}-s{seed}"
                cmd = train_command(args.sft, out, variants[name], scale, seed, steps, args.noise)
                jobs.append(X.Job(name, scale, seed, out, tuple(cmd)))
    results = X.run_jobs(jobs, summarise, workers=args.workers, timeout=args.timeout)
    lines = [
        "| variant | scale_rewards | final accuracy (mean ± seed std) | grad-norm CV (mean) | died | wall s/run |",
        "|---|---|---|---|---|---|",
    ]
    for name in variants:
        for scale in scales:
            rs = [results[(name, scale, s)] for s in seeds]
            ok = [r for r in rs if not r["died"]]
            acc = [r["accuracy"] for r in ok]
            cv = [r["grad_norm_cv"] for r in ok]
            lines.append(
                f"| {name} | {scale} | {X.mean_std(acc)} | {statistics.fmean(cv):.3f} | "
                f"{len(rs) - len(ok)}/{len(rs)} | {statistics.fmean(r['wall_s'] for r in rs):.0f} |"
                if ok
                else f"| {name} | {scale} | - | - | {len(rs)}/{len(rs)} | - |"
            )
    table = "\n".join(lines)
    print(table)
    (root / "results.json").write_text(json.dumps({f"{k[0]}|{k[1]}|{k[2]}": v for k, v in results.items()}, indent=1))
    if args.doc:
        Path(args.doc).write_text(table + "\n")


if __name__ == "__main__":
    main()
