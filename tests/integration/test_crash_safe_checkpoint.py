"""A run SIGKILLed while writing a checkpoint: the next `resume: auto` run starts from the previous complete
checkpoint and finishes (the half-written one is never picked and is cleaned up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from steadyrl.trainers.checkpoints import COMPLETE_MARKER, STAGING_DIR

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _train(model_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "steadyrl", "train", str(REPO / "configs/tiny/grpo.yaml"), f"model.path={model_dir}",
        f"trainer.output_dir={out}", "trainer.max_steps=6", "trainer.save_steps=2", "trainer.save_total_limit=2",
        "trainer.per_device_train_batch_size=8", "trainer.num_generations=4", "trainer.max_completion_length=4",
        "trainer.logging_steps=1", "rewards=[{fn: 'tests.integration.helpers:byte_mean'}]", "eval.enabled=false",
        "trainer.resume_from_checkpoint=auto", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_sigkill_mid_checkpoint_then_auto_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    killed = _train(tiny_model_dir, out, "callbacks=[tests.integration.rank_dump:KillDuringSave]")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (out / "checkpoint-2" / COMPLETE_MARKER).is_file()
    assert not (out / "checkpoint-4").exists(), "a half-written checkpoint must never sit under its final name"
    assert (out / STAGING_DIR / "checkpoint-4" / "model.safetensors").is_file()  # killed mid-write, in staging

    resumed = _train(tiny_model_dir, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume_from_checkpoint=auto: {out / 'checkpoint-2'}" in resumed.stderr
    final = json.loads((out / "checkpoint-6" / COMPLETE_MARKER).read_text())
    assert final["global_step"] == 6
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    # rotation (save_total_limit=2) kept the two newest complete checkpoints; staging holds nothing stale
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert not any((out / STAGING_DIR).iterdir())
