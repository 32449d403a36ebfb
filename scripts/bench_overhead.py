"""Overhead of the guard layers: guards on vs off, alternating in one invocation, at three model sizes.

Each repeat trains the same short GRPO run twice, guards off and on (the order alternates between repeats, so drift
in machine load hits both sides), and takes the Trainer's ``train_runtime`` per optimizer step: it covers
generation, rewards, advantages, backward, the step guards and the optimizer step (TRL's own ``step_time`` misses
the last two). Three figures per row:

- **same-trajectory ratio** (rows ``... (observe)``): every layer in observe mode computes and logs every decision
  and changes nothing, so the two runs train exactly alike (the script checks it: equal per-step losses and
  completion lengths) and their time ratio is the whole cost steadyrl adds, timed or not. Observe mode leaves out
  OPEFO's snapshots (they exist only to be restored) and QUATRO's replay; the act rows below carry those costs.
- **guard-code share**: the trainer times its own guard code (``steadyrl/guard_seconds`` per step: rewards for the
  processor, GRADE, GEPO advantages and their observe twin, the step decision and the micro-batch gate, QUATRO's
  filters and controllers, OPEFO's checks, snapshots and floor, the entropy/log-prob hooks), divided by the
  guarded run's seconds per step.
- **act-mode ratio** (other rows): the guards act, so the trajectories differ (filters drop rows, the KL
  controller moves beta, completions change length); this ratio is noisy for that reason, not only for load.

Peak RSS is the process's ``ru_maxrss`` (``PeakMemory``). The median over repeats is reported with its min-max. It
is the allocator's figure as much as steadyrl's (runs that train bit-identically differ by hundreds of MiB on the
135M model), so each run also reports what the layers hold: ``guard_held_tensor_mib``, every tensor reachable from
the guard objects at the end of training (``OUTPUT_DIR/guard_cost.json``, ``steadyrl.trainers.guard_memory``).

    OMP_NUM_THREADS=2 python scripts/bench_overhead.py --size tiny --repeats 5 --steps 30
    OMP_NUM_THREADS=2 python scripts/bench_overhead.py --size 50m --repeats 5 --steps 10 --layers observe,act
    OMP_NUM_THREADS=2 python scripts/bench_overhead.py --size 135m --repeats 5 --steps 4 --layers observe,act

Sizes: ``tiny`` is the demo's SFT checkpoint (0.9M parameters, byte-level), ``50m`` a randomly initialised 50M
byte-level LLaMA (hidden 768, 7 layers; its rewards are all zero, which changes nothing about the guard code's
cost: every layer still runs on every batch and every parameter), ``135m`` SmolLM2-135M-Instruct with LoRA
(``configs/small/grpo-lora.yaml``, the real-model default). Results merge into ``--results`` by (size, row).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

LAYER_NAMES = ("grade", "gepo", "opefo", "quatro")
COMPRESSED_OPEFO = [  # every OPEFO part paid for in a 20-step run: a check every step, snapshot and floor every 5
    "guards.opefo.rollback.check_interval=1",
    "guards.opefo.rollback.snapshot_interval=5",
    "guards.opefo.floor.interval=5",
]
ALL_ON = [f"guards.{layer}.enabled=true" for layer in LAYER_NAMES]
ALL_OBSERVE = [*ALL_ON, *(f"guards.{layer}.mode=observe" for layer in LAYER_NAMES)]
ROWS = {  # key: (label, guarded-run overrides); both runs get the size's own overrides (beta > 0 for QUATRO's KL)
    "observe": ("all four (observe: same trajectory)", ALL_OBSERVE),
    "act": ("all four (act, defaults)", ALL_ON),
    "grade": ("GRADE", ["guards.grade.enabled=true"]),
    "gepo": ("GEPO", ["guards.gepo.enabled=true"]),
    "opefo": ("OPEFO (defaults)", ["guards.opefo.enabled=true"]),
    "opefo-compressed": ("OPEFO (compressed schedule)", ["guards.opefo.enabled=true", *COMPRESSED_OPEFO]),
    # the snapshot's size: held in RAM (configs/base/grpo.yaml keeps it on disk), read from guard_cost.json; a
    # snapshot every 2 steps, so the one held at the end has Adam's moments (the one at train begin has none yet)
    "opefo-ram": (
        "OPEFO, snapshots in RAM",
        [
            "guards.opefo.enabled=true",
            "guards.opefo.rollback.storage=memory",
            "guards.opefo.rollback.snapshot_interval=2",
        ],
    ),
    "quatro": ("QUATRO (KL + entropy floor + filters)", ["guards.quatro.enabled=true"]),
}
OFF = [f"guards.{layer}.enabled=false" for layer in LAYER_NAMES]
SIZES = {  # name: (config, overrides for both runs, model label)
    "tiny": ("configs/tiny/grpo.yaml", ["trainer.beta=0.04"], "tiny-llama-0.9m (demo SFT checkpoint)"),
    "50m": ("configs/tiny/grpo.yaml", [
        "trainer.beta=0.04", "model.path=builtin:tiny-llama",
        "model.tiny={hidden_size: 768, num_layers: 7, num_heads: 12, intermediate_size: 2048}",
        "trainer.per_device_train_batch_size=16",
    ], "byte-level llama 50m (random init)"),
    "135m": ("configs/small/grpo-lora.yaml", [], "smollm2-135m-instruct + LoRA r16"),
}  # fmt: skip


def train(config: str, out: Path, steps: int, extra: list[str]) -> dict[str, Any]:
    """Seconds per optimizer step, guard seconds per step, peak RSS (MiB), per-step losses and lengths of one run."""
    cmd = X.train_command(
        REPO / config, *extra,
        f"trainer.output_dir={out}", f"trainer.max_steps={steps}", 'trainer.save_strategy="no"',
        "trainer.logging_steps=1", "trainer.resume_from_checkpoint=null", "eval.enabled=false", "eval.every=0",
        "callbacks=[steadyrl.callbacks.memory:PeakMemory]",
    )  # fmt: skip
    env = X.run_env({"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    run = X.launch(cmd, out, env=env)
    if run.status != "ok":
        raise SystemExit(f"run failed ({run.returncode}): {' '.join(cmd)}\n{run.log[-3000:]}")
    rows = run.history.rows  # metrics.jsonl: full-precision floats (the printed rows are rounded)
    runtime = next(float(row["train_runtime"]) for row in rows if "train_runtime" in row)
    steps_rows = [row for row in rows if "loss" in row and "train_runtime" not in row]
    guard = sum(float(row.get("steadyrl/guard_seconds") or 0.0) for row in rows)
    rss = json.loads((out / "peak_memory_rank0.json").read_text())["peak_rss_gib"] * 1024
    cost_file = out / "guard_cost.json"  # the same seconds split by the layer whose code ran; the tensors it holds
    cost = json.loads(cost_file.read_text()) if cost_file.is_file() else {}
    parts, held = cost.get("seconds_by_part", {}), cost.get("held_mib_by_part", {})
    return {
        "seconds": runtime / steps,
        "guard": guard / steps,
        "parts": {name: value / runtime for name, value in parts.items()},  # share of the run's time
        "held_mib": sum(held.values()),
        "rss": rss,
        "losses": [float(row["loss"]) for row in steps_rows],
        "lengths": [float(row.get("completions/mean_length", "nan")) for row in steps_rows],
    }


def spread(values: list[float], fmt: str = ".3f", scale: float = 1.0, unit: str = "") -> str:
    vals = [scale * v for v in values]
    return f"{statistics.median(vals):{fmt}}{unit} ({min(vals):{fmt}}-{max(vals):{fmt}}{unit})"


def measure(size: str, key: str, repeats: int, steps: int, out: Path) -> dict[str, Any]:
    config, common, _ = SIZES[size]
    label, guarded = ROWS[key]
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for r in range(repeats):
        order = [("off", [*common, *OFF]), ("on", [*common, *OFF, *guarded])]
        if r % 2:
            order.reverse()
        for side, extra in order:
            runs[side].append(train(config, out / size / key / f"{side}-{r}", steps, extra))
            print(f"[bench_overhead] {size} {key} repeat {r} {side}: {runs[side][-1]['seconds']:.3f} s/step",
                  flush=True)  # fmt: skip
    off, on = runs["off"], runs["on"]
    same = [a["losses"] == b["losses"] and a["lengths"] == b["lengths"] for a, b in zip(off, on, strict=True)]
    part_names = sorted({name for b in on for name in b["parts"]})
    return {
        "scenario": size,
        "variant": key,
        "label": label,
        "seeds": [0] * repeats,
        "died": [False] * repeats,
        "accuracy": [None] * repeats,
        "metrics": {
            "step_time_ratio": [b["seconds"] / a["seconds"] for a, b in zip(off, on, strict=True)],
            "guard_share": [b["guard"] / b["seconds"] for b in on],
            "peak_rss_delta_mib": [b["rss"] - a["rss"] for a, b in zip(off, on, strict=True)],
            "same_trajectory": same,
            "seconds_per_step_off": [a["seconds"] for a in off],
            "seconds_per_step_on": [b["seconds"] for b in on],
            "guard_seconds_per_step": [b["guard"] for b in on],
            **{f"guard_share/{name}": [b["parts"].get(name, 0.0) for b in on] for name in part_names},
            "guard_held_tensor_mib": [b["held_mib"] for b in on],
        },
        "note": f"{steps} steps per run, off/on alternating over {repeats} repeats; seconds are this machine's",
    }


def row_text(cell: dict[str, Any]) -> str:
    m = cell["metrics"]
    same = "yes" if all(m["same_trajectory"]) else f"no ({sum(m['same_trajectory'])}/{len(m['same_trajectory'])})"
    return (f"| {cell['scenario']} | {cell['label']} | {statistics.median(m['seconds_per_step_off']):.3f} | "
            f"{statistics.median(m['seconds_per_step_on']):.3f} | {spread(m['step_time_ratio'], unit='x')} | "
            f"{spread(m['guard_share'], '.2f', 100, '%')} | {statistics.median(m['peak_rss_delta_mib']):+.0f} | "
            f"{same} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(SIZES), default="tiny")
    ap.add_argument("--sft", default="runs/demo-sft/final", help="the tiny size's model: the demo's SFT checkpoint")
    ap.add_argument("--layers", default=",".join(ROWS), help=f"comma-separated rows: {', '.join(ROWS)}")
    ap.add_argument("--out", default="runs/bench-overhead")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--results", default="docs/results/overhead.json")
    args = ap.parse_args()
    keys = [k.strip() for k in args.layers.split(",")]
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.size == "tiny":
        SIZES["tiny"][1].append(f"model.path={args.sft}")
    code_commit = X.commit()
    cells = [measure(args.size, key, args.repeats, args.steps, Path(args.out)) for key in keys]
    print("| size | layers | s/step off | s/step on | ratio on/off (median, min-max) | guard-code share (median, "
          "min-max) | peak RSS on - off, MiB | same trajectory |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for cell in cells:
        print(row_text(cell))
    print("\n| size | layers | guard-code share by part (median over repeats; the parts add up to the share) | "
          "tensors the layers hold at the end, MiB |")  # fmt: skip
    print("|---|---|---|---|")
    for cell in cells:
        m = cell["metrics"]
        parts = {k.removeprefix("guard_share/"): v for k, v in m.items() if k.startswith("guard_share/")}
        text = ", ".join(f"{name} {100 * statistics.median(v):.2f}%" for name, v in parts.items())
        held = statistics.median(m["guard_held_tensor_mib"])
        print(f"| {cell['scenario']} | {cell['label']} | {text or 'n/a'} | {held:.1f} |")
    command = (
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} python scripts/bench_overhead.py "
        + " ".join(sys.argv[1:])
    )
    for cell in cells:
        cell.update(command=command, commit=code_commit, model=SIZES[args.size][2], steps=args.steps)
    doc = X.results_doc("overhead", cells, command=command, sha=code_commit, model="per cell", steps=args.steps)
    path = REPO / args.results  # cells of other sizes and rows stay: each carries its own command and commit
    X.write_results(path, doc, merge=True, same=(), indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
