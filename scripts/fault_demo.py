"""The demo's fault run: the same GRPO twice from one checkpoint, one NaN micro-batch injected at one step.

    plain TRL   every guard layer off (bit-identical to trl.GRPOTrainer)
    steadyrl    the config as shipped (every layer at its default)

Both are ``python -m steadyrl train CONFIG`` processes with ``steadyrl.faults:NanLossAtStep`` (NaN hidden states in
the loss pass of the first micro-batch of step k). Prints one line per run, e.g.

    fault demo: plain TRL  died at step 12: probability tensor contains either `inf`, `nan` or element < 0
    fault demo: steadyrl   finished 60/60 steps, step 12 skipped (nonfinite), accuracy 0.61

Exit 0 when the outcome is the expected one (plain TRL dies or ends with NaN weights, steadyrl finishes with
finite weights after skipping the poisoned step), 1 otherwise.

    python scripts/fault_demo.py --config configs/tiny/grpo-guarded.yaml model.path=runs/tiny-sft/final
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

from steadyrl import metrics as M  # noqa: E402
from steadyrl.faults import FAULT_STEP_ENV, read_fault_log  # noqa: E402

GUARDS_OFF = tuple(f"guards.{layer}.enabled=false" for layer in ("gepo", "opefo", "quatro", "grade"))
ERROR_LINE = re.compile(r"^(\w+(Error|Exception)): (.+)$")


def _error(log: str) -> str:
    """The last ``SomethingError: message`` line of a log (the exception that ended the run)."""
    found = [m[3] for line in log.splitlines() if (m := ERROR_LINE.match(line.strip()))]
    return found[-1][:100] if found else "no error line in the log"


def run(name: str, config: str, overrides: list[str], out: Path, steps: int, step: int) -> dict[str, Any]:
    cmd = X.train_command(config, *overrides, f"trainer.output_dir={out}",
           f"trainer.max_steps={steps}", "trainer.resume_from_checkpoint=null", 'trainer.save_strategy="no"',
           "callbacks=['steadyrl.faults:NanLossAtStep']")  # fmt: skip
    env = {**os.environ, FAULT_STEP_ENV: str(step)}  # the caller's threads: the demo's numbers stay its own
    done = X.launch(cmd, out, env=env, timeout=3600, cwd=None, log_name="fault_demo.log", label=name)
    fired = [row["step"] for row in read_fault_log(out) if row["fault"] == "nan_loss"]
    skips = done.history.events_of(M.EVENT_SKIP) if done.history is not None else []
    return {
        "name": name,
        "returncode": done.returncode,
        "last_step": done.last_step,
        "fired_at": fired[0] if fired else None,
        "skips": [(e.get("step"), e.get("reason")) for e in skips],
        "accuracy": done.eval["accuracy"] if done.eval else None,
        "error": _error(done.log) if done.returncode != 0 else None,
    }


def line(r: dict[str, Any], steps: int) -> str:
    label = f"fault demo: {r['name']:<10}"
    if r["fired_at"] is None:
        return f"{label} the fault did not fire (exit {r['returncode']})"
    if r["returncode"] != 0:
        # the fault step itself completes (plain TRL applies the NaN update); metrics.jsonl may log less often
        return f"{label} died at step {max(r['last_step'] or 0, r['fired_at'])}: {r['error']}"
    skipped = ", ".join(f"step {s} skipped ({why})" for s, why in r["skips"]) or "nothing skipped"
    acc = f", accuracy {r['accuracy']:.2f}" if r["accuracy"] is not None else ""
    return f"{label} finished {r['last_step']}/{steps} steps, {skipped}{acc}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny/grpo-guarded.yaml")
    ap.add_argument("--out", default="runs/fault-demo")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-step", type=int, default=12)
    ap.add_argument("overrides", nargs="*", help="dotted overrides for both runs (e.g. model.path=...)")
    args = ap.parse_args()
    out = Path(args.out)
    plain = run("plain TRL", args.config, [*args.overrides, *GUARDS_OFF], out / "plain", args.steps, args.fault_step)
    print(line(plain, args.steps), flush=True)
    steady = run("steadyrl", args.config, list(args.overrides), out / "steadyrl", args.steps, args.fault_step)
    print(line(steady, args.steps), flush=True)
    expected = plain["fired_at"] is not None and plain["returncode"] != 0
    expected = expected and steady["returncode"] == 0 and steady["last_step"] == args.steps and bool(steady["skips"])
    (out / "fault_demo.json").write_text(json.dumps({"plain": plain, "steadyrl": steady}, indent=1) + "\n")
    return 0 if expected else 1


if __name__ == "__main__":
    sys.exit(main())
