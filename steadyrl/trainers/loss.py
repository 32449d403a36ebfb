"""Station 2 of a TRL step, the loss (``_compute_loss`` and the log-prob forwards in it): before TRL's loss the
entropy floor's brake scales the micro-batch's advantages (put back after); on every log-prob forward the non-finite
counts and the log-prob floor, on the policy forward of a loss the importance-ratio check; after the loss TRL's kl
and entropy go to ``StepNotes`` (the controllers), the replay metrics are logged and a non-finite loss is counted.
"""

from __future__ import annotations

from typing import Any

import torch

from steadyrl.guards.replay import replay_importance_ratio_sum
from steadyrl.metrics import (
    GEPO_NONFINITE_LOGPROBS,
    GEPO_NONFINITE_LOSS,
    GEPO_NONFINITE_RATIOS,
    GEPO_WOULD_CLAMP_LOGPROBS,
    GUARD_PART_QUATRO_MEASURE,
    GUARD_PART_QUATRO_REPLAY,
    QUATRO_PG_SCALE,
    QUATRO_PG_SCALE_WOULD,
    QUATRO_REPLAY_AGE_MEAN,
    QUATRO_REPLAY_FRAC,
    QUATRO_REPLAY_RATIO_MEAN,
)
from steadyrl.trainers.context import RuntimeContext, StepNotes
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.rollout import REPLAY_STEP_KEY, loss_mask
from steadyrl.trainers.scratch import HookScratch


class LossStation:
    """The guard work around one micro-batch's loss. ``wraps``: whether it has any (else TRL's loss as is);
    ``floor``: the step end's entropy floor, whose brake acts here."""

    def __init__(self, ctx: RuntimeContext, parts: GuardParts, scratch: HookScratch, notes: StepNotes | None = None,
                 floor: Any = None) -> None:  # fmt: skip
        self.ctx, self.parts, self.scratch, self.floor = ctx, parts, scratch, floor
        self.notes = notes if notes is not None else StepNotes()
        self.observe = "quatro" in parts.observe
        self.wraps = parts.finite_checks or parts.quatro is not None

    def before(self, inputs: dict[str, Any], replay: bool, training: bool) -> torch.Tensor | None:
        """Before TRL's loss: mark the micro-batch for the log-prob check, brake; returns its own advantages."""
        self.scratch.loss_inputs = inputs if self.parts.finite_checks or replay else None
        self.scratch.loss_logps = None
        advantages = inputs.get("advantages")
        self._pg_brake(inputs, training)
        return advantages

    def restore(self, inputs: dict[str, Any], advantages: torch.Tensor | None) -> torch.Tensor | None:
        """After TRL's loss returned or raised: the own advantages back; returns the forward's detached log-probs."""
        self.scratch.loss_inputs = None
        if advantages is not None:
            inputs["advantages"] = advantages
        logps, self.scratch.loss_logps = self.scratch.loss_logps, None
        return logps

    def _pg_brake(self, inputs: dict[str, Any], training: bool) -> None:
        """The entropy floor's brake (``guards.quatro.entropy.pg_brake``): advantages x ``pg_scale``."""
        floor = self.floor
        if floor is None or floor.config.pg_brake == 0 or not training or "advantages" not in inputs:
            return
        scale = floor.pg_scale
        self.ctx.log_metric(QUATRO_PG_SCALE_WOULD if self.observe else QUATRO_PG_SCALE, scale)
        if scale != 1.0 and not self.observe:
            inputs["advantages"] = inputs["advantages"] * scale

    def on_logps(self, logps: torch.Tensor) -> torch.Tensor:
        """Every per-token log-prob forward (policy, old, reference): counts, the floor, the ratios of a loss's."""
        p = self.parts
        if p.finite_checks:
            self.ctx.log_metric(GEPO_NONFINITE_LOGPROBS, float((~torch.isfinite(logps)).sum()))
        if p.logprob_min is not None and "gepo" in p.observe:
            self.ctx.log_metric(GEPO_WOULD_CLAMP_LOGPROBS, float((logps < p.logprob_min).sum()))
        elif p.logprob_min is not None:
            logps = logps.clamp(min=p.logprob_min)  # -inf -> floor; NaN stays NaN and is caught at the step
        inputs = self.scratch.loss_inputs
        if inputs is not None:  # the policy log-probs of a loss computation: the ratios it will form
            self.scratch.loss_inputs = None
            self.scratch.loss_logps = logps.detach()  # for the replay ratio metric
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
        """After TRL's loss: its ``kl_entropy`` noted, the replay metrics; a non-finite loss has the state checked."""
        if self.parts.quatro is not None and training:
            with self.ctx.timer(GUARD_PART_QUATRO_MEASURE):
                self.record_micro_batch(inputs, *kl_entropy)
            if replay:
                with self.ctx.timer(GUARD_PART_QUATRO_REPLAY):
                    self.record_replay(inputs, logps)
        if not self.parts.finite_checks:
            return loss
        # A non-finite loss makes the gradient, hence the global norm, non-finite: the step guard skips that step.
        finite = bool(torch.isfinite(loss.detach()))
        self.ctx.log_metric(GEPO_NONFINITE_LOSS, float(not finite))
        if not finite and self.parts.opefo is not None:
            self.notes.check_now = "non-finite loss"
        return loss

    def record_micro_batch(self, inputs: dict[str, Any], kl: float, entropy: float) -> None:
        """TRL's just-logged KL and entropy of a training micro-batch (NaN: not logged) with the global token count."""
        tokens = float(self.ctx.reduce_sum(loss_mask(inputs).sum().float().reshape(1)).item())
        self.notes.micro_batches.append((float(kl), float(entropy), tokens))

    def record_replay(self, inputs: dict[str, Any], per_token_logps: torch.Tensor | None) -> None:
        """Replay share, age and importance ratio of a training micro-batch, summed over ranks (a collective)."""
        mask = loss_mask(inputs)
        sampled = inputs.get(REPLAY_STEP_KEY)
        if sampled is None:  # a micro-batch mixed before replay was on (e.g. resumed from a run without it)
            sampled = torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)
        rows = sampled >= 0
        ages = float((self.ctx.global_step() - sampled[rows]).sum())
        ratio_sum, tokens = 0.0, 0.0
        old = inputs.get("old_per_token_logps")
        if per_token_logps is not None and old is not None:
            ratio_sum, tokens = (float(v) for v in replay_importance_ratio_sum(per_token_logps, old, mask, rows))
        local = [float(rows.sum()), float(rows.numel()), ages, ratio_sum, tokens]
        local_t = torch.tensor(local, dtype=torch.float64, device=self.ctx.device)
        replayed, total, age_sum, ratio_total, ratio_tokens = self.ctx.reduce_sum(local_t).tolist()
        self.ctx.log_metric(QUATRO_REPLAY_FRAC, replayed / total if total > 0 else 0.0)
        if replayed > 0:
            self.ctx.log_metric(QUATRO_REPLAY_AGE_MEAN, age_sum / replayed)
        if ratio_tokens > 0:
            self.ctx.log_metric(QUATRO_REPLAY_RATIO_MEAN, ratio_total / ratio_tokens)
