"""GEPO's gradient-spike detector: veto an optimizer step whose gradient is poisoned (docs/DESIGN.md, "GEPO: spike
skip").

After ``warmup_steps`` accepted steps, a step is skipped when its global pre-clip gradient norm exceeds
``spike_factor`` x the EMA of accepted norms *and* ``abs_threshold``, or at once when it is not finite;
``max_consecutive_skips`` skips in a row stop the run. A norm of at most ``ZERO_NORM`` (no learning signal) proceeds
but stays out of the EMA; ``rebase_after`` spikes in a row are a level shift: the EMA is re-anchored to their median
and the step proceeds. Zeroing a skipped step's gradients is left to the trainer.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.base import StepDecision
from steadyrl.metrics import GEPO_SPIKE_EMA, GEPO_SPIKE_REBASES, GEPO_ZERO_GRAD_STEPS

logger = logging.getLogger(__name__)
GRANULARITIES = ("step", "micro_batch")  # SpikeConfig.granularity
ZERO_NORM = 1e-10  # a finite norm at most this is a no-signal step (every group zero-variance): kept out of the EMA


@dataclass
class SpikeConfig:
    ema_decay: float = 0.98
    warmup_steps: int = 10
    spike_factor: float = 5.0
    abs_threshold: float = 5.0
    max_consecutive_skips: int = 20
    rebase_after: int = 4  # this many spike decisions in a row re-anchor the EMA (0 = never)
    # step: one decision per optimizer step on the global norm; micro_batch: also one per micro-batch on its own
    # gradient, dropping the spiking ones (steadyrl/trainers/micro_batch_gate.py)
    granularity: str = "step"


class SpikeSkipError(RuntimeError):
    """Too many optimizer steps in a row were vetoed."""


class SpikeGuard:
    """A StepGuard: ``decide(grad_norm, step)`` -> StepDecision; stateful (EMA, counters)."""

    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = config or SpikeConfig()
        if not 0.0 < self.config.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.config.ema_decay} must be in (0, 1)")
        if self.config.rebase_after < 0 or self.config.rebase_after == 1:
            raise ValueError(f"rebase_after={self.config.rebase_after} must be 0 (off) or >= 2")
        self.ema: float | None = None
        self.accepted = 0
        self.consecutive = 0
        self.skipped = 0
        self.reasons: dict[str, int] = {}
        self.zero_steps = 0
        self.rebases = 0
        self._spike_norms: list[float] = []  # norms of the current streak of spike decisions

    def decide(self, grad_norm: torch.Tensor, step: int) -> StepDecision:
        norm = float(grad_norm)
        c = self.config
        if not math.isfinite(norm):
            self._spike_norms = []
            return self._skip("nonfinite", norm, step)
        if norm <= ZERO_NORM:  # no learning signal: proceed, keep it out of the baseline
            self.zero_steps += 1
            self.consecutive = 0
            self._spike_norms = []
            return StepDecision.proceed()
        warm = self.ema is not None and self.accepted >= c.warmup_steps
        if warm and norm > c.spike_factor * self.ema and norm > c.abs_threshold:
            self._spike_norms.append(norm)
            if not (c.rebase_after and len(self._spike_norms) >= c.rebase_after):
                return self._skip("spike", norm, step)
            old, self.ema = self.ema, statistics.median(self._spike_norms)
            self.rebases += 1
            logger.warning(
                "step %d: %d gradient-norm spikes in a row (EMA %.4g, median %.4g) are a level shift, not a "
                "spike: the spike guard re-anchors its baseline and takes the step (guards.gepo.spike."
                "rebase_after=%d)",
                step + 1,
                len(self._spike_norms),
                old,
                self.ema,
                c.rebase_after,
            )
        else:
            self.ema = norm if self.ema is None else c.ema_decay * self.ema + (1.0 - c.ema_decay) * norm
        self._spike_norms = []
        self.accepted += 1
        self.consecutive = 0
        return StepDecision.proceed()

    def metrics(self) -> dict[str, float]:
        """Cumulative counters and the current baseline (NaN before the first accepted step); none without a spike
        test (the non-finite-only guard)."""
        if math.isinf(self.config.spike_factor):
            return {}
        return {
            GEPO_ZERO_GRAD_STEPS: float(self.zero_steps),
            GEPO_SPIKE_REBASES: float(self.rebases),
            GEPO_SPIKE_EMA: math.nan if self.ema is None else float(self.ema),
        }

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
            **{key: getattr(self, key) for key in ("ema", "accepted", "consecutive", "skipped")},
            "reasons": dict(self.reasons),
            "zero_steps": self.zero_steps,
            "rebases": self.rebases,
            "spike_norms": list(self._spike_norms),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("ema", "accepted", "consecutive", "skipped"):
            setattr(self, key, state[key])
        self.reasons = dict(state["reasons"])
        self.zero_steps = int(state["zero_steps"])
        self.rebases = int(state["rebases"])
        self._spike_norms = [float(v) for v in state["spike_norms"]]
