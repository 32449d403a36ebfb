"""A NaN loss at one step: SpikeGuard skips that step and training goes on; plain TRL ends with NaN weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer
from trl import GRPOTrainer

from steadyrl.faults import inject_nan_loss
from steadyrl.guards.spike import SpikeGuard
from steadyrl.trainers import SteadyGRPOTrainer
from tests.integration.helpers import byte_mean, grpo_args, small_dataset, weights

pytestmark = pytest.mark.slow
POISONED_MICRO_STEP = 1  # the second backward pass


def _trainer(cls, model_dir, out, **kwargs):
    trainer = cls(
        model=str(model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(out, max_steps=3, max_grad_norm=1.0),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        **kwargs,
    )
    inject_nan_loss(trainer, POISONED_MICRO_STEP)
    return trainer


def test_nan_loss_step_is_skipped(tiny_model_dir, tmp_path):
    guard = SpikeGuard()
    steady = _trainer(SteadyGRPOTrainer, tiny_model_dir, tmp_path / "steady", step_guards=[guard], finite_checks=True)
    steady.train()
    assert guard.reasons == {"nonfinite": 1} and steady.steady_counters["skipped_steps"] == 1
    history = steady.state.log_history
    assert [row["gepo/nonfinite_loss"] for row in history if "gepo/nonfinite_loss" in row] == [0.0, 1.0, 0.0]
    assert [row["gepo/skipped_nonfinite"] for row in history if "gepo/skipped_nonfinite" in row] == [1.0, 1.0]
    assert guard.accepted == 2
    assert all(torch.isfinite(v).all() for v in weights(steady.model).values())

    # Plain TRL applies the NaN step, then dies sampling from NaN logits at the next generation.
    plain = _trainer(GRPOTrainer, tiny_model_dir, tmp_path / "plain")
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan`"):
        plain.train()
    assert plain.state.global_step == 2
    assert any(not torch.isfinite(v).all() for v in weights(plain.model).values())
