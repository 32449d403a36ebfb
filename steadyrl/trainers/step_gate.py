"""The optimizer-step gate: should this optimizer step happen? And its installation inside DeepSpeed.

Before every optimizer step the step guards (``StepGuard``: GEPO's spike detector) see the global pre-clip gradient
norm; one veto skips the step. A skip hands the gradients to the guards and to OPEFO's error feedback before they
are dropped, is counted (``gepo/skipped_steps``, per reason ``gepo/skipped_<reason>``) and recorded as an event.
A taken step first gets OPEFO's pending error feedback, then the usual clipping.

Observing guards (``observers``: a layer in ``mode: observe``, docs/DESIGN.md, "Observe mode") see the same norm
and decide the same way, but their veto only counts (``gepo/would_skipped_steps``, per reason
``gepo/would_skipped_<reason>``; ``gepo/would_stop`` where the guard would have stopped the run): the step proceeds,
nothing is handed to error feedback, and a non-finite gradient reaches the optimizer exactly as in plain TRL.

Where the decision runs:
- one process or DDP: ``SteadyGRPOTrainer._clip_grad_norm`` -> ``StepGate.gate_step`` (gradients are already
  all-reduced there, so the local norm is the global norm and every rank decides the same; under fp16's GradScaler
  the trainer unscales them first);
- DeepSpeed ZeRO-2: the step runs inside ``accelerator.backward`` -> ``engine.step()``, so the Trainer's
  ``_clip_grad_norm`` comes too late; ``install_deepspeed`` puts the gate inside the ZeRO optimizer's step.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any, Protocol

import torch

from steadyrl.guards.base import StepDecision, StepGuard, combine_decisions
from steadyrl.guards.spike import SpikeSkipError
from steadyrl.metrics import (
    EVENT_SKIP,
    GEPO_SKIPPED_STEPS,
    GEPO_WOULD_SKIP,
    GEPO_WOULD_STOP,
    GUARD_PART_GEPO_SPIKE,
    GUARD_PART_OPEFO_FEEDBACK,
    gepo_skipped,
    gepo_would_skip,
)
from steadyrl.trainers.context import RuntimeContext
from steadyrl.trainers.micro_batch_gate import MicroBatchGate

logger = logging.getLogger(__name__)


class ErrorFeedbackHook(Protocol):
    """What the gate needs of OPEFO: keep a skipped step's gradients, feed them back into a taken step."""

    def on_skip(self, gradients: list[torch.Tensor | None]) -> None: ...

    def feed_back(self, gradients: list[torch.Tensor | None]) -> bool: ...


