"""`steadyrl reward CONFIG`: the shipped tiny reward config through the real CLI on the tiny test model."""

from __future__ import annotations

import json
import math

import pytest

from tests.integration.test_cli import steadyrl

pytestmark = pytest.mark.slow


def test_reward_cli_trains_and_writes_calibration_report(tiny_model_dir, tmp_path):
    out = tmp_path / "rm"
    proc = steadyrl(
        "reward",
        "configs/tiny/reward.yaml",
        f"model.path={tiny_model_dir}",
        f"trainer.output_dir={out}",
        "data.builtin={n: 64, eval_n: 32, seed: 0}",
        "trainer.num_train_epochs=1",
        "trainer.per_device_train_batch_size=16",
        "trainer.logging_steps=2",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "calibration.json").read_text())
    assert report["n_pairs"] == 32 and sum(report["pairs_by_kind"].values()) == 32
    assert f"held-out pairwise accuracy: {report['accuracy']:.3f} on 32 pairs" in proc.stdout
    stats = json.loads((out / "final" / "reward_stats.json").read_text())
    assert stats["n"] == 64 and math.isfinite(stats["mean"]) and stats["std"] > 0
    assert (out / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "final" / "model.safetensors").is_file() and (out / "resolved_config.yaml").is_file()
    assert json.loads((out / "final" / "config.json").read_text())["architectures"][0].endswith(
        "ForSequenceClassification"
    )
    # the trained model as a config reward function: normalised scores with the calibration stats
    from steadyrl.rewards import bind_reward, load_reward_fn
    from steadyrl.trainers.reward_model import reward_model_score

    spec = "steadyrl.trainers.reward_model:reward_model_score"
    fn = bind_reward("rm", load_reward_fn(spec), {"path": str(out / "final")})
    raw = reward_model_score(["1+2=", "1+2="], ["3", "4"], path=str(out / "final"), normalize=False)
    scores = fn(prompts=["1+2=", "1+2="], completions=["3", "4"], completion_ids=[[0], [0]])
    assert scores == pytest.approx([(r - stats["mean"]) / stats["std"] for r in raw], abs=1e-5)


def test_reward_command_needs_algorithm_reward():
    proc = steadyrl("reward", "configs/tiny/grpo.yaml")
    assert proc.returncode == 1 and "needs algorithm: reward" in proc.stderr
