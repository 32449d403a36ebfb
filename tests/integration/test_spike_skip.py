"""A NaN loss at one step: SpikeGuard skips that step and training goes on; plain TRL ends with NaN weights. A finite
spike is skipped on the pre-clip norm."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOTrainer

from steadyrl.guards.spike import SpikeConfig, SpikeGuard
from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.layers import GuardParts
from tests.integration.helpers import assert_same_weights, byte_mean, grpo_args, per_step, small_dataset, weights

pytestmark = pytest.mark.slow
POISONED_MICRO_STEP = 1  # the second backward pass
SPIKE_STEP = 3  # the fourth optimizer step (after a 2-step warm-up and one more accepted step)


def inject_nan_loss(trainer: Any, micro_step: int) -> Callable[[], None]:
    """Make the loss of micro-batch ``micro_step`` (``trainer._step``, from 0) of a ``trl.GRPOTrainer`` NaN (its
    advantages times NaN). Returns a function that removes the fault."""
    original = trainer._prepare_inputs

    def poisoned(generation_batch: Any) -> Any:
        inputs = original(generation_batch)
        if trainer.model.training and trainer._step == micro_step:
            inputs = {**inputs, "advantages": inputs["advantages"] * float("nan")}
        return inputs

    trainer._prepare_inputs = poisoned
    return lambda: setattr(trainer, "_prepare_inputs", original)


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
    parts = GuardParts(step_guards=[guard], finite_checks=True)
    steady = _trainer(SteadyGRPOTrainer, tiny_model_dir, tmp_path / "steady", guards=parts)
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


class AfterStep(TrainerCallback):
    """Weights and Adam moments after every optimizer step."""

    def __init__(self):
        self.weights, self.moments = [], []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.weights.append(weights(model))
        self.moments.append(copy.deepcopy({k: dict(v) for k, v in optimizer.state_dict()["state"].items()}))


def test_finite_spike_is_skipped_on_the_pre_clip_norm(tiny_model_dir, tmp_path):
    """Single process: a finite gradient 1000x its usual size at step 4 is skipped (weights and Adam moments
    bit-identical across it). The guard decides on the pre-clip norm: after clipping at max_grad_norm=1 the spike
    would be a norm of 1, under 100 x the baseline (min_ratio), and would go through."""
    guard, after = SpikeGuard(SpikeConfig(warmup_steps=2)), AfterStep()
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(tmp_path, max_steps=5, max_grad_norm=1.0),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        guards=GuardParts(step_guards=[guard]),
        callbacks=[after],
    )
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    param.register_hook(lambda g: g * 1000.0 if trainer._step == SPIKE_STEP else g)
    trainer.train()
    assert guard.reasons == {"spike": 1} and trainer.steady_counters["skipped_spike"] == 1
    norms = per_step(trainer.state.log_history, "grad_norm")
    usual = [n for i, n in enumerate(norms) if i != SPIKE_STEP]
    assert norms[SPIKE_STEP] > 100 * max(usual) and norms[SPIKE_STEP] > 5.0  # the logged norm is the pre-clip one
    assert_same_weights(after.weights[SPIKE_STEP], after.weights[SPIKE_STEP - 1])
    for pid, state in after.moments[SPIKE_STEP - 1].items():
        assert all(torch.equal(t, after.moments[SPIKE_STEP][pid][k]) for k, t in state.items()), pid
    assert any(not torch.equal(v, after.weights[-1][k]) for k, v in after.weights[SPIKE_STEP].items())


def test_the_interventions_ledger_counts_the_skip_and_nothing_else(tiny_model_dir, tmp_path):
    """Every guard layer on, the NaN loss at the second of three steps: the ledger flags that step (a skip and the
    masked non-finite loss) and no other, and writes the run's summary."""
    steady = _trainer(SteadyGRPOTrainer, tiny_model_dir, tmp_path, guards={"gepo": {"enabled": True}})
    steady.train()
    history = steady.state.log_history
    assert per_step(history, "steadyrl/interventions/skipped_step") == [0.0, 1.0, 0.0]
    assert per_step(history, "steadyrl/interventions/nonfinite_masked") == [0.0, 1.0, 0.0]
    summary = json.loads((tmp_path / "interventions.json").read_text())
    assert summary["steps"] == 3 and summary["kinds"]["skipped_step"] == {"layer": "gepo", "steps": 1, "share": 1 / 3}
    assert {k for k, row in summary["kinds"].items() if row["steps"]} == {"skipped_step", "nonfinite_masked"}
