"""guards.gepo.spike.granularity on a real tiny GRPO run with 8 accumulation steps: one micro-batch gets an extra
gradient 10x the usual micro-batch norm. ``step`` (the default) sees it diluted and takes the step; ``micro_batch``
drops that micro-batch and trains the step on the other seven (steadyrl/trainers/micro_batch_gate.py)."""

from __future__ import annotations

import statistics

import pytest
import torch
from transformers import AutoTokenizer

from steadyrl.guards.spike import SpikeConfig, SpikeGuard
from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.layers import GuardParts
from tests.integration.helpers import byte_mean, grpo_args, per_step, small_dataset

pytestmark = pytest.mark.slow
ACCUM = 8
SPIKE_STEP = 4  # the fifth optimizer step
SPIKE_MICRO = SPIKE_STEP * ACCUM + 3  # its fourth micro-batch (TRL's _step counts backward passes)
FACTOR = 10.0  # the extra gradient's norm, in units of the mean micro-batch norm so far


class MicroBatchSpike:
    """Tensor hooks see each backward pass's own gradient before it accumulates: they record every micro-batch's
    own norm, and add a random gradient of norm FACTOR x (mean own norm so far) to micro-batch SPIKE_MICRO."""

    def __init__(self, trainer: SteadyGRPOTrainer) -> None:
        self.trainer = trainer
        self.params = [p for p in trainer.model.parameters() if p.requires_grad]
        self.squares: dict[int, float] = {}
        numel = sum(p.numel() for p in self.params)
        gen = torch.Generator().manual_seed(1)
        self.noise = [torch.randn(p.shape, generator=gen) / numel**0.5 for p in self.params]
        self.scale: float | None = None
        for p, noise in zip(self.params, self.noise, strict=True):
            p.register_hook(self._hook(noise))

    def _hook(self, noise: torch.Tensor):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            step = self.trainer._step
            if step == SPIKE_MICRO:
                if self.scale is None:
                    norms = [v**0.5 for k, v in self.squares.items() if k < SPIKE_MICRO and v > 0]
                    self.scale = FACTOR * statistics.fmean(norms)
                grad = grad + noise * self.scale
            self.squares[step] = self.squares.get(step, 0.0) + float(grad.float().pow(2).sum())
            return grad

        return hook


def _run(tiny_model_dir, out, granularity: str):
    config = SpikeConfig(warmup_steps=2, min_ratio=5.0, granularity=granularity)  # 10x is a spike, 3.7x is not
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(
            out, max_steps=6, per_device_train_batch_size=4, gradient_accumulation_steps=ACCUM, max_grad_norm=1.0
        ),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        guards=GuardParts(
            step_guards=[SpikeGuard(config)],
            micro_batch_guard=SpikeGuard(config) if granularity == "micro_batch" else None,
        ),
    )
    spike = MicroBatchSpike(trainer)
    trainer.train()
    return trainer, spike


def test_one_spiking_micro_batch_is_diluted_per_step_and_dropped_per_micro_batch(tiny_model_dir, tmp_path):
    step_run, spike = _run(tiny_model_dir, tmp_path / "step", "step")
    own = spike.squares[SPIKE_MICRO] ** 0.5
    assert own > 0.5 * spike.scale  # the extra gradient arrived in that micro-batch
    norms = per_step(step_run.state.log_history, "grad_norm")
    usual = statistics.median(n for i, n in enumerate(norms) if i != SPIKE_STEP)
    # per step: the spike raises the step's norm, but under min_ratio x the baseline, so the step is taken
    guard = step_run.parts.step_guards[0]
    assert 1.5 * usual < norms[SPIKE_STEP] < guard.config.min_ratio * guard.baseline
    assert step_run.steady_counters["skipped_steps"] == 0

    micro_run, _ = _run(tiny_model_dir, tmp_path / "micro", "micro_batch")
    assert micro_run.micro_gate.dropped_total == 1.0
    assert micro_run.micro_gate.guard.reasons == {"spike": 1}
    assert micro_run.steady_counters["skipped_steps"] == 0  # the step trained, on the seven clean micro-batches
    micro_norms = per_step(micro_run.state.log_history, "grad_norm")
    assert micro_norms[:SPIKE_STEP] == norms[:SPIKE_STEP]  # nothing dropped before: the same run, bit for bit
    others = [n for i, n in enumerate(micro_norms) if i != SPIKE_STEP]
    assert micro_norms[SPIKE_STEP] < 1.5 * max(others)  # the spike did not reach the step's gradient
    assert per_step(micro_run.state.log_history, "gepo/dropped_micro_batches")[-1] == 1.0
