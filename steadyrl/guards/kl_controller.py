"""Adaptive KL coefficient (QUATRO, ``guards.quatro.kl``, off by default): keep the mean per-token KL to the
reference near a target by scaling beta (docs/DESIGN.md, "QUATRO: adaptive KL": a healthy run's KL ends 0.6-46x its
early level depending on the learning rate, so no default target tells drift from learning; it must be asked for).

With ``target: auto`` (the default) beta stays at ``trainer.beta`` for the first ``calibration_steps`` updates; the
target is then ``target_ratio`` x the mean KL of the second half of that window (at least ``TARGET_MIN``). A number
sets an absolute per-token target. Each update multiplies beta by KL / target clamped to [``down``, ``up``] and keeps
it in ``beta_range`` x ``trainer.beta``; updates that wanted beta past a bound are counted (resting at
``trainer.beta`` under a ``beta_range`` low of 1 is idle, not saturation). NaN observations are ignored and counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from steadyrl.guards.base import check_version
from steadyrl.metrics import (
    QUATRO_KL_AT_MAX,
    QUATRO_KL_AT_MIN,
    QUATRO_KL_BOUND_RUN,
    QUATRO_KL_COEF,
    QUATRO_KL_FACTOR,
    QUATRO_KL_MEAN,
    QUATRO_KL_NAN,
    QUATRO_KL_TARGET,
)
from steadyrl.ranges import Checked, bounded, bounds

AUTO = "auto"
TARGET_MIN = 1e-4  # floor of a calibrated target (a run whose KL is still ~0)


@dataclass
class KLConfig(Checked):
    enabled: bool = False
    # mean per-token KL to the reference, or "auto": calibrated from this run
    target: float | str = bounded(AUTO, gt=0, finite=True, choices=(AUTO,))
    calibration_steps: int = bounded(20, ge=2)  # auto: updates at trainer.beta before the target is set
    # auto: target = target_ratio x mean KL of the calibration window's second half
    target_ratio: float = bounded(10.0, gt=0, finite=True)
    update_every: int = bounded(1, ge=1)  # optimizer steps per controller update (PPO: generation batches)
    up: float = bounded(1.2, gt=1, finite=True)  # largest factor of one update (KL above target)
    down: float = bounded(0.8, gt=0, lt=1)  # smallest factor of one update (KL below target)
    beta_range: list[float] = field(  # x trainer.beta
        default_factory=lambda: [1.0, 4.0], metadata=bounds(gt=0, finite=True, min_len=2, max_len=2)
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.beta_range[0] <= 1 <= self.beta_range[1]:
            raise ValueError(
                f"invalid KLConfig: beta_range must be [low, high] with low <= 1 <= high, got {self.beta_range}"
            )

    def bounds(self, beta0: float) -> tuple[float, float]:
        """(lowest, highest) beta for a run whose trainer.beta is ``beta0``."""
        return beta0 * self.beta_range[0], beta0 * self.beta_range[1]


class AdaptiveKL:
    """KL coefficient controller: ``observe(kl_mean)`` once per optimizer step; ``beta``/``factor`` for the trainer."""

    def __init__(self, config: KLConfig | None, beta0: float) -> None:
        self.config = config or KLConfig()
        c = self.config
        if not (math.isfinite(beta0) and beta0 > 0):
            raise ValueError(
                f"the adaptive KL coefficient needs a starting beta > 0, got {beta0}: with beta 0 TRL never loads the "
                "reference model, so there is no KL to control. Set trainer.beta > 0 (e.g. 0.04), or "
                "guards.quatro.kl.enabled=false"
            )
        self.beta_min, self.beta_max = c.bounds(float(beta0))  # beta_range contains 1: trainer.beta is inside
        self.beta0 = self.beta = float(beta0)
        self.target: float = math.nan if c.target == AUTO else float(c.target)  # auto: set after calibration
        self._calibration: list[float] = []
        self._sum, self._count = 0.0, 0  # the finite observations since the last update
        self._steps = 0  # observe() calls since the last update
        self.last_mean = math.nan  # window mean of the last update
        self.updates = self.nan_count = 0
        self.at_max = 0  # updates that wanted beta above beta_max
        self.at_min = 0  # updates that wanted beta below beta_min
        self.bound_run = 0  # the current streak of either

    @property
    def factor(self) -> float:
        """beta / beta0: the controller's multiplicative factor of the trainer's KL coefficient."""
        return self.beta / self.beta0

    @property
    def calibrating(self) -> bool:
        return math.isnan(self.target)

    def observe(self, kl_mean: float) -> bool:
        """Record one optimizer step's mean per-token KL (reduced over ranks); True when beta was updated."""
        value = float(kl_mean)
        if math.isfinite(value):
            self._sum += value
            self._count += 1
        else:
            self.nan_count += 1
        self._steps += 1
        if self._steps < self.config.update_every:
            return False
        self._steps = 0
        if self._count == 0:  # a window of NaNs: no evidence, no change
            return False
        mean = self._sum / self._count
        self._sum, self._count = 0.0, 0
        self.last_mean = mean
        self.updates += 1
        c = self.config
        if self.calibrating:  # auto target: beta stays at trainer.beta while the window means are collected
            self._calibration.append(mean)
            if len(self._calibration) >= c.calibration_steps:
                tail = self._calibration[len(self._calibration) // 2 :]
                self.target = max(c.target_ratio * sum(tail) / len(tail), TARGET_MIN)
                self._calibration = []
            return False
        if not c.enabled:
            return False
        wanted = self.beta * min(max(mean / self.target, c.down), c.up)
        self.beta = min(max(wanted, self.beta_min), self.beta_max)
        if wanted > self.beta_max:
            self.at_max += 1
        elif wanted < self.beta_min < self.beta0:  # resting at trainer.beta (beta_range low 1) is idle, not saturation
            self.at_min += 1
        self.bound_run = self.bound_run + 1 if wanted > self.beta_max or wanted < self.beta_min < self.beta0 else 0
        return True

    def metrics(self) -> dict[str, float]:
        """``quatro/kl_mean`` is the window mean of the last update (NaN before the first); ``quatro/kl_target``
        is NaN while an auto target calibrates."""
        return {
            QUATRO_KL_COEF: self.beta,
            QUATRO_KL_FACTOR: self.factor,
            QUATRO_KL_MEAN: self.last_mean,
            QUATRO_KL_TARGET: self.target,
            QUATRO_KL_NAN: float(self.nan_count),
            QUATRO_KL_AT_MAX: float(self.at_max),
            QUATRO_KL_AT_MIN: float(self.at_min),
            QUATRO_KL_BOUND_RUN: float(self.bound_run),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 2,
            **{key: getattr(self, key) for key in ("beta0", "beta", "target")},
            "calibration": list(self._calibration),
            **{key: getattr(self, "_" + key) for key in ("sum", "count", "steps")},
            **{key: getattr(self, key) for key in "last_mean updates nan_count at_max at_min bound_run".split()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version(state, 2, "the QUATRO KL controller")
        self.beta0 = float(state["beta0"])
        self.beta = float(state["beta"])
        self.target = float(state["target"])
        self._calibration = [float(v) for v in state["calibration"]]
        self.at_max = int(state["at_max"])
        self.at_min = int(state["at_min"])
        self.bound_run = int(state["bound_run"])
        self._sum = float(state["sum"])
        self._count = int(state["count"])
        self._steps = int(state["steps"])
        self.last_mean = float(state["last_mean"])
        self.updates = int(state["updates"])
        self.nan_count = int(state["nan_count"])
