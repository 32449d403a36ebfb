"""Write the demo's numbers to a results file (format: docs/results/*.json), read from the runs it just made.

    bash scripts/demo.sh --results docs/results/demo.json      # demo.sh calls this at its end

Reads ``runs/tiny-sft``, ``runs/tiny-grpo`` (eval results, metrics.jsonl, the doctor's findings) and
``runs/fault-demo/fault_demo.json`` and ``runs/hacking-demo/hacking_demo.json``; records the commit it ran at
("-dirty" when the tree had changes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from experiments import commit

from steadyrl import metrics as M
from steadyrl.evidence.doctor import diagnose, doctor_config_for
from steadyrl.evidence.history import load_history


def machine() -> str:
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    return f"{os.cpu_count()}-core {platform.machine()} CPU (torch kernels {isa}), no GPU"


def cell(scenario: str, variant: str, died: bool, accuracy: float | None, note: str, **metrics: Any) -> dict:
    return {
        "scenario": scenario,
        "variant": variant,
        "seeds": [0],
        "died": [died],
        "accuracy": [accuracy],
        "metrics": {k: [v] for k, v in metrics.items()},
        "note": note,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=Path, default=Path("runs"))
    ap.add_argument("--wall-s", type=float, required=True, help="the demo's wall time (demo.sh measures it)")
    ap.add_argument("--commit", default=None, help="the commit the demo ran at (default: HEAD now)")
    ap.add_argument("--tag", default="", help="a suffix for every scenario name (-default: another kernel path)")
    args = ap.parse_args()
    sft = json.loads((args.runs / "tiny-sft" / "eval_results.json").read_text())
    grpo = json.loads((args.runs / "tiny-grpo" / "eval_results.json").read_text())
    history = load_history(args.runs / "tiny-grpo")
    findings = diagnose(history, doctor_config_for(args.runs / "tiny-grpo"))
    skips = history.events_of(M.EVENT_SKIP)
    rollbacks = history.events_of(M.EVENT_ROLLBACK)
    fault = json.loads((args.runs / "fault-demo" / "fault_demo.json").read_text())
    plain, steady = fault["plain"], fault["steadyrl"]
    hacking_file = args.runs / "hacking-demo" / "hacking_demo.json"  # absent when the hacking demo failed to run
    hacking = json.loads(hacking_file.read_text()) if hacking_file.is_file() else {}
    cells = [
        cell("clean", "sft", False, sft["accuracy"], "greedy eval accuracy after SFT (exact_match)",
             numeric_match=sft["rewards"].get("numeric_match"), demo_wall_s=round(args.wall_s)),
        cell("clean", "all", False, grpo["accuracy"],
             "greedy eval accuracy after GRPO, every layer at its shipped default (configs/tiny/grpo-guarded.yaml)",
             numeric_match=grpo["rewards"].get("numeric_match"), skipped_steps=len(skips),
             rollbacks=len(rollbacks), doctor_findings=[f.headline for f in findings]),
        cell("nan_loss_step_12", "plain", plain["returncode"] != 0, plain["accuracy"],
             f"fault demo, plain TRL: {plain['error'] or 'finished'}"),
        cell("nan_loss_step_12", "all", steady["returncode"] != 0, steady["accuracy"],
             "fault demo, steadyrl: " + (", ".join(f"step {s} skipped ({why})" for s, why in steady["skips"]) or
                                          "nothing skipped"),
             skipped_steps=len(steady["skips"]), last_step=steady["last_step"]),
        *(cell("lenient_verifier", variant, r["status"] != "ok", r.get("gold_final"),
               f"hacking demo, {r['name']}: gold metric (exact_match) at the end; training reward answer_anywhere + "
               "0.02 x answer_length", **{k: r.get(k) for k in ("gold_peak", "peak_step", "reward_at_peak",
                                                                 "reward_final", "acted_steps", "last_step")})
          for variant, r in (("plain", hacking.get("plain")), ("all", hacking.get("steadyrl"))) if r),
    ]  # fmt: skip
    for c in cells:
        c["scenario"] += args.tag
    aten = os.environ.get("ATEN_CPU_CAPABILITY")
    command = (f"ATEN_CPU_CAPABILITY={aten} " if aten else "") + f"bash scripts/demo.sh --results {args.out}"
    record = {
        "benchmark": "demo",
        "command": command + (f" --tag {args.tag}" if args.tag else ""),
        "commit": args.commit or commit(),
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "model": "tiny-llama-0.9m",
        "steps": 200,
        "cells": cells,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