class StepGate:
    """Step guards + the skip bookkeeping. ``counters`` is saved in the checkpoint (``skipped_steps``, ...).

    ``observers``: step guards in observe mode; they decide on every step, their vetoes are only counted.
    """

    def __init__(
        self,
        guards: list[StepGuard],
        ctx: RuntimeContext,
        feedback: ErrorFeedbackHook | None = None,
        observers: list[StepGuard] | None = None,
        deepspeed: bool = False,
    ) -> None:
        self.guards = guards
        self.deepspeed = deepspeed  # the gate runs inside the ZeRO optimizer's step (``install_deepspeed``)
        self.observers = list(observers or [])
        self.ctx = ctx
        self.feedback = feedback
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
            # The gradients are still multiplied by the loss scale. Unscale them first, as the Trainer's own
            # clipping does (accelerator.clip_grad_norm_): the gate decides on, feeds back into and clips the true
            # gradients, and the scaler records its inf check here, so a vetoed step (no gradients left) passes
            # scaler.step / scaler.update like a step without overflow.
            scaler.unscale_(optimizer.optimizer)
        return self.clip_or_skip(model, max_grad_norm)

    def decide(self, norm: torch.Tensor, gradients: list[torch.Tensor | None]) -> StepDecision:
        """Ask every step guard about the global pre-clip norm; on a veto, hand them the gradients and count it.

        ``gradients`` are this rank's: all gradients under one process or DDP (already all-reduced), this
        rank's gradient partition under DeepSpeed ZeRO-2. Dropping them is the caller's job.
        """
        step = self.ctx.global_step()
        decision = combine_decisions([guard.decide(norm, step) for guard in self.guards])
        if self.observers:
            self._observe(norm, step)
        if decision.skip:
            for guard in self.guards:
                guard.on_skip(gradients, decision, step)
            if self.feedback is not None:
                with self.ctx.timer(GUARD_PART_OPEFO_FEEDBACK):  # a copy of the skipped gradients
                    self.feedback.on_skip(gradients)
            self._count_skip(decision.reason, float(norm), step)
        self._log_counters()
        for guard in self.guards:  # a guard's own counters (the spike guard's baseline, rebases, ...)
            metrics = getattr(guard, "metrics", None)
            if metrics is not None:
                self.ctx.log_metrics(metrics())
        return decision

    def veto(self, reason: str) -> StepDecision:
        """Skip this step without asking the guards (every micro-batch was dropped: no gradient is left to judge,
        keep or feed back); counted like any skip (``gepo/skipped_<reason>``)."""
        self._count_skip(reason, 0.0, self.ctx.global_step())
        self._log_counters()
        return StepDecision(True, reason)

    def _count_skip(self, reason: str, norm: float, step: int) -> None:
        self.counters["skipped_steps"] += 1
        # numbered like the log rows: the step being decided ends with global_step == step + 1
        self.ctx.emit_event(EVENT_SKIP, step=step + 1, reason=reason, grad_norm=norm)
        for one in reason.split(","):
            self.counters[f"skipped_{one}"] += 1
        logger.warning("step %d: optimizer step skipped (%s, grad norm %.4g)", step + 1, reason, norm)

    def _log_counters(self) -> None:
        self.ctx.log_metric(GEPO_SKIPPED_STEPS, self.counters["skipped_steps"])
        for key, value in self.counters.items():
            if key.startswith("skipped_") and key != "skipped_steps":  # per reason: skipped_spike, ...
                self.ctx.log_metric(gepo_skipped(key.removeprefix("skipped_")), value)

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
        self.ctx.log_metric(GEPO_WOULD_SKIP, self.counters["would_skip"])
        for key, value in self.counters.items():
            if key.startswith("would_skip_"):
                self.ctx.log_metric(gepo_would_skip(key.removeprefix("would_skip_")), value)
        if self.counters.get("would_stop"):
            self.ctx.log_metric(GEPO_WOULD_STOP, self.counters["would_stop"])

    def clip_or_skip(self, model: torch.nn.Module, max_grad_norm: float) -> tuple[torch.Tensor, bool]:
        """One process or DDP: decide on the global pre-clip norm, then drop the gradients or clip them.

        Returns (pre-clip norm, skipped). A skip sets every ``.grad`` to None, so ``optimizer.step()`` changes nothing.
        """
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
        with self.ctx.timer(GUARD_PART_GEPO_SPIKE):
            decision = self.decide(norm, grads)
        if decision.skip:
            model.zero_grad(set_to_none=True)
            return norm, True
        if self.feedback is not None:
            with self.ctx.timer(GUARD_PART_OPEFO_FEEDBACK):
                if self.feedback.feed_back(grads):  # error feedback changed the gradients: norm them again
                    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        return norm, False

    def install_deepspeed(self, optimizer: Any) -> None:
        """Put the gate inside DeepSpeed's ZeRO optimizer step (ZeRO-2 is tested; called once the engine exists).

        ``DeepSpeedZeroOptimizer.step`` first computes the global gradient norm (``scaled_global_norm``: all-reduced
        over the data-parallel group, so identical on every rank) and then calls ``_update_scale(overflow)``; when
        ``overflow`` is set after that call it drops the gradients and returns without touching weights or moments.
        The hook decides on the first call and raises ``overflow`` in the second. DeepSpeed's own overflow check
        (fp16 or ``check_grad_overflow``) may skip a step before any norm is computed; the guards then see a NaN
        norm, so counts stay right. Accelerate reports the skip (``optimizer.overflow``), and the Trainer then
        leaves the LR schedule alone.
        """
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
            if not pending["skip"] and self.feedback is not None:
                with self.ctx.timer(GUARD_PART_OPEFO_FEEDBACK):
                    if self.feedback.feed_back(grads):  # error feedback changed the partition: norm it again
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
