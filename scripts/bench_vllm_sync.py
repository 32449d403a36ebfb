"""Does each weight sync reach vLLM? Two tiny GRPO runs with vLLM colocate rollouts, one with the sync stopped.

Run in an environment with vLLM (``bash scripts/test_vllm_cpu.sh`` builds ``.venv-vllm``):

    .venv-vllm/bin/python scripts/bench_vllm_sync.py --sft runs/demo-sft/final --steps 20

Both runs are identical except that the second adds ``steadyrl.faults:StaleVllmAfterStep`` (every sync after step
``--stale-after`` does nothing). Prints the per-step vLLM-policy log-prob gap (TRL's
``sampling/sampling_logp_difference/mean``) of both and whether the GEPO monitor warned, and draws both curves
to ``docs/img/vllm_sync.png`` (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GAP = "sampling/sampling_logp_difference/mean"


def run(sft: str, out: Path, steps: int, stale_after: int | None) -> tuple[list[tuple[int, float]], int | None]:
    shutil.rmtree(out, ignore_errors=True)  # metrics.jsonl appends: a rerun must not extend the old series
    cmd = [
        sys.executable, "-m", "steadyrl", "train", "configs/tiny/grpo.yaml",
        f"model.path={sft}", f"trainer.output_dir={out}", f"trainer.max_steps={steps}",
        "trainer.learning_rate=1.0e-4", "trainer.use_vllm=true", "trainer.vllm_mode=colocate",
        "trainer.logging_steps=1", 'trainer.save_strategy="no"', "eval.every=0",
        "guards.gepo.enabled=true", "guards.gepo.monitor.every=1", "guards.gepo.monitor.window=5",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    if stale_after is not None:
        cmd.append('callbacks=["steadyrl.faults:StaleVllmAfterStep"]')
        env["STEADYRL_FAULT_STEP"] = str(stale_after)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({out}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    warned = re.search(r"step (\d+): EARLY WARNING: vLLM", proc.stderr)
    return [(r["step"], r[GAP]) for r in rows if GAP in r], int(warned.group(1)) if warned else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", default="runs/demo-sft/final", help="the SFT checkpoint to start from")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stale-after", type=int, default=5, help="the stale run's last synced step")
    parser.add_argument("--out", default="runs/bench-vllm-sync")
    parser.add_argument("--plot", default="docs/img/vllm_sync.png", help="PNG to write ('' for none)")
    args = parser.parse_args()
    out = Path(args.out)
    synced, warned_synced = run(args.sft, out / "synced", args.steps, None)
    stale, warned_stale = run(args.sft, out / "stale", args.steps, args.stale_after)
    print(f"{'step':>4} {'synced':>10} {'stale':>10}")
    for (step, a), (_, b) in zip(synced, stale, strict=True):
        print(f"{step:>4} {a:>10.4g} {b:>10.4g}")
    after = [v for s, v in stale if s > args.stale_after + 1]
    print(f"synced: median {statistics.median(v for _, v in synced):.4g}, max {max(v for _, v in synced):.4g}, "
          f"first monitor warning at step: {warned_synced}")  # fmt: skip
    print(f"stale after step {args.stale_after}: median {statistics.median(after):.4g} over steps "
          f"{args.stale_after + 2}-{args.steps}, first monitor warning at step: {warned_stale}")  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(*zip(*synced, strict=True), marker=".", label="weight sync every step")
        ax.plot(*zip(*stale, strict=True), marker=".", label=f"sync stopped after step {args.stale_after}")
        ax.axhline(0.1, color="red", linestyle="--", label="monitor / doctor absolute threshold")
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("|vLLM - policy| log-prob, nats/token")
        ax.set_title("vLLM colocate rollouts, tiny GRPO: does vLLM sample from the trained weights?")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
