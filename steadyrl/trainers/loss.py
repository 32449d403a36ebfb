"""Station 2 of a TRL step, the loss: what steadyrl does inside ``_compute_loss`` and the log-prob forwards in it.

Before TRL's loss, the entropy floor's policy-gradient brake scales this micro-batch's advantages (put back after
the loss). On every log-prob forward: non-finite counts, observe mode's would-clamp count and the log-prob floor;
on the policy forward of a loss also the importance-ratio check. After the loss: QUATRO's measurements (TRL's kl
and entropy of the micro-batch, the replay metrics) and the loss's finite check. A ``RuntimeContext`` and the
``GuardParts`` in, values out; the micro-batch under way waits in ``HookScratch``.
"""

from __future__ import annotations

from typing import Any

import torch

from steadyrl.metrics import (
    GEPO_NONFINITE_LOGPROBS,
    GEPO_NONFINITE_LOSS,
    GEPO_NONFINITE_RATIOS,
    GEPO_WOULD_CLAMP_LOGPROBS,
    GUARD_PART_QUATRO_MEASURE,
    GUARD_PART_QUATRO_REPLAY,
    QUATRO_PG_SCALE,
    QUATRO_PG_SCALE_WOULD,
)
from steadyrl.trainers.context import RuntimeContext
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.scratch import HookScratch


class LossStation:
    """The guard work around one micro-batch's loss. ``wraps``: whether it has any (else TRL's loss as is)."""

    def __init__(self, ctx: RuntimeContext, parts: GuardParts, scratch: HookScratch) -> None:
        self.ctx, self.parts, self.scratch = ctx, parts, scratch
        self.quatro = parts.quatro
        self.wraps = parts.finite_checks or parts.quatro is not None

    def before(self, inputs: dict[str, Any], replay: bool, training: bool) -> torch.Tensor | None:
        """Before TRL's loss: mark the micro-batch for the log-prob check and apply the brake. Returns the
        micro-batch's own advantages, for ``restore``."""
        self.scratch.loss_inputs = inputs if self.parts.finite_checks or replay else None
        self.scratch.loss_logps = None
        advantages = inputs.get("advantages")
        self._pg_brake(inputs, training)
        return advantages

    def restore(self, inputs: dict[str, Any], advantages: torch.Tensor | None) -> torch.Tensor | None:
        """After TRL's loss returned or raised: the micro-batch's own advantages back; returns the policy log-probs
        its forward left (detached, or None)."""
        self.scratch.loss_inputs = None
        if advantages is not None:
            inputs["advantages"] = advantages
        logps, self.scratch.loss_logps = self.scratch.loss_logps, None
        return logps

    def _pg_brake(self, inputs: dict[str, Any], training: bool) -> None:
        """The entropy floor's brake (``guards.quatro.entropy.pg_brake``, docs/DESIGN.md): this loss trains on the
        advantages times ``pg_scale``; logged, and in observe mode logged as ``quatro/would_pg_scale`` only."""
        floor = self.quatro.entropy if self.quatro is not None else None
        if floor is None or floor.config.pg_brake == 0 or not training or "advantages" not in inputs:
            return
        scale = floor.pg_scale
        self.ctx.log_metric(QUATRO_PG_SCALE_WOULD if self.quatro.observe else QUATRO_PG_SCALE, scale)
        if scale != 1.0 and not self.quatro.observe:
            inputs["advantages"] = inputs["advantages"] * scale

    def on_logps(self, logps: torch.Tensor) -> torch.Tensor:
        """Every per-token log-prob forward (policy, old, reference): counts, the floor, and on the policy forward
        of a loss the importance ratios it will form."""
        p = self.parts
        if p.finite_checks:
            self.ctx.log_metric(GEPO_NONFINITE_LOGPROBS, float((~torch.isfinite(logps)).sum()))
        if p.observe_logprob_min is not None:
            self.ctx.log_metric(GEPO_WOULD_CLAMP_LOGPROBS, float((logps < p.observe_logprob_min).sum()))
        if p.logprob_min is not None:
            logps = logps.clamp(min=p.logprob_min)  # -inf -> floor; NaN stays NaN and is caught at the step
        inputs = self.scratch.loss_inputs
        if inputs is not None:  # the policy log-probs of a loss computation: the ratios it will form
            self.scratch.loss_inputs = None
            self.scratch.loss_logps = logps.detach()  # for QUATRO's replay ratio metric
            if p.finite_checks:
                old = inputs.get("old_per_token_logps")
                log_ratio = logps.detach() - (logps.detach() if old is None else old)
                bad = ~torch.isfinite(torch.exp(log_ratio)) & inputs["completion_mask"].bool()
                self.ctx.log_metric(GEPO_NONFINITE_RATIOS, float(bad.sum()))
        return logps

    def after(
        self, loss: torch.Tensor, inputs: dict[str, Any], logps: torch.Tensor | None, kl_entropy: tuple[float, float],
        replay: bool, training: bool,
    ) -> torch.Tensor:  # fmt: skip
        """After TRL's loss: QUATRO records TRL's ``kl_entropy`` of this micro-batch and the replay metrics; a
        non-finite loss is counted and tells OPEFO to check the state at the step's end."""
        if self.quatro is not None and training:
            with self.ctx.timer(GUARD_PART_QUATRO_MEASURE):
                self.quatro.record_micro_batch(inputs, *kl_entropy)
            if replay:
                with self.ctx.timer(GUARD_PART_QUATRO_REPLAY):
                    self.quatro.record_replay(inputs, logps)  # replay share, age and importance ratio
        if not self.parts.finite_checks:
            return loss
        # A non-finite loss makes the gradient, hence the global norm, non-finite: the step guard skips that step.
        finite = bool(torch.isfinite(loss.detach()))
        self.ctx.log_metric(GEPO_NONFINITE_LOSS, float(not finite))
        if not finite and self.parts.opefo is not None:
            self.parts.opefo.on_nonfinite_loss()
        return loss
