"""The real CLI on the tiny model: validate, train, resolved config, final model, eval, auto-resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def steadyrl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "steadyrl", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_validate_reports_unknown_key_with_suggestion():
    proc = steadyrl("validate", "configs/tiny/grpo.yaml", "trainer.learnig_rate=1e-5")
    assert proc.returncode == 1
    assert "unknown key 'learnig_rate'" in proc.stderr and "Did you mean 'learning_rate'" in proc.stderr
    ok = steadyrl("validate", "configs/tiny/grpo.yaml", "trainer.learning_rate=1e-6")
    assert ok.returncode == 0
    assert yaml.safe_load(ok.stdout)["trainer"]["learning_rate"] == 1e-6


def test_train_writes_config_model_eval_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        "configs/tiny/grpo.yaml",
        f"model.path={tiny_model_dir}",
        f"trainer.output_dir={out}",
        "trainer.max_steps=2",
        "trainer.save_steps=2",
        "trainer.per_device_train_batch_size=8",
        "trainer.num_generations=4",
        "trainer.max_completion_length=4",
        "eval.max_samples=16",
    ]
    first = steadyrl(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert yaml.safe_load((out / "resolved_config.yaml").read_text())["trainer"]["max_steps"] == 2
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "tokenizer.json").is_file()
    result = json.loads((out / "eval_results.json").read_text())
    assert result["metric"] == "exact_match" and 0.0 <= result["accuracy"] <= 1.0
    assert f"eval exact_match after GRPO: {result['accuracy']:.3f}" in first.stdout
    assert "no complete checkpoint, starting fresh" in first.stderr

    # resume_from_checkpoint: auto picks checkpoint-2 and trains on to step 4
    second = steadyrl(*args[:-6], "trainer.max_steps=4", *args[-5:])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resume_from_checkpoint=auto: {out / 'checkpoint-2'}" in second.stderr
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4


def test_missing_resume_path_is_a_clear_error(tmp_path):
    proc = steadyrl("train", "configs/tiny/grpo.yaml", f"trainer.resume_from_checkpoint={tmp_path / 'nope'}")
    assert proc.returncode == 1 and "does not exist" in proc.stderr
