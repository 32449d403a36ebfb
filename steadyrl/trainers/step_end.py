"""Station 4 of a TRL step, between two optimizer steps (``_GuardClock``, first in the Trainer's callbacks).

In this order, which matters: stepping guards (``step()``, e.g. GRADE's quantile refresh); the optimizer-state
recovery (``recovery.StateRecovery``; an LR factor); the controllers (``guards.quatro.kl`` / ``.entropy`` observe the
step's ``StepNotes``: beta factor, entropy coefficient, clip range, the brake's moment factor; PPO's KL once per
generation batch); the guard-seconds metric. ``_GuardClock`` writes what ``StepEnd`` returns through ``trl_state``.
Observe mode: the controllers observe, ``controls()`` is empty and the would-be values get ``would`` names.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from steadyrl.guards.base import Stepping
from steadyrl.guards.entropy_floor import EntropyFloor
from steadyrl.guards.kl_controller import AdaptiveKL
from steadyrl.guards.optimizer_state import scale_moments
from steadyrl.metrics import (
    EVENT_ENTROPY_FLOOR_WARNING,
    GUARD_PART_GEPO_ADVANTAGES,
    GUARD_PART_GEPO_SPIKE,
    GUARD_PART_OPEFO_STATE,
    GUARD_PART_QUATRO_CONTROLLERS,
    GUARD_SECONDS,
    QUATRO_BETA,
    QUATRO_CLIP_SCALE_WOULD,
    QUATRO_ENTROPY_BONUS,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_GOLD_LR_FACTOR,
    QUATRO_KL_COEF,
    QUATRO_KL_FACTOR,
    QUATRO_MOMENT_SCALE,
    would,
)
from steadyrl.trainers import trl_state
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.context import Controls, RuntimeContext, StepNotes, TrainerSettings
from steadyrl.trainers.guard_memory import write_guard_cost
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.recovery import StateRecovery, keeps_adam_moments, optimizer_chain

logger = logging.getLogger(__name__)
quatro_logger = logging.getLogger("steadyrl.quatro")

# TRL 1.16 ``_compute_loss``: the loss types whose ``epsilon_low/high`` are PPO's clip range (``torch.clamp(coef_1,
# 1 - epsilon_low, 1 + epsilon_high)``); cispo uses epsilon_high as a truncation bound, sapo and vespo not at all.
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# what the controllers set (observe mode logs them under their ``would`` names); the other metrics are measurements
_DECISIONS = frozenset({QUATRO_KL_COEF, QUATRO_ENTROPY_BONUS, QUATRO_FLOOR_ACTIVE, QUATRO_MOMENT_SCALE})


class StepEnd:
    """The guard layers' work between two optimizer steps. ``active``: whether any runs (the overhead metric);
    ``kl`` / ``entropy``: the controllers, ``recovery``: the optimizer-state recovery (None: off)."""

    def __init__(
        self, ctx: RuntimeContext, parts: GuardParts, active: bool, notes: StepNotes | None = None,
        settings: TrainerSettings | None = None,
    ) -> None:  # fmt: skip
        self.ctx, self.parts, self.active = ctx, parts, active
        self.notes = notes if notes is not None else StepNotes()
        self._moments: torch.optim.Optimizer | None = None  # the Adam whose moments brake_moments rescales
        self.last_seconds = 0.0
        opefo = parts.opefo
        self.recovery = StateRecovery(opefo, "opefo" in parts.observe, self.notes) if opefo is not None else None
        self.kl: AdaptiveKL | None = None
        self.entropy: EntropyFloor | None = None
        self.observe = "quatro" in parts.observe
        self.scales_clip = False  # the loss type's epsilon is PPO's clip range
        self.base_entropy_coef = settings.entropy_coef if settings is not None else 0.0  # the floor's bonus adds
        self.kl_from_rollouts = settings is not None and settings.kl_from_rollouts
        self._moment_factor = 1.0  # brake_moments: this step's factor for Adam's moments (take_moment_factor)
        config, setup = parts.quatro, settings
        if config is None or setup is None:
            return
        if self.observe:
            self.scales_clip = config.entropy is not None and setup.loss_type in CLIP_LOSS_TYPES  # the would-be scale
            enabled = [n for n in ("kl", "entropy", "filters") if getattr(config, n) is not None]
            quatro_logger.info(
                "QUATRO observe mode (%s): decisions are computed and logged, TRL's beta=%g, entropy_coef=%g and "
                "epsilon stay unchanged and every row trains",
                ", ".join(enabled) or "nothing enabled", setup.beta, setup.entropy_coef,
            )  # fmt: skip
            if config.replay is not None and config.replay.enabled:
                quatro_logger.info(
                    "guards.quatro.replay is inactive in observe mode: no sampling log-probs, no mixing (replayed rows "
                    "would change training)"
                )
        if config.kl is not None and setup.beta == 0.0:
            quatro_logger.info(
                "trainer.beta is 0 (TRL's default): no KL term, so guards.quatro.kl has nothing to control and stays "
                "inactive for this run; set trainer.beta > 0 (e.g. 0.04) to anchor the policy to the reference model"
            )
        elif config.kl is not None:
            self.kl = AdaptiveKL(config.kl, setup.beta)
        if config.entropy is not None and setup.use_adaptive_entropy:
            quatro_logger.warning(
                "trainer.use_adaptive_entropy is on: TRL's adaptive entropy controller drives entropy_coef, so the "
                "QUATRO entropy floor is off for this run (to use the floor instead, set "
                "trainer.use_adaptive_entropy=false)"
            )
        elif config.entropy is not None:
            self.entropy = EntropyFloor(config.entropy)
        if self.entropy is not None and not self.observe:
            self.scales_clip = setup.loss_type in CLIP_LOSS_TYPES
            if not self.scales_clip:
                quatro_logger.warning(
                    "loss_type=%s has no PPO clip range: the entropy floor raises the bonus but cannot lower epsilon",
                    setup.loss_type,
                )

    def begin(
        self, optimizer: Any, named_parameters: Callable[[], Iterable[tuple[str, torch.nn.Parameter]]],
        output_dir: str, guard_state: GuardState,
    ) -> None:  # fmt: skip
        """At train begin (after any resume): the brake's Adam; the recovery binds to the optimizer."""
        floor = self.entropy
        if floor is not None and floor.config.brake_moments > 0 and not self.observe:
            base = optimizer_chain(optimizer)[-1]
            if not keeps_adam_moments(base):
                raise TypeError(
                    f"guards.quatro.entropy.brake_moments rescales Adam's moments (exp_avg, exp_avg_sq), but the "
                    f"optimizer is {type(base).__module__}.{type(base).__name__}. Use AdamW "
                    "(trainer.optim=adamw_torch) or set guards.quatro.entropy.brake_moments=0"
                )
            self._moments = base
        if self.recovery is not None:
            self.recovery.attach(self.ctx, optimizer, named_parameters, output_dir, guard_state)

    def after_step(self) -> tuple[float | None, Controls | None, dict[str, float] | None]:
        """(LR factor, controls, the controllers' metrics: logged once the controls are written); None: no change."""
        p = self.parts
        stepping = [(p.reward_processor, "grade"), (p.advantage_fn, GUARD_PART_GEPO_ADVANTAGES)]
        stepping += [(guard, GUARD_PART_GEPO_SPIKE) for m in (False, True) for guard in p.step_guards_in(observing=m)]
        for obj, part in stepping:
            if isinstance(obj, Stepping) and callable(obj.step):
                with self.ctx.timer(part):
                    obj.step()
        lr_factor = controls = metrics = None
        if self.recovery is not None:
            with self.ctx.timer(GUARD_PART_OPEFO_STATE):
                lr_factor = self.recovery.on_step_end()
        if p.quatro is not None:
            with self.ctx.timer(GUARD_PART_QUATRO_CONTROLLERS):
                controls, metrics = self.control_step()
                factor, self._moment_factor = self._moment_factor, 1.0  # brake_moments' factor on Adam's moments
                if self._moments is not None and factor != 1.0:  # None when off or observing
                    scale_moments(self._moments, factor)  # before the next update, whose loss the brake scales
        return lr_factor, controls, metrics

    def controls(self) -> Controls:
        """What the trainer writes into TRL: the controllers' outputs in act mode, nothing in observe mode."""
        return Controls() if self.observe else self.would_controls()

    def would_controls(self) -> Controls:
        """The controllers' current outputs (beta factor, entropy coefficient, clip scale), applied or not."""
        return Controls(
            kl_factor=self.kl.factor if self.kl is not None else None,
            entropy_coef=self.base_entropy_coef + self.entropy.bonus if self.entropy is not None else None,
            clip_scale=self.entropy.clip_scale() if self.entropy is not None and self.scales_clip else None,
        )

    def control_step(self) -> tuple[Controls, dict[str, float]]:
        """The controllers observe the step's means. Returns the new controls and the metrics to log (NaN = not
        measured yet, e.g. the floor before its baseline: the trainer leaves them out)."""
        step, notes = self.ctx.global_step(), self.notes
        kl_mean, entropy_mean = (_token_mean([(e[k], e[2]) for e in notes.micro_batches]) for k in (0, 1))
        notes.micro_batches = []
        metrics: dict[str, float] = {}
        if self.kl is not None:
            if self.kl_from_rollouts:  # PPO: once per generation batch, none on steps that reuse a rollout
                rollouts, notes.rollout_kl = notes.rollout_kl, []
                if rollouts:
                    self.kl.observe(_token_mean(rollouts))
            else:
                self.kl.observe(kl_mean)
            metrics.update(self.kl.metrics())
        if self.entropy is not None:
            rewards, self.notes.rewards = self.notes.rewards, []
            warning = self.entropy.observe(entropy_mean, sum(rewards) / len(rewards) if rewards else math.nan)
            if warning is not None and self.observe:  # nothing was applied: the bonus cannot have failed
                quatro_logger.info("step %d: observe mode: entropy floor would be active and the entropy fell", step)
            elif warning is not None:
                quatro_logger.warning("step %d: %s", step, warning)
                self.ctx.emit_event(EVENT_ENTROPY_FLOOR_WARNING, message=warning)
            self._moment_factor = self.entropy.moment_rescale()
            metrics.update(self.entropy.metrics())
        if self.observe:  # the values the controllers would set, under their ``would`` names
            metrics = {would(k) if k in _DECISIONS else k: v for k, v in metrics.items() if k != QUATRO_KL_FACTOR}
            if self.entropy is not None:
                clip_scale = self.would_controls().clip_scale
                metrics[QUATRO_CLIP_SCALE_WOULD] = clip_scale if clip_scale is not None else 1.0
        return self.controls(), metrics


