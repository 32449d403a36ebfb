"""QUATRO inside a running SteadyGRPOTrainer: when the KL and entropy controllers observe, what they set, and
where the rollout filters cut.

The pure pieces (``steadyrl.guards.quatro``) know nothing about the Trainer; this module wires them in:

- measurements: after every training micro-batch loss (``SteadyGRPOTrainer._compute_loss``) the runtime records
  TRL's just-logged ``kl`` and ``entropy`` (each already a token mean over all ranks) with the micro-batch's token
  count over all ranks; at the optimizer step's end the step mean is the token-weighted mean of those entries.
  Micro-batches whose every row the filters dropped have no tokens and do not count (TRL logs 0 for them).
- adaptive KL (after each optimizer step): ``AdaptiveKL.observe(step mean KL)``, then
  ``trainer.set_beta_factor("quatro_kl", factor)``. The effective coefficient is
  ``trainer.beta = beta_base x quatro_kl x grade`` (GRADE's KL compensation, when on, is the other factor).
- entropy floor (after each optimizer step): ``EntropyFloor.observe(step mean entropy)``, then TRL's own entropy
  bonus coefficient ``trainer.entropy_coef = floor.bonus`` (TRL's ``_entropy_bonus_enabled`` is switched on at
  bind time, with coefficient 0 the term adds exactly 0) and, for the loss types whose epsilon is PPO's clip range
  (``CLIP_LOSS_TYPES``), ``epsilon_low/high = initial x floor.clip_scale()``. Both apply from the next step on.
- filters (per generation batch, train mode): the gathered weighted rewards and token ids of the whole generation
  batch go through ``RolloutFilter``; ``SteadyGRPOTrainer`` then computes advantages with
  ``masked_group_advantages`` and zeroes the completion mask of this rank's dropped rows.

State: the controllers and the filter's length history are identical on every rank and saved with the guard
state of the main process; there is no per-rank state (replay, which would have some, is not wired yet).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from steadyrl.guards.quatro import AdaptiveKL, EntropyFloor, FilterResult, QuatroConfig, RolloutFilter

logger = logging.getLogger("steadyrl.quatro")

# TRL 1.16 ``_compute_loss``: the loss types whose ``epsilon_low/high`` are PPO's clip range (``torch.clamp(coef_1,
# 1 - epsilon_low, 1 + epsilon_high)``); cispo uses epsilon_high as a truncation bound, sapo and vespo not at all.
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


class QuatroRuntime:
    """QUATRO's schedule inside the trainer. Stateful: ``state_dict`` goes to the checkpoint's guard state."""

    def __init__(self, config: QuatroConfig) -> None:
        self.config = config
        self.kl: AdaptiveKL | None = None  # made in bind(): needs the trainer's beta
        self.entropy = EntropyFloor(config.entropy) if config.entropy is not None else None
        self.filter = RolloutFilter(config.filters) if config.filters is not None else None
        self.trainer: Any = None
        self._epsilon0: tuple[float, float] | None = None
        self._entries: list[tuple[float, float, float]] = []  # (kl, entropy, tokens) per micro-batch of this step

    @property
    def filters_on(self) -> bool:
        return self.filter is not None

    # ------------------------------------------------------------------ setup

    def bind(self, trainer: Any) -> None:
        """Called from the trainer's ``__init__`` (before any resume loads state into the controllers)."""
        self.trainer = trainer
        if self.config.kl is not None:
            self.kl = AdaptiveKL(self.config.kl, trainer.beta_base)  # raises (naming the fix) on beta 0
        if self.entropy is not None:
            if trainer.use_adaptive_entropy:
                raise ValueError(
                    "guards.quatro.entropy and trainer.use_adaptive_entropy both drive TRL's entropy_coef; keep one"
                )
            if trainer.entropy_coef != 0.0:
                logger.warning(
                    "trainer.entropy_coef=%g is replaced by the QUATRO entropy floor's bonus (0 until the floor is "
                    "active)",
                    trainer.entropy_coef,
                )
            trainer._entropy_bonus_enabled = True  # TRL fixes it at init; the floor's bonus needs the term
            if trainer.loss_type in CLIP_LOSS_TYPES:
                self._epsilon0 = (float(trainer.epsilon_low), float(trainer.epsilon_high))
            else:
                logger.warning(
                    "loss_type=%s has no PPO clip range: the entropy floor raises the bonus but cannot lower epsilon",
                    trainer.loss_type,
                )
        self._apply()

    def _apply(self) -> None:
        """Push the controllers' current outputs into the trainer (beta factor, entropy_coef, epsilon)."""
        trainer = self.trainer
        if trainer is None:
            return
        if self.kl is not None:
            trainer.set_beta_factor("quatro_kl", self.kl.factor)
        if self.entropy is not None:
            trainer.entropy_coef = self.entropy.bonus
            if self._epsilon0 is not None:
                scale = self.entropy.clip_scale()
                trainer.epsilon_low, trainer.epsilon_high = (e * scale for e in self._epsilon0)

    # ------------------------------------------------------------------ measurements

    def record_micro_batch(self, inputs: dict[str, Any]) -> None:
        """After a training micro-batch's loss: keep TRL's just-logged KL and entropy with the global token count."""
        trainer = self.trainer
        metrics = trainer._metrics["train"]
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        tokens = float(trainer.accelerator.reduce(mask.sum().float().reshape(1), reduction="sum").item())
        kl = metrics["kl"][-1] if trainer.beta != 0.0 and metrics.get("kl") else math.nan
        entropy = metrics["entropy"][-1] if metrics.get("entropy") else math.nan
        self._entries.append((float(kl), float(entropy), tokens))

    def _step_means(self) -> tuple[float, float]:
        """Token-weighted KL and entropy of this optimizer step's micro-batches (NaN without tokens)."""
        out = []
        for k in (0, 1):
            pairs = [(e[k], e[2]) for e in self._entries if e[2] > 0 and math.isfinite(e[k])]
            total = sum(w for _, w in pairs)
            out.append(sum(v * w for v, w in pairs) / total if total > 0 else math.nan)
        self._entries = []
        return out[0], out[1]

    # ------------------------------------------------------------------ after each optimizer step

    def on_step_end(self) -> None:
        trainer, step = self.trainer, self.trainer.state.global_step
        kl_mean, entropy_mean = self._step_means()
        metrics: dict[str, float] = {}
        if self.kl is not None:
            self.kl.observe(kl_mean)
            metrics.update(self.kl.metrics())
        if self.entropy is not None:
            warning = self.entropy.observe(entropy_mean)
            if warning is not None:
                logger.warning("step %d: %s", step, warning)
                trainer.emit_event("entropy_floor_warning", message=warning)
            metrics.update(self.entropy.metrics())
        self._apply()
        if self.kl is not None:
            metrics["quatro/beta"] = trainer.beta  # the effective coefficient, every factor included
        for name, value in metrics.items():
            if math.isfinite(value):  # NaN = not measured yet (floor before its baseline): left out of the log
                trainer._guard_metric(name, value)

    # ------------------------------------------------------------------ filters

    def filter_rows(
        self,
        rewards: torch.Tensor,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        num_generations: int,
    ) -> FilterResult:
        """Gathered generation batch -> which rows to keep; logs ``quatro/filtered/<reason>`` and the warning."""
        assert self.filter is not None
        result = self.filter(rewards, prompt_ids, completion_ids, num_generations)
        for name, value in result.metrics().items():
            self.trainer._guard_metric(name, value)
        if result.warning is not None:
            logger.warning("step %d: %s", self.trainer.state.global_step, result.warning)
            self.trainer.emit_event("filter_warning", message=result.warning)
        return result

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "kl": self.kl.state_dict() if self.kl is not None else None,
            "entropy": self.entropy.state_dict() if self.entropy is not None else None,
            "filter": self.filter.state_dict() if self.filter is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("kl", "entropy", "filter"):
            obj, saved = getattr(self, name), state.get(name)
            if obj is not None and saved is not None:
                obj.load_state_dict(saved)
            elif obj is not None:
                logger.warning("the checkpoint has no QUATRO %s state: it starts fresh", name)
        self._entries = []
        self._apply()
