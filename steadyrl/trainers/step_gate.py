"""Station 3, the optimizer-step gate: the step guards see the global pre-clip gradient norm and one veto skips the
step (its gradients go to the guards and to error feedback first; ``gepo/skipped_<reason>``, an event); a taken step
gets the pending error feedback, then the usual clipping. Observing guards decide the same way and only count
(``gepo/would_skipped_<reason>``, ``gepo/would_stop``): the step proceeds as in plain TRL. One process or DDP: from
``_clip_grad_norm`` (the gradients are all-reduced: every rank decides the same); DeepSpeed ZeRO-2: inside the ZeRO
optimizer's step (``install_deepspeed``), since ``_clip_grad_norm`` comes after ``engine.step()``.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any

import torch

from steadyrl.guards.base import StepDecision, StepGuard, combine_decisions
from steadyrl.guards.error_feedback import ErrorFeedback
from steadyrl.guards.spike import SpikeSkipError
from steadyrl.metrics import (
    EVENT_SKIP,
    GEPO_SKIPPED_STEPS,
    GEPO_WOULD_STOP,
    GUARD_PART_GEPO_SPIKE,
    GUARD_PART_OPEFO_FEEDBACK,
    OPEFO_EF_WEIGHT,
    gepo_skipped,
    would,
)
from steadyrl.trainers.context import RuntimeContext, StepNotes
from steadyrl.trainers.micro_batch_gate import MicroBatchGate

logger = logging.getLogger(__name__)


def feeds_back(guards: list[StepGuard], decisions: list[StepDecision]) -> bool:
    """Whether error feedback may keep a skipped step's gradients: not when a guard that vetoed it says they are
    wrong in direction, not only in size (``feeds_back = False``: the mismatch gate's off-policy batch)."""
    return all(getattr(g, "feeds_back", True) for g, d in zip(guards, decisions, strict=True) if d.skip)


class StepGate:
    """Step guards + the skip bookkeeping (``counters``: saved in the checkpoint). ``observers``: step guards in
    observe mode. ``feedback``: error feedback; with ``would`` (OPEFO observing: its counts) a skip only counts what
    it would keep. ``notes``: a skip has the step end check the optimizer state."""

    def __init__(
        self, guards: list[StepGuard], ctx: RuntimeContext, feedback: ErrorFeedback | None = None,
        observers: list[StepGuard] | None = None, deepspeed: bool = False, notes: StepNotes | None = None,
        would: dict[str, int] | None = None,
    ) -> None:  # fmt: skip
        self.guards, self.ctx, self.feedback, self.would = guards, ctx, feedback, would
        self.deepspeed = deepspeed  # the gate runs inside the ZeRO optimizer's step (``install_deepspeed``)
        self.observers = list(observers or [])
        self.notes = notes if notes is not None else StepNotes()
        self.counters: dict[str, float] = defaultdict(float)
        self._ds_installed = False

    @property
    def active(self) -> bool:
        return bool(self.guards or self.observers)

    def gate_step(
        self, model: torch.nn.Module, optimizer: Any, max_grad_norm: float, micro: MicroBatchGate | None = None
    ) -> tuple[torch.Tensor | None, bool]:
        """Station 3, from the Trainer's ``_clip_grad_norm`` (one process or DDP): the micro-batch gate's average,
        then skip or clip. Returns (pre-clip norm, skipped); norm None: nothing to gate here, TRL clips (no step
        guard, or DeepSpeed, where the gate runs inside the engine's step)."""
        if micro is not None and micro.params is not None:
            with self.ctx.timer(GUARD_PART_GEPO_SPIKE):
                every_one_dropped = micro.finish(micro.params)
            if every_one_dropped:  # nothing left to train on: the step is skipped like a vetoed one
                self.veto("micro_batches")
                model.zero_grad(set_to_none=True)
                return torch.zeros((), device=self.ctx.device), True
        if not self.active or self.deepspeed:
            return None, False
        scaler = getattr(optimizer, "scaler", None)  # accelerate's GradScaler: fp16 without DeepSpeed
        if scaler is not None:
            # unscale first, as accelerator.clip_grad_norm_ does: the gate sees the true gradients, and a vetoed
            # step (no gradients left) passes scaler.step / scaler.update like a step without overflow
            scaler.unscale_(optimizer.optimizer)
        return self.clip_or_skip(model, max_grad_norm)

    def decide(self, norm: torch.Tensor, gradients: list[torch.Tensor | None]) -> StepDecision:
        """Ask every step guard about the global pre-clip norm; on a veto, hand them this rank's ``gradients`` (its
        partition under ZeRO-2) and count it. Dropping them is the caller's job."""
        step = self.ctx.global_step()
        decisions = [guard.decide(norm, step) for guard in self.guards]
        decision = combine_decisions(decisions)
        if self.observers:
            self._observe(norm, step)
        if decision.skip:
            for guard in self.guards:
                guard.on_skip(gradients, decision, step)
            if self.feedback is not None and feeds_back(self.guards, decisions):
                with self.ctx.timer(GUARD_PART_OPEFO_FEEDBACK):  # a copy of the skipped gradients
                    self.keep_skipped(gradients, step)
            self._count_skip(decision.reason, float(norm), step)
        self._log_counters("skipped_steps", "skipped_")
        for guard in self.guards:  # a guard's own counters (the spike guard's baseline, rebases, ...)
            metrics = getattr(guard, "metrics", None)
            if metrics is not None:
                self.ctx.log_metrics(metrics())
        return decision

    def keep_skipped(self, gradients: list[torch.Tensor | None], step: int) -> None:
        """Error feedback keeps a skipped step's gradients (observing: counts it); the step end checks the state."""
        self.notes.check_now = "skipped step"
        if self.would is not None:  # skipped by an acting step guard: count what error feedback would keep
            self.would["feed_back"] += int(self.feedback.config.enabled)
        elif self.feedback.store(gradients):
            logger.info("step %d: skipped gradient kept for error feedback", step)

    def feed_back(self, gradients: list[torch.Tensor | None]) -> bool:
        """Inject the pending residual's next piece into this step's gradients; True when it changed them."""
        if self.feedback is None or self.would is not None or not self.feedback.pending:
            return False
        with self.ctx.timer(GUARD_PART_OPEFO_FEEDBACK):
            metrics = self.feedback.apply(gradients)
            self.ctx.log_metrics(metrics)
        return metrics.get(OPEFO_EF_WEIGHT, 0.0) > 0.0

    def veto(self, reason: str) -> StepDecision:
        """Skip this step without asking the guards (every micro-batch was dropped); counted like any skip."""
        self._count_skip(reason, 0.0, self.ctx.global_step())
        self._log_counters("skipped_steps", "skipped_")
        return StepDecision(True, reason)

    def _count_skip(self, reason: str, norm: float, step: int) -> None:
        self.counters["skipped_steps"] += 1
        # numbered like the log rows: the step being decided ends with global_step == step + 1
        self.ctx.emit_event(EVENT_SKIP, step=step + 1, reason=reason, grad_norm=norm)
        for one in reason.split(","):
            self.counters[f"skipped_{one}"] += 1
        logger.warning("step %d: optimizer step skipped (%s, grad norm %.4g)", step + 1, reason, norm)

    def _log_counters(self, total: str, prefix: str) -> None:
        """The skip counters (act: ``skipped_*``; observe: ``would_skip*``, logged under their ``would`` names)."""
        name = would if total == "would_skip" else str
        self.ctx.log_metric(name(GEPO_SKIPPED_STEPS), self.counters[total])
        for key, value in self.counters.items():
            if key.startswith(prefix) and key != total:  # per reason: skipped_spike, ...
                self.ctx.log_metric(name(gepo_skipped(key.removeprefix(prefix))), value)

    def _observe(self, norm: torch.Tensor, step: int) -> None:
        """The observing guards' decision on this step: counted, never applied."""
        decisions = []
        for guard in self.observers:
            try:
                decisions.append(guard.decide(norm, step))
            except SpikeSkipError as exc:  # act mode would stop the run here; observe mode only counts it
                self.counters["would_stop"] += 1
                decisions.append(StepDecision(True, "spike" if math.isfinite(float(norm)) else "nonfinite"))
                if self.counters["would_stop"] == 1:
                    logger.warning("observe mode: act mode would have stopped the run here: %s", exc)
        would = combine_decisions(decisions)
        if would.skip:
            self.counters["would_skip"] += 1
            for reason in would.reason.split(","):
                self.counters[f"would_skip_{reason}"] += 1
            logger.info(
                "step %d: observe mode: the step guard would skip this step (%s, grad norm %.4g); it proceeds",
                step + 1, would.reason, float(norm),
            )  # fmt: skip
        self._log_counters("would_skip", "would_skip_")
        if self.counters.get("would_stop"):
            self.ctx.log_metric(GEPO_WOULD_STOP, self.counters["would_stop"])

    def clip_or_skip(self, model: torch.nn.Module, max_grad_norm: float) -> tuple[torch.Tensor, bool]:
        """One process or DDP: decide on the global pre-clip norm, then drop the gradients (every ``.grad`` None) or
        clip them. Returns (pre-clip norm, skipped)."""
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
        with self.ctx.timer(GUARD_PART_GEPO_SPIKE):
            decision = self.decide(norm, grads)
        if decision.skip:
            model.zero_grad(set_to_none=True)
            return norm, True
        if self.feed_back(grads):  # error feedback changed the gradients: norm them again
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        return norm, False

    def install_deepspeed(self, optimizer: Any) -> None:
        """Put the gate inside DeepSpeed's ZeRO optimizer step (ZeRO-2 is tested): ``step`` computes the global norm
        (``scaled_global_norm``, equal on every rank), then calls ``_update_scale(overflow)`` and returns early on
        ``overflow``. The hook decides in the first call and raises ``overflow`` in the second; a step DeepSpeed's
        own overflow check skips before any norm shows the guards a NaN norm. Accelerate reports the skip."""
        if self._ds_installed:
            return
        zero = optimizer
        while not hasattr(zero, "scaled_global_norm") and getattr(zero, "optimizer", None) is not None:
            zero = zero.optimizer
        if not (hasattr(zero, "scaled_global_norm") and hasattr(zero, "_update_scale")):
            raise RuntimeError(
                f"guards.gepo.spike under DeepSpeed hooks the ZeRO stage 1/2 optimizer, but the engine uses "
                f"{type(zero).__name__}; use zero_optimization.stage 2 (stage 1 is untested), or set "
                "guards.gepo.enabled=false"
            )
        original_norm, original_update = zero.scaled_global_norm, zero._update_scale
        pending: dict[str, bool | None] = {"skip": None}

        def scaled_global_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
            scaled = original_norm(*args, **kwargs)
            norm = scaled.detach().float() / float(zero.loss_scale)
            if not bool(scaled >= 0):  # DeepSpeed reports an inf/NaN group norm as -1
                norm = torch.full_like(norm, float("nan"))
            with self.ctx.timer(GUARD_PART_GEPO_SPIKE):
                grads = [g for i in sorted(zero.averaged_gradients) for g in (zero.averaged_gradients[i] or [])]
                pending["skip"] = self.decide(norm, grads).skip
            if not pending["skip"] and self.feed_back(grads):  # error feedback changed the partition: norm again
                scaled = original_norm(*args, **kwargs)
            return scaled

        def update_scale(has_overflow: bool) -> None:
            if pending["skip"] is None and has_overflow:  # DeepSpeed skipped before computing a norm
                self.decide(torch.tensor(float("nan")), [])
            original_update(has_overflow)
            if pending["skip"]:
                zero.overflow = True
            pending["skip"] = None

        zero.scaled_global_norm = scaled_global_norm
        zero._update_scale = update_scale
        self._ds_installed = True
