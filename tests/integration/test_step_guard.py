"""The pre-optimizer-step hook: a vetoed step leaves weights and Adam moments bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback

from steadyrl.guards.base import StepDecision
from steadyrl.trainers import SteadyGRPOTrainer
from tests.integration.helpers import byte_mean, grpo_args, small_dataset, weights

pytestmark = pytest.mark.slow


class SkipAt:
    """Vetoes the optimizer step at the given global steps; records what it saw."""

    def __init__(self, steps):
        self.steps = set(steps)
        self.norms: list[float] = []
        self.skipped_grads: list[int] = []

    def decide(self, grad_norm, step):
        self.norms.append(float(grad_norm))
        return StepDecision(True, "test") if step in self.steps else StepDecision.proceed()

    def on_skip(self, gradients, decision, step):
        self.skipped_grads.append(sum(g is not None for g in gradients))


class Snapshots(TrainerCallback):
    def __init__(self):
        self.weights, self.moments, self.lrs = [], [], []

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
        self.weights.append(weights(model))
        self.moments.append(copy.deepcopy({k: dict(v) for k, v in optimizer.state_dict()["state"].items()}))
        self.lrs.append(lr_scheduler.get_last_lr()[0])


def test_vetoed_step_changes_nothing(tiny_model_dir, tmp_path):
    guard, snaps = SkipAt({1}), Snapshots()
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(tmp_path, max_grad_norm=1.0),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        step_guards=[guard],
        callbacks=[snaps],
    )
    trainer.train()
    assert len(guard.norms) == 3 and all(n > 0 for n in guard.norms)
    assert guard.skipped_grads and guard.skipped_grads[0] > 0
    assert trainer.steady_counters["skipped_steps"] == 1
    # step index 1 was skipped: weights and every Adam moment equal those after step 0
    for key, value in snaps.weights[0].items():
        assert torch.equal(value, snaps.weights[1][key]), key
    for pid, state in snaps.moments[0].items():
        for name, tensor in state.items():
            assert torch.equal(tensor, snaps.moments[1][pid][name]), (pid, name)
    # and the steps around it did train
    assert any(not torch.equal(v, snaps.weights[2][k]) for k, v in snaps.weights[1].items())
    # A vetoed step leaves the LR schedule where it was (as the Trainer does for an fp16 overflow and as
    # DeepSpeed does for a skipped step); the next real step moves it on.
    assert snaps.lrs[0] == snaps.lrs[1] > snaps.lrs[2]