def _token_mean(pairs: list[tuple[float, float]]) -> float:
    """Token-weighted mean of (value, tokens) pairs, leaving out empty and non-finite ones; NaN without tokens."""
    kept = [(v, w) for v, w in pairs if w > 0 and math.isfinite(v)]
    total = sum(w for _, w in kept)
    return sum(v * w for v, w in kept) / total if total > 0 else math.nan


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
        lr_factor, controls, metrics = t.step_end.after_step()
        with t.ctx.timer(GUARD_PART_OPEFO_STATE):
            trl_state.apply_lr_factors(t, lr_factor)
        if t.lr_factors.get("gold", 1.0) != 1.0:  # every step the gold watch's tightening is in effect: the ledger
            t.ctx.log_metric(QUATRO_GOLD_LR_FACTOR, t.lr_factors["gold"])
            if t.step_end.kl is None and t.beta_base > 0:  # else the controllers' row below logs the coefficient
                t.ctx.log_metric(QUATRO_BETA, t.beta)
        if controls is not None and metrics is not None:
            with t.ctx.timer(GUARD_PART_QUATRO_CONTROLLERS):
                t.apply_controls(controls)
                if t.step_end.kl is not None:
                    metrics[QUATRO_BETA] = t.beta  # the effective coefficient, every factor included
                t.ctx.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)})
        if t.step_end.active:  # seconds in steadyrl's guard code during this optimizer step (bench_overhead.py)
            t.ctx.log_metric(GUARD_SECONDS, t.ctx.seconds - t.step_end.last_seconds)
        t.step_end.last_seconds = t.ctx.seconds
        t.close_ledger_step()


class _RunSummary(TrainerCallback):
    """Last of the guard callbacks (``SteadyGRPOTrainer.add_guard_callback`` puts the others before it): at train end,
    after the final periodic eval and the gold watch's last action, writes ``interventions.json`` and
    ``guard_cost.json``."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if t.accelerator.is_main_process and t.ledger is not None:
            t.ledger.write(Path(args.output_dir))  # a report: a full disk is a warning (storage.write_report)
        if t.accelerator.is_main_process and (t.step_end.active or t.parts.finite_checks or t.parts.opefo is not None):
            try:  # a report: it must never cost the run its final save and eval, which come after train()
                write_guard_cost(Path(args.output_dir), t, state.global_step)
            except Exception as exc:
                logger.warning("could not write %s/guard_cost.json (%s); the run and its model are unaffected",
                               args.output_dir, exc)  # fmt: skip
