"""The spike decision per micro-batch (``guards.gepo.spike.granularity: micro_batch``; docs/DESIGN.md, "GEPO: spike
skip"): each micro-batch's own gradient (``grad`` minus a copy of what accumulated before its backward) is judged by
a second ``SpikeGuard`` on A x its norm; a dropped one's contribution is removed and the step trains on the mean of
the kept ones (all dropped: the step is skipped). Under DDP the backward passes run in ``no_sync`` and ``finish``
all-reduces once. Observe mode only counts. Refused under DeepSpeed; costs one gradient copy while A > 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch

from steadyrl.guards.base import StepDecision
from steadyrl.guards.spike import SpikeGuard, SpikeSkipError
from steadyrl.metrics import (
    EVENT_MICRO_BATCH_DROP,
    GEPO_DROPPED_MICRO_BATCHES,
    GEPO_MICRO_SPIKE_MEDIAN,
    GEPO_WOULD_DROP_MICRO_BATCHES,
    GUARD_PART_GEPO_SPIKE,
)
from steadyrl.trainers.context import RuntimeContext

logger = logging.getLogger(__name__)


class MicroBatchGate:
    """Judge each micro-batch's own gradient with ``guard``; drop the spiking ones (``observe``: only count them).
    ``distributed``: ``finish`` does DDP's all-reduce; ``accumulation``: A, the gradient accumulation steps."""

    def __init__(
        self, guard: SpikeGuard, ctx: RuntimeContext, observe: bool = False, distributed: bool = False,
        accumulation: int = 1,
    ) -> None:  # fmt: skip
        self.accumulation = accumulation
        self.guard, self.ctx, self.observe, self.distributed = guard, ctx, observe, distributed
        self.dropped_total = 0.0  # over the run and every rank (summed in ``finish``)
        self._prev: list[torch.Tensor | None] | None = None
        self._seen = self._dropped = 0
        self.params: list[torch.nn.Parameter] | None = None  # the trainable parameters, from the first micro-batch

    # ------------------------------------------------------------------ around each backward pass

    @contextlib.contextmanager
    def around_backward(self, model: torch.nn.Module, sync: contextlib.AbstractContextManager) -> Iterator[None]:
        """Around one micro-batch's forward and backward (the Trainer's ``training_step``), inside ``sync`` (DDP's
        ``no_sync``: ``finish`` all-reduces the kept micro-batches)."""
        if self.params is None:
            self.params = [p for p in model.parameters() if p.requires_grad]
        with self.ctx.timer(GUARD_PART_GEPO_SPIKE):  # the gradient copy is guard cost too
            self.before_backward(self.params)
        with sync:
            yield
        with self.ctx.timer(GUARD_PART_GEPO_SPIKE):
            self.after_backward(self.params)

    def before_backward(self, params: list[torch.nn.Parameter]) -> None:
        """Copy what has accumulated so far (nothing to copy for the first micro-batch of a step)."""
        has_grads = any(p.grad is not None for p in params)
        self._prev = [None if p.grad is None else p.grad.detach().clone() for p in params] if has_grads else None

    def after_backward(self, params: list[torch.nn.Parameter]) -> bool:
        """Decide on this micro-batch's own gradient; returns True when it was dropped (act mode)."""
        prev = self._prev if self._prev is not None else [None] * len(params)
        self._prev = None
        squares = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        for p, before in zip(params, prev, strict=True):
            if p.grad is None:
                continue
            own = p.grad.detach().float() if before is None else p.grad.detach().float() - before.float()
            squares = squares + own.pow(2).sum()
        norm = squares.sqrt() * self.accumulation  # on the step's scale
        step = self.ctx.global_step()
        self._seen += 1
        try:
            decision = self.guard.decide(norm, step)
        except SpikeSkipError as exc:
            if not self.observe:
                raise SpikeSkipError(
                    f"{exc} (counted in micro-batches: guards.gepo.spike.granularity=micro_batch, max_consecutive_"
                    "skips x the accumulation steps)"
                ) from exc
            decision = StepDecision(True, "spike" if math.isfinite(float(norm)) else "nonfinite")  # only counted
        if not decision.skip:
            return False
        self._dropped += 1
        if self.observe:
            logger.info(
                "step %d: observe mode: micro-batch %d would be dropped (%s, own grad norm %.4g)",
                step + 1, self._seen, decision.reason, float(norm),
            )  # fmt: skip
            return False
        for p, before in zip(params, prev, strict=True):
            p.grad = before  # back to what the earlier micro-batches accumulated
        logger.warning(
            "step %d: micro-batch %d dropped (%s, its own grad norm %.4g, baseline %s)",
            step + 1, self._seen, decision.reason, float(norm),
            "none" if self.guard.baseline is None else format(self.guard.baseline, ".4g"),
        )  # fmt: skip
        self.ctx.emit_event(
            EVENT_MICRO_BATCH_DROP, step=step + 1, micro_batch=self._seen, reason=decision.reason, grad_norm=float(norm)
        )
        return True

    # ------------------------------------------------------------------ before the step decision

    def finish(self, params: list[torch.nn.Parameter]) -> bool:
        """Once per optimizer step, before the step gate: average the kept micro-batches (under DDP: the step's
        all-reduce); returns True when every micro-batch was dropped."""
        seen, dropped = self._seen, self._dropped
        self._seen = self._dropped = 0
        kept_here = float(seen - dropped) if not self.observe else float(seen)
        counts = torch.tensor([kept_here, float(dropped)], dtype=torch.float32, device=self.ctx.device)
        if self.distributed:
            for p in params:  # every rank sends the same layout, also one that dropped all its micro-batches
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            # sum over ranks of (A x each rank's accumulated gradient), plus the counts, in one collective
            flat = torch.cat([g.reshape(-1).float().to(counts.device) for g in grads] + [counts.new_zeros(0)])
            buffer = self.ctx.reduce_sum(torch.cat([flat * float(seen), counts]))
            kept, dropped_all = float(buffer[-2]), float(buffer[-1])
            if kept > 0:
                offset = 0
                for g in grads:
                    n = g.numel()
                    g.copy_((buffer[offset : offset + n] / kept).view_as(g).to(g.dtype))
                    offset += n
        else:
            grads = [p.grad for p in params if p.grad is not None]
            kept, dropped_all = kept_here, float(dropped)
            if 0 < kept < seen and not self.observe:
                for g in grads:
                    g.mul_(seen / kept)  # the mean of the kept micro-batches, not a sum missing terms
        self.dropped_total += dropped_all
        name = GEPO_WOULD_DROP_MICRO_BATCHES if self.observe else GEPO_DROPPED_MICRO_BATCHES
        self.ctx.log_metric(name, self.dropped_total)
        baseline = self.guard.baseline
        self.ctx.log_metric(GEPO_MICRO_SPIKE_MEDIAN, math.nan if baseline is None else baseline)
        return kept == 0 and seen > 0 and not self.observe

    # ------------------------------------------------------------------ state (per rank: each judges its own)

    def rank_state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict(), "dropped_total": self.dropped_total}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state["guard"])
        self.dropped_total = float(state.get("dropped_total", 0.0))


def micro_batch_gate(
    guard: SpikeGuard | None, observe: bool, ctx: RuntimeContext, *, deepspeed: bool, max_grad_norm: float,
    accumulation: int,
) -> MicroBatchGate | None:  # fmt: skip
    """The trainer's gate from its micro-batch guard (None: none), acting or ``observe``; refuses what cannot work."""
    if guard is None:
        return None
    if deepspeed:
        raise ValueError("guards.gepo.spike.granularity=micro_batch does not work under DeepSpeed; use step")
    if max_grad_norm <= 0:  # _clip_grad_norm, where the kept micro-batches are averaged, never runs
        raise ValueError("guards.gepo.spike.granularity=micro_batch needs max_grad_norm > 0")
    # consecutive drops count in micro-batches: max_consecutive_skips steps' worth of them stops the run
    accumulation = max(1, int(accumulation))
    limit = guard.config.max_consecutive_skips * accumulation
    guard.config = dataclasses.replace(guard.config, max_consecutive_skips=limit)
    distributed = ctx.processes > 1  # the backward passes run no_sync; finish all-reduces
    return MicroBatchGate(guard, ctx, observe=observe, distributed=distributed, accumulation=accumulation)
