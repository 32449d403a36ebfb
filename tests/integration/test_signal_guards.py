"""GRADE + GEPO wired from the config survive a hostile reward: 1e9 outliers, inf and unscorable rows."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl.config import load_config
from steadyrl.evidence.early_warnings import early_warnings
from steadyrl.trainers.build import build_trainer
from tests.integration.helpers import (
    QUIET_TRAINER,
    RecordingGrade,
    TrainedOn,
    per_step,
    tiny_grpo_trainer,
    write_config,
)

pytestmark = pytest.mark.slow


def _config(tmp_path, model_dir, guards, **trainer):
    cfg = {
        "model": {"path": str(model_dir)},
        "data": {"path": "builtin:arithmetic", "builtin": {"max_operand": 9, "eval_size": 10}},
        "rewards": [{"fn": "tests.integration.helpers:hostile_reward"}],
        "guards": guards,
        "trainer": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 4,
            "per_device_train_batch_size": 16,
            "num_generations": 8,
            "max_completion_length": 4,
            "learning_rate": 1e-3,
            "max_grad_norm": 1.0,
            **QUIET_TRAINER,
            **trainer,
        },
    }
    return write_config(tmp_path, cfg)


def test_hostile_rewards_are_tamed(tiny_model_dir, tmp_path):
    guards = {
        "gepo": {
            "enabled": True,
            "advantage": {"clip_scale": 3.0},
            "spike": {"warmup_steps": 2},
            "monitor": {"every": 2, "window": 2},
        },
        # tau 0.2: the 1e9 rows are 2 of the 14 finite ones (14%), so the 97% quantile is 1e9 itself, which
        # ties them (a mass, not a tail); the 80% quantile is a normal reward
        "grade": {"enabled": True, "window_size": 64, "warmup": 16, "clip_start": 16, "quantile_every": 1, "tau": 0.2},
    }
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, guards))
    assert type(trainer.parts.reward_processor).__name__ == "GradeScaler"
    assert type(trainer.parts.advantage_fn).__name__ == "GEPOAdvantage"
    assert [type(g).__name__ for g in trainer.parts.step_guards] == ["SpikeGuard"]
    trainer.train()

    assert trainer.state.global_step == 4
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    history = trainer.state.log_history
    # per 16-completion batch: one inf (i=10) and one None (i=12) are unscorable; 1e9 at i=6 and i=13
    assert per_step(history, "gepo/nonfinite_rewards") == [2.0, 2.0, 2.0, 2.0]
    assert all(a <= 3.0 for a in per_step(history, "gepo/adv_max_abs"))
    clip_high = per_step(history, "grade/clip_frac_high")
    assert len(clip_high) == 4 and max(clip_high) > 0  # the 1e9 rows are tail-clipped once the window is warm
    assert all(math.isfinite(x) for x in per_step(history, "grade/scaled_std"))
    assert per_step(history, "gepo/skipped_steps")[-1] == trainer.parts.step_guards[0].skipped
    (monitor,) = [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "SignalMonitor"]
    # it ran at steps 2 and 4 and warned exactly what the rules say of the history logged by then
    assert monitor._last_step == 4
    upto = {s: [r for r in history if r.get("step", 0) <= s] for s in (2, 4)}
    assert monitor.warnings == [(s, w) for s in (2, 4) for w in early_warnings(upto[s], monitor.config)]
    assert trainer.parts.logprob_min == -100.0 and per_step(history, "gepo/nonfinite_logprobs") == [0.0] * 4
    assert per_step(history, "gepo/nonfinite_ratios") == [0.0] * 4
    assert per_step(history, "gepo/nonfinite_loss") == [0.0] * 4


def test_spike_guard_needs_clipping_and_layers_validate(tiny_model_dir, tmp_path):
    from steadyrl.config import ConfigError

    assert _config(tmp_path, tiny_model_dir, {"gepo": {"enabled": True}}).guards.gepo.spike.enabled
    with pytest.raises(ConfigError, match=r"and guards.opefo need trainer.max_grad_norm > 0"):
        load_config(tmp_path / "cfg.yaml", ["trainer.max_grad_norm=0"])
    with pytest.raises(ConfigError, match=r"guards.gepo.advantage.clip_scale"):
        load_config(tmp_path / "cfg.yaml", ["guards.gepo.advantage.clip_scale=9"])
    with pytest.raises(ConfigError, match=r"guards.grade.tau \(set in command line\): must be in \(0, 0.5\)"):
        load_config(tmp_path / "cfg.yaml", ["guards.grade.tau=0.7"])


def test_logprob_floor_clamps_minus_inf(tiny_model_dir, tmp_path):
    """A -inf per-token log-prob (a token the policy gives probability 0) is floored at logprob_min and counted."""
    from trl import GRPOTrainer

    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {"gepo": {"enabled": True, "logprob_min": -100.0}}))
    original = GRPOTrainer._get_per_token_logps_and_entropies

    def with_minus_inf(self, *args, **kwargs):
        logps, ent, aux = original(self, *args, **kwargs)
        return logps.index_fill(1, torch.tensor([0]), float("-inf")), ent, aux

    ids = torch.tensor([[ord(c) + 3 for c in "1+2=3"]])
    trainer.model.train()
    try:
        GRPOTrainer._get_per_token_logps_and_entropies = with_minus_inf
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 2)
    finally:
        GRPOTrainer._get_per_token_logps_and_entropies = original
    assert logps[0, 0].item() == -100.0 and torch.isfinite(logps).all()
    assert trainer._metrics["train"]["gepo/nonfinite_logprobs"] == [1.0]


def test_grade_kl_compensation_scales_beta(tiny_model_dir, tmp_path):
    """Once GRADE whitens, beta = base beta x clamp(raw_std / scaled_std); before that the factor is 1."""
    grade = {"enabled": True, "window_size": 64, "warmup": 16, "clip": False, "centring_beta": 0.0}
    trainer = build_trainer(_config(tmp_path, tiny_model_dir, {"grade": {**grade, "kl_compensation": True}}, beta=0.04))
    trainer.train()
    history = trainer.state.log_history
    factors, betas = per_step(history, "grade/kl_factor"), per_step(history, "grade/beta")
    raw, scaled = per_step(history, "grade/raw_std"), per_step(history, "grade/scaled_std")
    assert factors[0] == 1.0 and betas[0] == pytest.approx(0.04)  # first batch: window below warmup
    for f, b, r, s in list(zip(factors, betas, raw, scaled, strict=True))[1:]:
        assert f == pytest.approx(min(max(r / s, 0.5), 2.0), rel=1e-6) and b == pytest.approx(0.04 * f, rel=1e-6)
    assert trainer.beta == pytest.approx(0.04 * trainer.beta_factors["grade"]) and trainer.beta_base == 0.04


# ---------------------------------------------------------------- seams: the loss trains on what the guard computed


def test_trl_loss_receives_gepo_advantages_element_by_element(tiny_model_dir, tmp_path, monkeypatch):
    """Every advantage TRL's loss receives is GEPO's median/MAD advantage of the row's reward, element by element
    (``outlier_z: 0``: every group on the robust rule); and on these rewards TRL's mean/std advantage differs, so a
    trainer that ignored GEPO would fail here."""
    from steadyrl.guards.advantages import group_normalized_advantages
    from steadyrl.guards.robust_advantage import GEPOAdvantage

    spy = TrainedOn(monkeypatch)
    gepo = GEPOAdvantage(clip_scale=2.5, outlier_z=0)
    trainer = tiny_grpo_trainer(tiny_model_dir, tmp_path / "gepo", {"advantage_fn": gepo}, max_steps=3)
    trainer.train()
    G = trainer.num_generations

    def grouped(fn):
        return lambda generation: fn(generation["rewards_per_func"][:, 0].view(-1, G)).reshape(-1)

    pairs = spy.expected_advantages(grouped(gepo))
    assert len(pairs) == 3 and all(len(received) == 8 for received, _ in pairs)
    for received, expected in pairs:
        torch.testing.assert_close(received, expected, rtol=0, atol=1e-6)
    mean_std = spy.expected_advantages(grouped(group_normalized_advantages))
    gaps = [float((gepo_adv - trl).abs().max()) for (gepo_adv, _), (_, trl) in zip(pairs, mean_std, strict=True)]
    assert max(gaps) > 0.05


def test_grade_scaled_rewards_reach_the_grpo_advantages(tiny_model_dir, tmp_path, monkeypatch):
    """GRADE's output (not the raw reward) is what TRL's advantages are made of: with scale_rewards=none the
    advantage is the scaled reward minus its group mean, so dropping GRADE changes it by GRADE's 1/std."""
    from steadyrl.guards.advantages import group_normalized_advantages
    from steadyrl.guards.reward_scaler import GradeConfig

    spy = TrainedOn(monkeypatch)
    grade = RecordingGrade(GradeConfig(warmup=2, clip_start=2, quantile_every=1))
    trainer = tiny_grpo_trainer(
        tiny_model_dir, tmp_path / "grade", {"reward_processor": grade}, max_steps=3, scale_rewards="none"
    )
    trainer.train()
    G = trainer.num_generations

    def advantages_of(rewards_of):
        return lambda g: group_normalized_advantages(rewards_of(g).view(-1, G), scale_rewards="none").reshape(-1)

    scaled = spy.expected_advantages(advantages_of(lambda g: grade.outputs[g["index"]]))
    raw = spy.expected_advantages(advantages_of(lambda g: g["rewards_per_func"][:, 0]))
    assert len(scaled) == 3 and len(grade.outputs) == 3
    for received, expected in scaled:
        torch.testing.assert_close(received, expected, rtol=0, atol=1e-6)
    # from the second batch on GRADE whitens: the raw rewards' advantages are not what the loss got
    assert all(float((received - expected).abs().max()) > 1e-3 for received, expected in raw[1:])
