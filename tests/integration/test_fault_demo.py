"""scripts/fault_demo.py on the tiny random model: plain TRL dies at the NaN micro-batch, steadyrl skips it and
finishes; the printed lines say so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_fault_demo_plain_dies_and_steadyrl_finishes(tiny_model_dir, tmp_path):
    small = ["trainer.per_device_train_batch_size=8", "trainer.num_generations=4", "trainer.max_completion_length=4",
             "eval.max_samples=16", "eval.every=0"]  # fmt: skip
    cmd = [sys.executable, "scripts/fault_demo.py", "--config", "configs/tiny/grpo-guarded.yaml", "--out",
           str(tmp_path), "--steps", "6", "--fault-step", "3", f"model.path={tiny_model_dir}", *small]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    plain, steady = proc.stdout.splitlines()[-2:]
    assert plain.startswith("fault demo: plain TRL  died at step 3")
    assert steady.startswith("fault demo: steadyrl   finished 6/6 steps, step 3 skipped (nonfinite), accuracy ")
    result = json.loads((tmp_path / "fault_demo.json").read_text())
    assert result["plain"]["fired_at"] == 3 and result["steadyrl"]["fired_at"] == 3
