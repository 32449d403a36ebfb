"""guards.gepo.spike.granularity: the per-step decision dilutes a one-micro-batch spike; the per-micro-batch decision
drops it and trains on the mean of the others (steadyrl/trainers/micro_batch_gate.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from steadyrl.guards.spike import SpikeConfig, SpikeGuard, SpikeSkipError
from steadyrl.metrics import GEPO_DROPPED_MICRO_BATCHES, GEPO_WOULD_DROP_MICRO_BATCHES
from steadyrl.trainers.context import RuntimeContext
from steadyrl.trainers.micro_batch_gate import MicroBatchGate

A = 8  # accumulation steps
SPIKE = 8.0  # the poisoned micro-batch's gradient is 8x a usual one
REPO = Path(__file__).resolve().parents[2]
CONFIG = SpikeConfig(warmup_steps=3, min_ratio=5.0)


def _micro_grads(steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Per step, A micro-batch gradients (each already divided by A, as the Trainer's loss is) of norm about 1/A."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(64, generator=gen) / 8.0 / A for _ in range(A)] for _ in range(steps)]


def _run(gate: MicroBatchGate | None, micro: list[torch.Tensor], param: torch.nn.Parameter) -> bool:
    """One optimizer step's backward passes into ``param.grad`` through ``gate``; returns finish()'s verdict."""
    param.grad = None
    for g in micro:
        if gate is not None:
            gate.before_backward([param])
        param.grad = g.clone() if param.grad is None else param.grad + g
        if gate is not None:
            gate.after_backward([param])
    return gate.finish([param]) if gate is not None else False


def _gate(ctx: RuntimeContext | None = None, **kwargs) -> MicroBatchGate:
    return MicroBatchGate(SpikeGuard(CONFIG), ctx or RuntimeContext(), accumulation=A, **kwargs)


def _logged() -> tuple[RuntimeContext, dict[str, float]]:
    seen: dict[str, float] = {}
    return RuntimeContext(log_metric=lambda name, value: seen.__setitem__(name, value)), seen


def test_the_step_decision_dilutes_one_spiking_micro_batch():
    """granularity: step. One micro-batch 8x its siblings raises the step's norm under min_ratio 5: not skipped
    (the documented cost, docs/DESIGN.md "GEPO: spike skip")."""
    param, step_guard = torch.nn.Parameter(torch.zeros(64)), SpikeGuard(CONFIG)
    for micro in _micro_grads(6):
        _run(None, micro, param)
        assert not step_guard.decide(param.grad.norm(), 0).skip
    poisoned = _micro_grads(1, seed=1)[0]
    poisoned[3] = poisoned[3] * SPIKE
    _run(None, poisoned, param)
    ratio = float(param.grad.norm()) / step_guard.baseline
    assert 1.5 < ratio < CONFIG.min_ratio  # sqrt((A - 1 + k^2) / A) = 3.0 for uncorrelated gradients
    assert not step_guard.decide(param.grad.norm(), 6).skip


def test_the_micro_batch_decision_drops_it_and_trains_on_the_mean_of_the_rest():
    ctx, seen = _logged()
    param, gate = torch.nn.Parameter(torch.zeros(64)), _gate(ctx)
    for micro in _micro_grads(2):
        assert _run(gate, micro, param) is False
        assert torch.allclose(param.grad, torch.stack(micro).sum(0))  # nothing dropped: the plain accumulated sum
    poisoned = _micro_grads(1, seed=1)[0]
    poisoned[3] = poisoned[3] * SPIKE
    assert _run(gate, poisoned, param) is False
    kept = poisoned[:3] + poisoned[4:]
    # the mean of the 7 kept micro-batches, on the same scale as a full step: sum(kept) x A / 7
    assert torch.allclose(param.grad, torch.stack(kept).sum(0) * A / (A - 1), atol=1e-7)
    assert seen[GEPO_DROPPED_MICRO_BATCHES] == 1.0
    assert gate.guard.skipped == 1 and gate.guard.reasons == {"spike": 1}
    # judged on the step's scale: A x each micro-batch's contribution (norms of about 1 here, not 1/A)
    assert 0.5 < gate.guard.baseline < 2.0


def test_observe_mode_counts_the_drop_and_changes_nothing():
    ctx, seen = _logged()
    param, gate = torch.nn.Parameter(torch.zeros(64)), _gate(ctx, observe=True)
    for micro in _micro_grads(2):
        _run(gate, micro, param)
    poisoned = _micro_grads(1, seed=1)[0]
    poisoned[3] = poisoned[3] * SPIKE
    assert _run(gate, poisoned, param) is False
    assert torch.equal(param.grad, _accumulate(poisoned))
    assert seen[GEPO_WOULD_DROP_MICRO_BATCHES] == 1.0 and GEPO_DROPPED_MICRO_BATCHES not in seen


def _accumulate(micro: list[torch.Tensor]) -> torch.Tensor:
    total = micro[0].clone()
    for g in micro[1:]:
        total = total + g
    return total


def test_a_nan_micro_batch_is_dropped_and_a_step_of_nothing_but_nan_is_reported():
    param, gate = torch.nn.Parameter(torch.zeros(64)), _gate(RuntimeContext())
    micro = _micro_grads(1)[0]
    micro[0] = micro[0] * math.nan  # the first: dropped back to "no gradient yet"
    assert _run(gate, micro, param) is False
    assert torch.allclose(param.grad, torch.stack(micro[1:]).sum(0) * A / (A - 1))
    assert _run(gate, [g * math.nan for g in micro], param) is True  # every one dropped: the step must be skipped
    assert param.grad is None


def test_two_ranks_average_every_kept_micro_batch():
    """Under DDP the backward passes are local; finish all-reduces A x each rank's sum and the counts. Rank 0
    dropped one micro-batch, rank 1 none: the step trains on the mean of the 2A - 1 kept ones, on both ranks."""
    micro0, micro1 = _micro_grads(1, seed=2)[0], _micro_grads(1, seed=3)[0]
    micro0[5] = micro0[5] * math.nan
    other = torch.cat([_accumulate(micro1) * A, torch.tensor([float(A), 0.0])])  # what rank 1 sends
    ctx = RuntimeContext(reduce_sum=lambda t: t + other)
    param, gate = torch.nn.Parameter(torch.zeros(64)), _gate(ctx, distributed=True)
    assert _run(gate, micro0, param) is False
    kept = micro0[:5] + micro0[6:] + micro1
    assert torch.allclose(param.grad, torch.stack(kept).sum(0) * A / (2 * A - 1), atol=1e-7)
    assert gate.dropped_total == 1.0


def test_without_drops_the_two_rank_mean_is_ddps_mean():
    micro0, micro1 = _micro_grads(1, seed=2)[0], _micro_grads(1, seed=3)[0]
    other = torch.cat([_accumulate(micro1) * A, torch.tensor([float(A), 0.0])])
    ctx = RuntimeContext(reduce_sum=lambda t: t + other)
    param, gate = torch.nn.Parameter(torch.zeros(64)), _gate(ctx, distributed=True)
    _run(gate, micro0, param)
    assert torch.allclose(param.grad, (_accumulate(micro0) + _accumulate(micro1)) / 2, atol=1e-7)


def test_the_micro_batch_baseline_survives_a_checkpoint():
    param, gate = torch.nn.Parameter(torch.zeros(64)), _gate(RuntimeContext())
    for micro in _micro_grads(3):
        _run(gate, micro, param)
    restored = _gate(RuntimeContext())
    restored.load_rank_state_dict(gate.rank_state_dict())
    assert restored.guard.baseline == gate.guard.baseline and restored.guard.accepted == 3 * A


@pytest.mark.parametrize("value", ["per_token", "microbatch"])
def test_an_unknown_granularity_is_a_config_error(value):
    from steadyrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"guards.gepo.spike.granularity .*must be one of \['step', 'micro_batch'\]"):
        load_config(REPO / "configs/tiny/grpo-guarded.yaml", [f"guards.gepo.spike.granularity={value}"])


def test_a_run_of_nothing_but_nan_micro_batches_stops_in_act_mode_and_is_only_counted_in_observe_mode():
    nan = [g * math.nan for g in _micro_grads(1)[0]]
    act = MicroBatchGate(SpikeGuard(SpikeConfig(max_consecutive_skips=3)), RuntimeContext(), accumulation=A)
    param = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(SpikeSkipError, match=r"3 optimizer steps in a row.*counted in micro-batches"):
        _run(act, nan, param)
    ctx, seen = _logged()
    observe = MicroBatchGate(SpikeGuard(SpikeConfig(max_consecutive_skips=3)), ctx, observe=True, accumulation=A)
    assert _run(observe, nan, param) is False  # nothing dropped: the NaN reaches the step, as in plain TRL
    assert seen[GEPO_WOULD_DROP_MICRO_BATCHES] == float(A)
