"""Adaptive KL coefficient (QUATRO, ``guards.quatro.kl``): steer the mean per-token KL to the reference toward a
target by scaling beta (docs/DESIGN.md, "QUATRO: adaptive KL").

Every ``update_every`` optimizer steps the window mean is compared with ``target`` (0.02): above -> beta x ``up``
(1.2), below -> beta x ``down`` (0.8), clamped to [``beta_min``, ``beta_max``]. ``factor = beta / beta0`` is one
multiplicative factor of the trainer's KL coefficient. A NaN observation is ignored and counted; a window with no
finite value leaves beta unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from steadyrl.metrics import (
    QUATRO_KL_COEF,
    QUATRO_KL_FACTOR,
    QUATRO_KL_MEAN,
    QUATRO_KL_NAN,
    QUATRO_KL_TARGET,
)


@dataclass
class KLConfig:
    enabled: bool = True
    target: float = 0.02  # mean per-token KL to the reference
    update_every: int = 1  # optimizer steps per controller update (PPO: generation batches)
    up: float = 1.2  # KL above target: beta x up
    down: float = 0.8  # KL below target: beta x down
    beta_min: float = 1e-4
    beta_max: float = 1.0

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.target) and self.target > 0):
            problems.append(f"target must be finite and > 0, got {self.target}")
        if self.update_every < 1:
            problems.append(f"update_every must be >= 1, got {self.update_every}")
        if not (math.isfinite(self.up) and self.up > 1):
            problems.append(f"up must be finite and > 1, got {self.up}")
        if not 0 < self.down < 1:
            problems.append(f"down must be in (0, 1), got {self.down}")
        if not (0 < self.beta_min <= self.beta_max and math.isfinite(self.beta_max)):
            problems.append(
                f"need 0 < beta_min <= beta_max < inf, got beta_min={self.beta_min}, beta_max={self.beta_max}"
            )
        if problems:
            raise ValueError("invalid KLConfig: " + "; ".join(problems))


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
        if not c.beta_min <= beta0 <= c.beta_max:
            raise ValueError(
                f"trainer.beta={beta0} is outside [guards.quatro.kl.beta_min={c.beta_min}, "
                f"guards.quatro.kl.beta_max={c.beta_max}]; move trainer.beta into the range or widen it"
            )
        self.beta0 = float(beta0)
        self.beta = float(beta0)
        self._sum = 0.0
        self._count = 0
        self._steps = 0  # observe() calls since the last update
        self.last_mean = math.nan  # window mean of the last update
        self.updates = 0
        self.nan_count = 0

    @property
    def factor(self) -> float:
        """beta / beta0: the controller's multiplicative factor of the trainer's KL coefficient."""
        return self.beta / self.beta0

    @property
    def coef(self) -> float:
        """The controller's absolute KL coefficient (alias of ``beta``; logged as ``quatro/kl_coef``)."""
        return self.beta

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
        if not self.config.enabled:
            return False
        c = self.config
        if mean > c.target:
            self.beta = min(self.beta * c.up, c.beta_max)
        elif mean < c.target:
            self.beta = max(self.beta * c.down, c.beta_min)
        return True

    def metrics(self) -> dict[str, float]:
        """``quatro/kl_mean`` is the window mean of the last update (NaN before the first)."""
        return {
            QUATRO_KL_COEF: self.beta,
            QUATRO_KL_FACTOR: self.factor,
            QUATRO_KL_MEAN: self.last_mean,
            QUATRO_KL_TARGET: self.config.target,
            QUATRO_KL_NAN: float(self.nan_count),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "beta0": self.beta0,
            "beta": self.beta,
            "sum": self._sum,
            "count": self._count,
            "steps": self._steps,
            "last_mean": self.last_mean,
            "updates": self.updates,
            "nan_count": self.nan_count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.beta0 = float(state["beta0"])
        self.beta = float(state["beta"])
        self._sum = float(state["sum"])
        self._count = int(state["count"])
        self._steps = int(state["steps"])
        self.last_mean = float(state["last_mean"])
        self.updates = int(state["updates"])
        self.nan_count = int(state["nan_count"])
