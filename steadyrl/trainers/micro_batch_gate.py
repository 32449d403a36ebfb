"""The spike decision per micro-batch (``guards.gepo.spike.granularity: micro_batch``; docs/DESIGN.md, "GEPO: spike
skip").

With gradient accumulation, the default decision (``granularity: step``, ``StepGate``) sees one norm per optimizer
step: a micro-batch whose gradient is k times its siblings' raises it only (A - 1 + k) / A times for A accumulation
steps, so the step is clipped, not skipped. Here every micro-batch is judged on its own gradient:

- before each backward pass the gradients accumulated so far are copied (no copy for the first micro-batch of a
  step: there is nothing yet); after it, the micro-batch's own contribution is ``grad - copy``, and a second
  ``SpikeGuard`` (own EMA) decides on its norm on the step's scale: A x the contribution, the gradient of that
  micro-batch's loss before the Trainer divides it by A, so ``abs_threshold`` means what it means per step;
- a dropped micro-batch's contribution is removed (the gradients go back to the copy), and the step trains on the
  mean of the kept ones: the accumulated gradient is rescaled by A / kept;
- under DDP every backward pass runs without the all-reduce (``no_sync``) and the gradients are all-reduced once,
  before the step decision, as the mean over every kept micro-batch of every rank (one collective per step, which
  also carries the counts). Each rank judges its own micro-batches: the decision is local, the result global;
- a step whose every micro-batch was dropped (on every rank) is skipped like a vetoed step (``gepo/skipped_
  micro_batches``). The step gate then still decides on the whole step's norm as usual.

In observe mode (``guards.gepo.mode: observe``) nothing is dropped: the would-drops are counted
(``gepo/would_drop_micro_batches``). Not under DeepSpeed: ZeRO reduces each micro-batch into its gradient partitions
inside the backward pass (refused in config checks). Costs one copy of the trainable gradients while A > 1.
A dropped micro-batch does not go to OPEFO's error feedback: it is the poisoned part, not a deferred update.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from steadyrl.guards.base import StepDecision
from steadyrl.guards.spike import SpikeGuard, SpikeSkipError
from steadyrl.metrics import (
    EVENT_MICRO_BATCH_DROP,
    GEPO_DROPPED_MICRO_BATCHES,
    GEPO_MICRO_SPIKE_EMA,
    GEPO_WOULD_DROP_MICRO_BATCHES,
)
from steadyrl.trainers.context import RuntimeContext

logger = logging.getLogger(__name__)


class MicroBatchGate:
    """Judge each micro-batch's own gradient with ``guard``; drop the spiking ones (``observe``: only count them).

    ``distributed``: the backward passes ran without DDP's all-reduce; ``finish`` does it (``ctx.reduce_sum``).
    ``accumulation``: A, the Trainer's gradient accumulation steps (each micro-batch's loss is divided by it).
    """

    def __init__(
        self,
        guard: SpikeGuard,
        ctx: RuntimeContext,
        observe: bool = False,
        distributed: bool = False,
        accumulation: int = 1,
    ) -> None:
        self.accumulation = accumulation
        self.guard, self.ctx, self.observe, self.distributed = guard, ctx, observe, distributed
        self.dropped_total = 0.0  # over the run and every rank (summed in ``finish``)
        self._prev: list[torch.Tensor | None] | None = None
        self._seen = 0
        self._dropped = 0

    # ------------------------------------------------------------------ around each backward pass

    def before_backward(self, params: list[torch.nn.Parameter]) -> None:
        """Copy what has accumulated so far (nothing to copy for the first micro-batch of a step)."""
        if any(p.grad is not None for p in params):
            self._prev = [None if p.grad is None else p.grad.detach().clone() for p in params]
        else:
            self._prev = None

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
            "none" if self.guard.ema is None else format(self.guard.ema, ".4g"),
        )  # fmt: skip
        self.ctx.emit_event(
            EVENT_MICRO_BATCH_DROP, step=step + 1, micro_batch=self._seen, reason=decision.reason, grad_norm=float(norm)
        )
        return True

    # ------------------------------------------------------------------ before the step decision

    def finish(self, params: list[torch.nn.Parameter]) -> bool:
        """Average the kept micro-batches (over ranks too); returns True when every micro-batch was dropped.

        Called once per optimizer step, before the step gate. Under DDP this is the step's gradient all-reduce.
        """
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
        ema = self.guard.ema
        self.ctx.log_metric(GEPO_MICRO_SPIKE_EMA, math.nan if ema is None else float(ema))
        return kept == 0 and seen > 0 and not self.observe

    # ------------------------------------------------------------------ state (per rank: each judges its own)

    def rank_state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict(), "dropped_total": self.dropped_total}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.guard.load_state_dict(state["guard"])
        self.dropped_total = float(state.get("dropped_total", 0.0))
