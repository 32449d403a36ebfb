"""GEPO's gradient-spike detector: veto an optimizer step whose gradient is poisoned (docs/DESIGN.md, "GEPO: spike
skip").

The baseline is the run's own: the median ``m`` and the robust spread ``s = 1.4826 x MAD`` of the log gradient norms
of the last ``window`` accepted steps. A step is skipped at once when its global pre-clip norm is not finite, and
as a spike when ``log(norm) - m`` exceeds both ``log(min_ratio)`` (the floor: never under ``min_ratio`` x the median
norm, from the first accepted norm on) and, once ``warmup_steps`` norms are in the window, ``z_threshold`` x ``s``
-- but always above ``max_ratio`` x the median (a noisy window never hides a spike that large).
``max_consecutive_skips`` skips in a row stop the run. A norm of at most ``ZERO_NORM`` (no learning signal) proceeds
but stays out of the baseline; the last ``rebase_after`` of a streak of spikes, none above ``max_ratio`` x the median
before them, are a level shift: the window restarts from them and the step proceeds (norms above ``max_ratio``
never are). Zeroing a skipped step's gradients is left to the trainer. ``min_ratio: .inf`` keeps only the
non-finite test (OPEFO's guard, and GEPO's with ``spike.enabled: false``).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.base import StepDecision, check_version
from steadyrl.metrics import GEPO_SPIKE_MEDIAN, GEPO_SPIKE_REBASES, GEPO_SPIKE_Z, GEPO_ZERO_GRAD_STEPS
from steadyrl.ranges import Checked, bounded

logger = logging.getLogger(__name__)
GRANULARITIES = ("step", "micro_batch")  # SpikeConfig.granularity
ZERO_NORM = (
    1e-10  # a finite norm at most this is a no-signal step (every group zero-variance): kept out of the baseline
)
MAD_SIGMA = 1.4826  # MAD x this estimates a normal standard deviation


@dataclass
class SpikeConfig(Checked):
    window: int = bounded(50, ge=2)  # accepted norms the baseline (median, MAD of log norm) is taken over
    warmup_steps: int = bounded(10, ge=1)  # accepted norms before the z-score test joins the ratio floor
    min_ratio: float = bounded(100.0, gt=1)  # a spike is above this x the baseline's median norm (inf: no spike test)
    z_threshold: float = bounded(6.0, gt=0, finite=True)  # ... and this many robust spreads above it in log norm
    max_ratio: float = bounded(1000.0, gt=1)  # ... or above this x the median, however noisy the window
    max_consecutive_skips: int = bounded(20, ge=1)
    rebase_after: int = 4  # this many spike decisions in a row restart the baseline from them (0 = never)
    # step: one decision per optimizer step on the global norm; micro_batch: also one per micro-batch on its own
    # gradient, dropping the spiking ones (steadyrl/trainers/micro_batch_gate.py)
    granularity: str = "step"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_ratio < self.min_ratio and not math.isinf(self.min_ratio):
            raise ValueError(f"max_ratio={self.max_ratio} must be >= min_ratio={self.min_ratio}")
        if self.rebase_after < 0 or self.rebase_after == 1:
            raise ValueError(f"rebase_after={self.rebase_after} must be 0 (off) or >= 2")

    @property
    def tests_spikes(self) -> bool:
        return not math.isinf(self.min_ratio)


class SpikeSkipError(RuntimeError):
    """Too many optimizer steps in a row were vetoed."""


class SpikeGuard:
    """A StepGuard: ``decide(grad_norm, step)`` -> StepDecision; stateful (the window, counters)."""

    def __init__(self, config: SpikeConfig | None = None) -> None:
        self.config = config or SpikeConfig()
        self.window: deque[float] = deque(maxlen=self.config.window)  # log norms of accepted steps
        self.accepted = 0
        self.consecutive = 0
        self.skipped = 0
        self.reasons: dict[str, int] = {}
        self.zero_steps = 0
        self.rebases = 0
        self.last_z = math.nan  # the last finite norm's robust z-score (NaN before the warm-up ends)
        self._spike_norms: list[float] = []  # norms of the current streak of spike decisions

    @property
    def baseline(self) -> float | None:
        """The window's median norm (None before the first accepted norm)."""
        return math.exp(statistics.median(self.window)) if self.window else None

    def threshold(self) -> float:
        """The smallest norm judged a spike now (inf before the first accepted norm)."""
        c = self.config
        if not self.window or not c.tests_spikes:
            return math.inf
        median = statistics.median(self.window)
        margin = math.log(c.min_ratio)
        if len(self.window) >= c.warmup_steps:
            margin = max(margin, min(c.z_threshold * self._spread(median), math.log(c.max_ratio)))
        return math.exp(median + margin)

    def _spread(self, median: float) -> float:
        return MAD_SIGMA * statistics.median(abs(v - median) for v in self.window)

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
        if c.tests_spikes and len(self.window) >= c.warmup_steps:
            median = statistics.median(self.window)
            spread = self._spread(median)
            self.last_z = (math.log(norm) - median) / spread if spread > 0 else math.inf
        if norm > self.threshold():
            self._spike_norms.append(norm)
            if not self._level_shift():
                return self._skip("spike", norm, step)
            old = self.baseline
            self.window.clear()
            self.window.extend(math.log(v) for v in self._spike_norms[-c.rebase_after :])
            self.rebases += 1
            logger.warning(
                "step %d: %d gradient-norm spikes in a row (baseline median %.4g, spikes' median %.4g) are a level "
                "shift, not a spike: the spike guard restarts its baseline from them and takes the step "
                "(guards.gepo.spike.rebase_after=%d)",
                step + 1, len(self._spike_norms), old, self.baseline, c.rebase_after,
            )  # fmt: skip
        elif c.tests_spikes:
            self.window.append(math.log(norm))
        self._spike_norms = []
        self.accepted += 1
        self.consecutive = 0
        return StepDecision.proceed()

    def _level_shift(self) -> bool:
        """The last ``rebase_after`` spikes in a row, none above ``max_ratio`` x the median before them: a new level.
        Above it they stay spikes (a poisoned regime: skipped until ``max_consecutive_skips`` stops the run)."""
        c, baseline = self.config, self.baseline
        if not c.rebase_after or len(self._spike_norms) < c.rebase_after or baseline is None:
            return False
        return max(self._spike_norms[-c.rebase_after :]) <= c.max_ratio * baseline

    def metrics(self) -> dict[str, float]:
        """Cumulative counters, the baseline median norm and the last robust z-score (NaN before they exist); none
        without a spike test (the non-finite-only guard)."""
        if not self.config.tests_spikes:
            return {}
        baseline = self.baseline
        return {
            GEPO_ZERO_GRAD_STEPS: float(self.zero_steps),
            GEPO_SPIKE_REBASES: float(self.rebases),
            GEPO_SPIKE_MEDIAN: math.nan if baseline is None else baseline,
            GEPO_SPIKE_Z: self.last_z,
        }

    def _skip(self, reason: str, norm: float, step: int) -> StepDecision:
        self.skipped += 1
        self.consecutive += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if self.consecutive >= self.config.max_consecutive_skips:
            baseline = self.baseline
            raise SpikeSkipError(
                f"step {step}: {self.consecutive} optimizer steps in a row were skipped (last: {reason}, grad norm "
                f"{norm:.4g}, baseline median {baseline if baseline is None else format(baseline, '.4g')}). The "
                "gradients stay broken: check the loss and rewards for NaN/inf, lower the learning rate, or resume "
                "from an earlier checkpoint"
            )
        return StepDecision(True, reason)

    def on_skip(self, gradients: list[torch.Tensor | None], decision: StepDecision, step: int) -> None:
        """Nothing kept here; the OPEFO layer's error feedback takes the skipped gradient."""

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 2,
            "window": list(self.window),
            **{key: getattr(self, key) for key in ("accepted", "consecutive", "skipped", "zero_steps", "rebases")},
            "reasons": dict(self.reasons),
            "last_z": self.last_z,
            "spike_norms": list(self._spike_norms),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version(state, 2, "the GEPO spike guard")
        self.window = deque((float(v) for v in state["window"]), maxlen=self.config.window)
        for key in ("accepted", "consecutive", "skipped", "zero_steps", "rebases"):
            setattr(self, key, int(state[key]))
        self.reasons = dict(state["reasons"])
        self.last_z = float(state["last_z"])
        self._spike_norms = [float(v) for v in state["spike_norms"]]
