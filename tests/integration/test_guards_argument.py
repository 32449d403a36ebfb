"""``SteadyGRPOTrainer(guards=...)``: the YAML ``guards:`` section from Python, starting where TRL starts (beta 0)."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from steadyrl.config.loader import ConfigError
from steadyrl.guards.spike import SpikeGuard
from steadyrl.trainers.grpo import SteadyGRPOTrainer, guard_arguments
from tests.integration.helpers import byte_mean, grpo_args, small_dataset

pytestmark = pytest.mark.slow


def test_guard_arguments_expand_the_yaml_section_and_validate_it() -> None:
    assert sorted(guard_arguments("all")) == [
        "advantage_fn", "finite_checks", "logprob_min", "opefo", "quatro", "reward_processor", "step_guards",
    ]  # fmt: skip
    only_gepo = guard_arguments({"gepo": {"enabled": True, "spike": {"spike_factor": 7.0}}})
    assert "quatro" not in only_gepo and only_gepo["step_guards"][0].config.spike_factor == 7.0
    with pytest.raises(ConfigError, match=r"guards.gepo.enabld: unknown key 'enabld'. Did you mean 'enabled'"):
        guard_arguments({"gepo": {"enabld": True}})
    with pytest.raises(TypeError, match='guards= takes "all"'):
        guard_arguments(3)  # type: ignore[arg-type]


def test_every_layer_on_at_trls_default_beta_0_trains(tiny_model_dir, tmp_path) -> None:
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(tmp_path / "run", max_steps=2, entropy_coef=0.5),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        guards="all",
    )
    assert trainer.beta == 0.0 and trainer.quatro.kl is None  # nothing to anchor: inactive, not refused
    assert trainer.entropy_coef == 0.5  # the user's coefficient, the floor's bonus (0 while idle) on top
    assert trainer.opefo is not None and trainer.reward_processor is not None
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(math.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)
    with pytest.raises(ValueError, match=r"guards= fills \['step_guards'\]; pass either guards= or these"):
        SteadyGRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=[byte_mean],
            args=grpo_args(tmp_path / "clash"),
            train_dataset=small_dataset(),
            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
            guards="all",
            step_guards=[SpikeGuard()],
        )
