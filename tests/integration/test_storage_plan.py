"""The storage plan (steadyrl/storage.py): what a run will write to ``output_dir``, from the model's config and the
world size, before the model loads; a run that would fill its disk stops with the plan and the fix, and the plan's
checkpoint matches a real checkpoint's model and optimizer files."""

from __future__ import annotations

import json
from typing import Any

import pytest

from steadyrl import storage
from steadyrl.trainers.build import build_trainer
from tests.integration.helpers import QUIET_TRAINER, write_config

pytestmark = pytest.mark.slow


def _config(tmp_path, model_dir, **trainer: Any):
    cfg = {
        "model": {"path": str(model_dir)},
        "data": {"path": "builtin:arithmetic", "eval_split": "eval", "builtin": {"max_operand": 9, "eval_size": 8}},
        "rewards": [{"fn": "tests.integration.helpers:byte_mean"}],
        "eval": {"every": 2, "metric": "byte_mean", "max_samples": 8},
        "guards": {layer: {"enabled": True} for layer in ("gepo", "opefo", "quatro", "grade")},
        "trainer": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "per_device_train_batch_size": 8,
                    "num_generations": 4, "max_completion_length": 4, **QUIET_TRAINER, **trainer},
    }  # fmt: skip
    return write_config(tmp_path, cfg)


def test_a_run_that_would_fill_its_disk_stops_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    from transformers import AutoModelForCausalLM

    loads: list[str] = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append("model") or 1 / 0)
    real = shutil.disk_usage
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda p: real(p)._replace(free=100_000))  # 100 kB free
    cfg = _config(tmp_path, tiny_model_dir, save_strategy="steps", save_steps=1, save_total_limit=2)
    with pytest.raises(storage.StorageError, match=r"would write up to .* which has 100.0 kB free") as raised:
        build_trainer(cfg)
    assert loads == []  # refused before the weights were read
    text = str(raised.value)
    assert "checkpoint" in text and "x 2 kept" in text and "best-gold/" in text and "save_total_limit" in text


def test_the_plans_checkpoint_is_the_checkpoints_model_optimizer_and_guard_files(tiny_model_dir, tmp_path):
    cfg = _config(tmp_path, tiny_model_dir, save_strategy="steps", save_steps=2, save_total_limit=1)
    trainer = build_trainer(cfg)
    planned = storage.run_plan(cfg, trainer.args, str(tiny_model_dir), 1, {})
    assert planned is not None and planned.checkpoints_kept == 1 and planned.best_gold > 0 and planned.snapshots == 0
    trainer.train()
    folder = tmp_path / "run" / "checkpoint-2"
    files = {f.name: f.stat().st_size for f in folder.rglob("*") if f.is_file()}
    counted = files["model.safetensors"] + files["optimizer.pt"] + sum(v for k, v in files.items() if "steady" in k)
    assert planned.checkpoint == pytest.approx(counted, rel=0.1), json.dumps(files)
    best = tmp_path / "run" / "best-gold"
    kept = (best / "model.safetensors").stat().st_size + (best / "gold_state.pt").stat().st_size
    assert planned.best_gold == pytest.approx(kept, rel=0.1)
