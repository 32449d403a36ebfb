"""The pre-optimizer-step hook: a vetoed step leaves weights and Adam moments bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback

from steadyrl.guards.base import StepDecision
from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.layers import GuardParts
from tests.integration.helpers import assert_same_weights, byte_mean, grpo_args, small_dataset, weights

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
        guards=GuardParts(step_guards=[guard]),
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


def _gated_run(model_dir, out, scaler=None):
    guard, snaps = SkipAt({1}), Snapshots()
    trainer = SteadyGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(out, max_grad_norm=1.0),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        guards=GuardParts(step_guards=[guard]),
        callbacks=[snaps],
    )
    if scaler is not None:
        # fp16 without DeepSpeed, as accelerate sets it up on a GPU: backward scales the loss, the optimizer step
        # goes through scaler.step / scaler.update. The CPU GradScaler is the same class CUDA uses.
        trainer.accelerator.scaler = scaler
    trainer.train()
    return trainer, guard, snaps


def test_fp16_grad_scaler_gate_decides_on_unscaled_gradients_and_a_veto_does_not_crash(tiny_model_dir, tmp_path):
    """Under a GradScaler (loss x 2**16 before backward) the gate sees, clips and logs the true gradients: the run
    is bit-identical to the same run in fp32 (scaling by a power of two is exact). The vetoed step 2 leaves the
    weights and the LR schedule alone and does not crash ``scaler.update()``; the loss scale is not backed off."""
    plain, plain_guard, plain_snaps = _gated_run(tiny_model_dir, tmp_path / "fp32")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaled, guard, snaps = _gated_run(tiny_model_dir, tmp_path / "fp16", scaler)
    assert scaled.optimizer.scaler is scaler
    assert guard.norms == plain_guard.norms and max(guard.norms) < 100  # unscaled, x65536 before the fix
    assert_same_weights(weights(scaled.model), weights(plain.model))
    assert_same_weights(snaps.weights[0], snaps.weights[1])
    assert snaps.lrs == plain_snaps.lrs and snaps.lrs[0] == snaps.lrs[1] > snaps.lrs[2]
    assert scaled.steady_counters["skipped_steps"] == 1 and scaler.get_scale() == 2.0**16


def test_fp16_overflow_is_skipped_and_backs_the_loss_scale_off(tiny_model_dir, tmp_path):
    """An inf gradient under a GradScaler: the step guard skips it, the scaler skips it too and halves its scale
    (as for any fp16 overflow); no crash, weights and LR schedule untouched, training goes on."""
    from steadyrl.guards.spike import SpikeConfig, SpikeGuard

    snaps, guard = Snapshots(), SpikeGuard(SpikeConfig(min_ratio=float("inf")))
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(tmp_path, max_grad_norm=1.0),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        guards=GuardParts(step_guards=[guard]),
        callbacks=[snaps],
    )
    scaler = trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    param.register_hook(lambda g: g * float("inf") if trainer._step == 1 else g)
    trainer.train()
    assert guard.reasons == {"nonfinite": 1} and scaler.get_scale() == 2.0**15
    assert_same_weights(snaps.weights[0], snaps.weights[1])
    assert snaps.lrs[0] == snaps.lrs[1] > snaps.lrs[2]
    assert all(torch.isfinite(v).all() for v in snaps.weights[-1].values())
