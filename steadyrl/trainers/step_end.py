"""Station 4 of a TRL step, between two optimizer steps (``_GuardClock``, first in the Trainer's callbacks).

In this order, which matters: stepping guards (``step()``, e.g. GRADE's quantile refresh); OPEFO (floor, check,
repair, rollback or snapshot; an LR factor); QUATRO (the controllers observe the step: beta factor, entropy
coefficient, clip range, the brake's moment factor); then the guard-seconds metric. ``StepEnd`` gets a
``RuntimeContext`` and the ``GuardParts`` and returns what should change; ``_GuardClock`` writes it into TRL's state
through ``trl_state``. At train begin it installs the step gate in DeepSpeed and binds OPEFO to the optimizer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from steadyrl.guards.base import Stepping
from steadyrl.guards.optimizer_state import scale_moments
from steadyrl.metrics import (
    GUARD_PART_GEPO_ADVANTAGES,
    GUARD_PART_GEPO_SPIKE,
    GUARD_PART_OPEFO_STATE,
    GUARD_PART_QUATRO_CONTROLLERS,
    GUARD_SECONDS,
    QUATRO_BETA,
)
from steadyrl.trainers import trl_state
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.context import RuntimeContext
from steadyrl.trainers.guard_memory import write_guard_cost
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.opefo_runtime import keeps_adam_moments, optimizer_chain
from steadyrl.trainers.quatro_runtime import QuatroControls

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepEndResult:
    """What the guards want changed before the next step (None: leave it)."""

    lr_factor: float | None = None  # OPEFO's recovery factor on the scheduled LR
    controls: QuatroControls | None = None  # QUATRO's beta factor, entropy coefficient, clip scale
    metrics: dict[str, float] | None = None  # QUATRO's, logged once the controls are written (they read beta)


class StepEnd:
    """The guard layers' work between two optimizer steps. ``active``: whether any runs (the overhead metric)."""

    def __init__(self, ctx: RuntimeContext, parts: GuardParts, active: bool) -> None:
        self.ctx, self.parts, self.active = ctx, parts, active
        self._moments: torch.optim.Optimizer | None = None  # the Adam whose moments brake_moments rescales
        self._last_seconds = 0.0

    def begin(
        self, optimizer: Any, named_parameters: Callable[[], Iterable[tuple[str, torch.nn.Parameter]]],
        output_dir: str, guard_state: GuardState,
    ) -> None:  # fmt: skip
        """At train begin (after any resume): the brake's Adam, OPEFO bound to the optimizer (first snapshot)."""
        quatro = self.parts.quatro
        floor = quatro.entropy if quatro is not None else None
        if floor is not None and floor.config.brake_moments > 0 and not quatro.observe:
            base = optimizer_chain(optimizer)[-1]
            if not keeps_adam_moments(base):
                raise TypeError(
                    f"guards.quatro.entropy.brake_moments rescales Adam's moments (exp_avg, exp_avg_sq), but the "
                    f"optimizer is {type(base).__module__}.{type(base).__name__}. Use AdamW "
                    "(trainer.optim=adamw_torch) or set guards.quatro.entropy.brake_moments=0"
                )
            self._moments = base
        if self.parts.opefo is not None:
            self.parts.opefo.attach(self.ctx, optimizer, named_parameters, output_dir, guard_state)

    def after_step(self) -> StepEndResult:
        p = self.parts
        stepping = [(p.reward_processor, "grade"), (p.advantage_fn, GUARD_PART_GEPO_ADVANTAGES)]
        stepping += [(guard, GUARD_PART_GEPO_SPIKE) for guard in (*p.step_guards, *p.observe_step_guards)]
        for obj, part in stepping:
            if isinstance(obj, Stepping) and callable(obj.step):
                with self.ctx.timer(part):
                    obj.step()
        lr_factor = controls = metrics = None
        if p.opefo is not None:
            with self.ctx.timer(GUARD_PART_OPEFO_STATE):
                lr_factor = p.opefo.on_step_end()
        if p.quatro is not None:
            with self.ctx.timer(GUARD_PART_QUATRO_CONTROLLERS):
                controls, metrics = p.quatro.on_step_end()
                if self._moments is not None and (factor := p.quatro.take_moment_factor()) != 1.0:
                    scale_moments(self._moments, factor)  # before the next update, whose loss the brake scales
        return StepEndResult(lr_factor, controls, metrics)

    def log_seconds(self) -> None:
        """Seconds in steadyrl's guard code during this optimizer step, every hook's share (bench_overhead.py)."""
        if self.active:
            self.ctx.log_metric(GUARD_SECONDS, self.ctx.seconds - self._last_seconds)
        self._last_seconds = self.ctx.seconds


class _GuardClock(TrainerCallback):
    """The Trainer's callback for station 4 (and the step gate's DeepSpeed installation): runs ``StepEnd`` and
    writes what it returns into TRL's state."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if t.gate.active and t.gate.deepspeed:
            t.gate.install_deepspeed(t.optimizer)
        t.step_end.begin(t.optimizer, lambda: t.model.named_parameters(), t.args.output_dir, t.guard_state)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if t.scratch.vetoed_step:  # read by the Trainer right after this callback (optimizer_step_was_skipped)
            t.scratch.vetoed_step = False
            trl_state.mark_step_skipped(t.optimizer, True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        result = t.step_end.after_step()
        if result.lr_factor is not None:
            with t.ctx.timer(GUARD_PART_OPEFO_STATE):
                trl_state.apply_lr_factor(t, t.lr_scale, result.lr_factor)
        if result.controls is not None and result.metrics is not None:
            with t.ctx.timer(GUARD_PART_QUATRO_CONTROLLERS):
                t.apply_quatro(result.controls)
                metrics = result.metrics
                if t.quatro.kl is not None:
                    metrics[QUATRO_BETA] = t.beta  # the effective coefficient, every factor included
                t.ctx.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)})
        t.step_end.log_seconds()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if t.accelerator.is_main_process and (t.step_end.active or t.parts.finite_checks or t.parts.opefo is not None):
            try:  # a report: it must never cost the run its final save and eval, which come after train()
                write_guard_cost(Path(args.output_dir), t, state.global_step)
            except Exception as exc:
                logger.warning("could not write %s/guard_cost.json (%s); the run and its model are unaffected",
                               args.output_dir, exc)  # fmt: skip
