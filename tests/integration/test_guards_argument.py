"""``SteadyGRPOTrainer(guards=...)``: the YAML ``guards:`` section from Python, starting where TRL starts (beta 0)."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from steadyrl.callbacks.monitor import SignalMonitor
from steadyrl.config.loader import ConfigError
from steadyrl.guards.spike import SpikeGuard
from steadyrl.trainers.grpo import SteadyGRPOTrainer
from steadyrl.trainers.layers import GuardParts, guard_parts
from tests.integration.helpers import byte_mean, grpo_args, small_dataset

pytestmark = pytest.mark.slow


def test_guard_parts_expand_the_yaml_section_and_validate_it() -> None:
    every = guard_parts("all")
    filled = sorted(k for k, v in vars(every).items() if v not in (None, False, [], {}, frozenset()))
    assert filled == [
        "advantage_fn", "finite_checks", "logprob_min", "mismatch", "monitor", "opefo", "quatro",
        "reward_processor", "step_guards",
    ]  # fmt: skip
    only_gepo = guard_parts({"gepo": {"enabled": True, "spike": {"min_ratio": 7.0}}})
    assert only_gepo.quatro is None and only_gepo.step_guards[0].config.min_ratio == 7.0
    assert guard_parts(None) == GuardParts() and guard_parts(only_gepo) is only_gepo
    with pytest.raises(ConfigError, match=r"guards.gepo.enabld: unknown key 'enabld'. Did you mean 'enabled'"):
        guard_parts({"gepo": {"enabld": True}})
    with pytest.raises(TypeError, match='guards= takes "all"'):
        guard_parts(3)  # type: ignore[arg-type]


def test_every_layer_on_at_trls_default_beta_0_trains(tiny_model_dir, tmp_path) -> None:
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(tmp_path / "run", max_steps=2, entropy_coef=0.5),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        guards="all",
    )
    assert trainer.beta == 0.0 and trainer.step_end.kl is None  # nothing to anchor: inactive, not refused
    assert trainer.entropy_coef == 0.5  # the user's coefficient, the floor's bonus (0 while idle) on top
    assert trainer.step_end.recovery is not None and trainer.parts.reward_processor is not None
    # "all" from Python turns GEPO's early warnings on as the YAML path does (they were never built here)
    (monitor,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, SignalMonitor)]
    assert monitor.config == trainer.parts.monitor
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(math.isfinite(row["loss"]) for row in trainer.state.log_history if "loss" in row)
    with pytest.raises(TypeError, match="step_guards"):  # one guard argument: the parts go in GuardParts
        SteadyGRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=[byte_mean],
            args=grpo_args(tmp_path / "clash"),
            train_dataset=small_dataset(),
            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
            step_guards=[SpikeGuard()],
        )
