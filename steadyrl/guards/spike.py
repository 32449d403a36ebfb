"""GEPO's gradient-spike detector: veto an optimizer step whose gradient is poisoned (docs/DESIGN.md, "GEPO: spike
skip").

An EMA of the global pre-clip gradient norm tracks what "normal" looks like. After ``warmup_steps`` accepted
steps, a step is skipped when its norm exceeds ``spike_factor`` x EMA *and* ``abs_threshold`` (both, so a
run whose norms are all tiny is not skipped on relative noise), or at once when the norm is not finite.
Skipped norms never enter the EMA. ``max_consecutive_skips`` skips in a row stop the run with an error that
names the cause, since by then the model, not one batch, is broken.

Left to the trainer: zeroing the gradients (``SteadyGRPOTrainer`` drops them so ``optimizer.step()`` is a
no-op) and, with the OPEFO layer, keeping the skipped gradient for error feedback (``on_skip`` receives it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.base import StepDecision


@dataclass
class SpikeConfig:
    ema_decay: float = 0.98
    warmup_steps: int = 10
    spike_factor: float = 5.0
    abs_threshold: float = 5.0
    max_consecutive_skips: int = 20


class SpikeSkipError(RuntimeError):
    """Too many optimizer steps in a row were vetoed."""


class SpikeGuard:
    """A StepGuard: ``decide(grad_norm, step)`` -> StepDecision; stateful (EMA, counters)."""

    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = config or SpikeConfig()
        if not 0.0 < self.config.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.config.ema_decay} must be in (0, 1)")
        self.ema: float | None = None
        self.accepted = 0
        self.consecutive = 0
        self.skipped = 0
        self.reasons: dict[str, int] = {}

    def decide(self, grad_norm: torch.Tensor, step: int) -> StepDecision:
        norm = float(grad_norm)
        c = self.config
        if not math.isfinite(norm):
            return self._skip("nonfinite", norm, step)
        if self.ema is not None and self.accepted >= c.warmup_steps:
            if norm > c.spike_factor * self.ema and norm > c.abs_threshold:
                return self._skip("spike", norm, step)
        self.ema = norm if self.ema is None else c.ema_decay * self.ema + (1.0 - c.ema_decay) * norm
        self.accepted += 1
        self.consecutive = 0
        return StepDecision.proceed()

    def _skip(self, reason: str, norm: float, step: int) -> StepDecision:
        self.skipped += 1
        self.consecutive += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self.consecutive >= self.config.max_consecutive_skips:
            raise SpikeSkipError(
                f"step {step}: {self.consecutive} optimizer steps in a row were skipped (last: {reason}, grad norm "
                f"{norm:.4g}, EMA {self.ema if self.ema is None else format(self.ema, '.4g')}). The gradients stay "
                "broken: check the loss and rewards for NaN/inf, lower the learning rate, or resume from an "
                "earlier checkpoint"
            )
        return StepDecision(True, reason)

    def on_skip(self, gradients: list[torch.Tensor | None], decision: StepDecision, step: int) -> None:
        """Nothing kept here; the OPEFO layer's error feedback takes the skipped gradient."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "ema": self.ema,
            "accepted": self.accepted,
            "consecutive": self.consecutive,
            "skipped": self.skipped,
            "reasons": dict(self.reasons),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema = state["ema"]
        self.accepted = state["accepted"]
        self.consecutive = state["consecutive"]
        self.skipped = state["skipped"]
        self.reasons = dict(state["reasons"])
