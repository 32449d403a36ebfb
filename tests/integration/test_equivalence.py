"""With every guard off, SteadyGRPOTrainer is trl.GRPOTrainer: identical rewards, losses and weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from trl import GRPOTrainer

from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.layers import GuardParts
from tests.integration.helpers import assert_same_weights, byte_mean, grpo_args, per_step, small_dataset, weights

pytestmark = pytest.mark.slow


def _train(cls, model_dir, out, **trainer_kwargs):
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = cls(
        model=str(model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(out, beta=0.04),
        train_dataset=small_dataset(),
        processing_class=tok,
        **trainer_kwargs,
    )
    initial = weights(trainer.model)
    trainer.train()
    return trainer, initial


class IdentityRewards:
    """A reward processor that changes nothing: routes advantages through steadyrl's own computation."""

    calls = 0

    def __call__(self, rewards, prompts, num_generations):
        IdentityRewards.calls += 1
        assert len(prompts) == rewards.numel()
        return rewards


def test_guards_off_equals_plain_trl(tiny_model_dir, tmp_path):
    plain, initial = _train(GRPOTrainer, tiny_model_dir, tmp_path / "plain")
    steady, _ = _train(SteadyGRPOTrainer, tiny_model_dir, tmp_path / "steady")
    routed, _ = _train(
        SteadyGRPOTrainer, tiny_model_dir, tmp_path / "routed", guards=GuardParts(reward_processor=IdentityRewards())
    )

    rewards = per_step(plain.state.log_history, "reward")
    assert len(rewards) == 3
    assert per_step(steady.state.log_history, "reward") == rewards
    assert per_step(steady.state.log_history, "loss") == per_step(plain.state.log_history, "loss")
    assert per_step(routed.state.log_history, "reward") == rewards
    assert IdentityRewards.calls == 3

    final = weights(plain.model)
    assert any(not torch.equal(initial[k], final[k]) for k in final), "training must change the weights"
    assert_same_weights(weights(steady.model), final)
    # Recomputing TRL's advantage in steadyrl (reward-processor path) is bit-identical too.
    assert_same_weights(weights(routed.model), final)
