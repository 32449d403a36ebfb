"""Overhead of the guard layers: optimizer-step time with guards on vs off, alternating in one run.

Each repeat trains the same short GRPO run twice, guards off then on (the order alternates between repeats so
drift in machine load hits both sides), and takes the Trainer's `train_runtime` per optimizer step: it covers
generation, rewards, advantages, backward, the step guards and the optimizer step (TRL's own `step_time`
misses the last two). The ratio is reported as the median over repeats with its min-max spread.

That end-to-end ratio is noisy for a reason beyond machine load: guards change the training trajectory, so the
two runs generate completions of different lengths. The second figure is exact instead: the trainer times its
own guard code (``steadyrl/guard_seconds`` per step: reward gathering for the processor, GRADE, GEPO advantages,
the step decision, guard clocks) and the script divides that by the guarded run's seconds per step.

    python scripts/bench_overhead.py --sft runs/tiny-sft/final --repeats 5 --steps 30
    python scripts/bench_overhead.py --model-size 50m --repeats 3 --steps 10   # cost growth with model size

``--model-size 50m`` trains a randomly initialised 50M-parameter byte-level LLaMA (hidden 768, 7 layers) built
on the fly instead of the SFT checkpoint: its rewards are all zero, which changes nothing about the cost of
the guard code (every layer still runs on every batch and every parameter).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMPRESSED_OPEFO = [  # every OPEFO part paid for in a 20-step run: a check every step, snapshot and floor every 5
    "guards.opefo.rollback.check_interval=1",
    "guards.opefo.rollback.snapshot_interval=5",
    "guards.opefo.floor.interval=5",
]
BETA = ["trainer.beta=0.04"]  # QUATRO's KL controller needs a KL term: both sides of its rows run with it
LAYERS = {  # name: (overrides for both runs, overrides for the guarded run only)
    "GRADE + GEPO": ([], ["guards.grade.enabled=true", "guards.gepo.enabled=true"]),
    "OPEFO (defaults)": ([], ["guards.opefo.enabled=true"]),
    "OPEFO (compressed schedule)": ([], ["guards.opefo.enabled=true", *COMPRESSED_OPEFO]),
    "QUATRO (KL + entropy floor + filters)": (BETA, ["guards.quatro.enabled=true"]),
    "all four (defaults)": (BETA, [
        "guards.grade.enabled=true", "guards.gepo.enabled=true", "guards.opefo.enabled=true",
        "guards.quatro.enabled=true",
    ]),
}  # fmt: skip


MODEL_50M = [
    "model.path=builtin:tiny-llama",
    "model.tiny={hidden_size: 768, num_layers: 7, num_heads: 12, intermediate_size: 2048}",
    "trainer.per_device_train_batch_size=16",
]


def seconds_per_step(sft: str, out: Path, steps: int, extra: list[str]) -> tuple[float, float, float]:
    """(seconds per optimizer step, guard seconds per optimizer step, peak RSS in MiB) of one short run."""
    cmd = [
        sys.executable, "-m", "steadyrl", "train", str(REPO / "configs/tiny/grpo.yaml"),
        *(MODEL_50M if sft == "50m" else [f"model.path={sft}"]),
        f"trainer.output_dir={out}", f"trainer.max_steps={steps}", 'trainer.save_strategy="no"',
        "trainer.logging_steps=1", "eval.enabled=false", "callbacks=[steadyrl.callbacks.memory:PeakMemory]", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    rows = [ast.literal_eval(line) for line in proc.stdout.splitlines() if line.startswith("{'")]
    (summary,) = [row for row in rows if "train_runtime" in row]
    guard = sum(float(row.get("steadyrl/guard_seconds", 0.0)) for row in rows)
    rss = json.loads((out / "peak_memory_rank0.json").read_text())["peak_rss_gib"] * 1024
    return float(summary["train_runtime"]) / steps, guard / steps, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", default="runs/tiny-sft/final", help="model for the 1M size: the demo's SFT checkpoint")
    ap.add_argument("--model-size", choices=["1m", "50m"], default="1m")
    ap.add_argument(
        "--layers",
        default=",".join(LAYERS),
        help=f"comma-separated subset (names hold no commas) of: {', '.join(LAYERS)}",
    )
    ap.add_argument("--out", default="runs/bench-overhead")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    model = args.sft if args.model_size == "1m" else "50m"
    print(
        "| layers | seconds per step off (median) | on (median) | ratio on/off (median, min-max over repeats) "
        "| guard code share of a step (median, min-max) | peak RSS on - off, MiB (median) |"
    )
    print("|---|---|---|---|---|---|")
    chosen = [name.strip() for name in args.layers.split(",")]
    unknown = [name for name in chosen if name not in LAYERS]
    if unknown:
        ap.error(f"unknown layers {unknown}; choose from {list(LAYERS)}")
    for name in chosen:
        common, overrides = LAYERS[name]
        off_all, on_all, ratios, shares, rss_delta = [], [], [], [], []
        for r in range(args.repeats):
            order = [("off", common), ("on", [*common, *overrides])]
            if r % 2:
                order.reverse()
            medians: dict[str, float] = {}
            rss: dict[str, float] = {}
            for label, extra in order:
                run_dir = Path(args.out) / f"{label}-{r}"
                seconds, guard, rss[label] = seconds_per_step(model, run_dir, args.steps, extra)
                medians[label] = seconds
                if label == "on":
                    shares.append(guard / seconds)
            rss_delta.append(rss["on"] - rss["off"])
            off_all.append(medians["off"])
            on_all.append(medians["on"])
            ratios.append(medians["on"] / medians["off"])
        print(
            f"| {name} | {statistics.median(off_all):.4f} | {statistics.median(on_all):.4f} | "
            f"{statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}) | "
            f"{100 * statistics.median(shares):.2f}% ({100 * min(shares):.2f}-{100 * max(shares):.2f}%) | "
            f"{statistics.median(rss_delta):+.1f} |"
        )


if __name__ == "__main__":
    main()
