"""How accumulation dilutes one poisoned micro-batch, on real 2-process launches (DDP on CPU, gloo).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_micro_dilution.py --results docs/results/micro_dilution.json

``accelerate launch`` with 2 processes x 4 accumulation steps (N = 8 micro-batches a step) on the tiny config and a
random tiny model, GEPO on (its spike guard: ``min_ratio`` 100, ``warmup_steps`` 4). At step 6, every gradient of
rank 1's first micro-batch is multiplied by k (``steadyrl.faults:MicroBatchSpikeAtStep``). For each k and each
``guards.gepo.spike.granularity`` (``step``: one decision on the global norm after accumulation and the all-reduce;
``micro_batch``: each micro-batch judged on its own): whether step 6 was skipped or the micro-batch dropped, and the
step's gradient norm over the median of the 5 before it. docs/DESIGN.md ("GEPO: spike skip") gives the formula:
the step rule sees it only from k ~ ``min_ratio`` x sqrt(N) (uncorrelated gradients, 283 here) to ``min_ratio`` x N
- (N - 1) (aligned, 793).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

FACTORS = (10.0, 100.0, 300.0, 1000.0, 10000.0)
GRANULARITIES = ("step", "micro_batch")
STEP = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(model: Path, out: Path, granularity: str, seed: int) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(REPO / "configs/accelerate/multi_cpu.yaml"), "--num_processes", "2",
        "--main_process_port", str(free_port()),
        "-m", "steadyrl", "train", str(REPO / "configs/tiny/grpo.yaml"),
        f"model.path={model}", f"trainer.output_dir={out}", f"trainer.seed={seed}",
        "trainer.max_steps=8", "trainer.per_device_train_batch_size=2", "trainer.gradient_accumulation_steps=4",
        "trainer.num_generations=4", "trainer.max_completion_length=4", "trainer.logging_steps=1",
        'trainer.save_strategy="no"', "trainer.ddp_backend=gloo", "trainer.max_grad_norm=1.0",
        "rewards=[{fn: 'tests.integration.helpers:byte_mean'}]", "eval.enabled=false",
        "guards.gepo.enabled=true", "guards.gepo.spike.warmup_steps=4", f"guards.gepo.spike.granularity={granularity}",
        'callbacks=["steadyrl.faults:MicroBatchSpikeAtStep"]',
    ]  # fmt: skip


def summarise(job: X.Job, run: X.Outcome) -> dict[str, Any]:
    out: dict[str, Any] = {"status": run.status, "wall_s": run.wall_s}
    if run.history is None:
        return out
    steps, norms = run.history.finite("grad_norm")
    by_step = dict(zip(steps.tolist(), norms.tolist(), strict=True))
    before = [by_step[s] for s in range(1, STEP) if s in by_step]
    if STEP in by_step and before:
        out["norm_ratio"] = by_step[STEP] / statistics.median(before)
    out["step_skipped"] = f"step {STEP}: optimizer step skipped (spike" in run.log
    out["micro_batch_dropped"] = f"step {STEP}: micro-batch" in run.log and "dropped (spike" in run.log
    out["fault_fired"] = '"micro_batch_spike"' in (job.out / "faults.jsonl").read_text() if (
        job.out / "faults.jsonl").is_file() else False  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench-micro-dilution")
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    from steadyrl.tasks import build_tiny_model

    root = Path(args.out)
    model = root / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(model)
    jobs = []
    for granularity in GRANULARITIES:
        for k in FACTORS:
            out = root / f"{granularity}-k{k:g}"
            env = (("STEADYRL_FAULT_STEP", str(STEP)), ("STEADYRL_FAULT_RANK", "1"), ("STEADYRL_FAULT_SCALE", f"{k:g}"))
            cmd = tuple(command(model, out, granularity, args.seed))
            jobs.append(X.Job(granularity, f"k{k:g}", args.seed, out, cmd, env))

    def progress(job: X.Job, r: dict[str, Any]) -> None:
        print(f"{job.variant} {job.scenario}: {r}", flush=True)

    done = X.run_jobs(jobs, summarise, timeout=900, after=progress)
    keys = ["norm_ratio", "step_skipped", "micro_batch_dropped", "fault_fired", "wall_s"]
    cells = [X.cell(f"k{k:g}", g, [args.seed], [done[(g, f"k{k:g}", args.seed)]], keys,
                    died=lambda r: r["status"] != "ok") for g in GRANULARITIES for k in FACTORS]  # fmt: skip
    for c in cells:
        m = c["metrics"]
        print(f"{c['variant']:>12} {c['scenario']:>7}: norm x{m['norm_ratio'][0]}, step skipped "
              f"{m['step_skipped'][0]}, micro-batch dropped {m['micro_batch_dropped'][0]}")  # fmt: skip
    if args.results:
        doc = X.results_doc(
            "micro_dilution", cells, command=X.script_command("bench_micro_dilution.py"), sha=X.commit(),
            model="tiny-llama (random), 2 processes x 4 accumulation (DDP, gloo)", steps=8, poisoned_step=STEP,
        )  # fmt: skip
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
