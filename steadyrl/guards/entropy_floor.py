"""Entropy floor (QUATRO, ``guards.quatro.entropy``): keep the policy's token entropy above ``floor_ratio`` x its
mean over the first ``baseline_steps`` optimizer steps (docs/DESIGN.md, "QUATRO: entropy floor").

The rolling ``window`` mean of the entropy is compared with the floor: below it the floor turns on, above floor x
``HYSTERESIS`` off. A PI controller on the relative gap ``(floor - mean) / floor`` sets the control ``u`` in [0, 1]
(``integral += ki x gap``, ``u = integral + kp x gap``, both clamped), which sets the next step's levers:
``pg_scale`` (``1 - u x pg_brake`` on every advantage), ``moment_rescale()`` (Adam's moments follow that factor,
floored at ``brake_moments``), ``bonus`` (``u x coef_max``, TRL's ``entropy_coef``) and ``clip_scale()``
(``clip_factor`` while on). The learning gate (``reward_rising``) holds the floor off, every lever at 0, while the
reward it reads (``gate_reward``, else the training reward) still rises; with ``follow_learning`` such a step also
lowers the floor to ``floor_ratio`` x the window mean.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from steadyrl.guards.base import check_version
from steadyrl.metrics import (
    QUATRO_ENTROPY,
    QUATRO_ENTROPY_BONUS,
    QUATRO_ENTROPY_CONTROL,
    QUATRO_ENTROPY_FLOOR,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_FLOOR_HELD_OFF,
    QUATRO_MOMENT_SCALE,
)
from steadyrl.ranges import Checked, bounded

# The learning gate compares the mean reward of the last GATE_WINDOW / 2 steps with that of the GATE_WINDOW / 2
# before them; "rising" is a difference above GATE_Z standard errors.
GATE_WINDOW = 10
GATE_Z = 1.0
HYSTERESIS = 1.05  # the floor turns off when the window mean is above floor x HYSTERESIS
# EntropyFloor's attributes in its checkpoint, in this order ("rewards" after the first 12)
_STATE = (
    "baseline floor active control integral at_cap steps nan_count activations warnings check_ref check_steps "
    "held_off holding_off follows moment_scale"
).split()


@dataclass
class EntropyConfig(Checked):
    enabled: bool = True
    baseline_steps: int = bounded(10, ge=1)  # optimizer steps whose mean entropy is the baseline
    floor_ratio: float = bounded(0.15, gt=0, le=1)  # floor = floor_ratio x baseline
    window: int = bounded(10, ge=1)  # rolling window (steps) compared with the floor
    ki: float = bounded(0.1, gt=0, finite=True)  # integral gain: control change per step at a relative gap of 1
    kp: float = bounded(0.4, ge=0, finite=True)  # proportional gain: control per unit relative gap
    coef_max: float = bounded(0.01, ge=0, finite=True)  # entropy bonus at control 1 (TRL's entropy_coef)
    pg_brake: float = bounded(1.0, ge=0, le=1)  # share of every advantage taken off at control 1; 0: off
    brake_moments: float = bounded(0.01, ge=0, lt=1)  # Adam's moments follow the brake, floored at this; 0: off
    clip_factor: float = bounded(0.5, gt=0, le=1)  # epsilon x clip_factor while the floor is active
    learning_gate: bool = True  # stay off while the training reward still rises (module docstring)
    # the reward the gate reads: a `rewards[].name` (weight 0 allowed); None: the weighted training reward
    gate_reward: str | None = None
    follow_learning: bool = False  # while the gate's reward rises the floor follows entropy down (module docstring)

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.coef_max == 0 and self.pg_brake == 0:
            problems.append("coef_max and pg_brake are both 0: the floor has no lever (set enabled: false instead)")
        if self.gate_reward is not None and not self.learning_gate:
            problems.append(
                f"gate_reward={self.gate_reward!r} is read only by the learning gate, but learning_gate is false: set "
                "learning_gate: true or drop gate_reward"
            )
        if self.follow_learning and not self.learning_gate:
            problems.append(
                "follow_learning moves the floor when the learning gate sees the reward rise, but "
                "learning_gate is false: set learning_gate: true or drop follow_learning"
            )
        if self.gate_reward is not None and not (isinstance(self.gate_reward, str) and self.gate_reward):
            problems.append(f"gate_reward must be a reward name (rewards[].name) or null, got {self.gate_reward!r}")
        if problems:
            raise ValueError("invalid EntropyConfig: " + "; ".join(problems))


class EntropyFloor:
    """Entropy floor controller: ``observe(entropy_mean)`` once per optimizer step (after the step's loss);
    ``bonus``, ``pg_scale`` and ``clip_scale()`` then apply to the next step."""

    def __init__(self, config: EntropyConfig | None = None) -> None:
        self.config = config or EntropyConfig()
        c = self.config
        self._window: deque[float] = deque(maxlen=c.window)
        self._baseline_values: list[float] = []
        self.baseline: float | None = None
        self.floor: float | None = None
        self.active = False
        self.control = 0.0  # u in [0, 1]
        self.integral = 0.0  # in control units
        self.steps = 0  # finite observations
        self.nan_count = self.activations = self.warnings = 0
        self.at_cap = 0  # steps with the control at 1 while below the floor
        self.warning: str | None = None  # the warning of the last observe() call, else None
        self.check_ref = math.nan  # window mean at the start of the current falling check
        self.check_steps = 0
        self._rewards: deque[float] = deque(maxlen=GATE_WINDOW)  # per-step training reward means
        self.held_off = 0  # steps with the entropy under the floor while the reward was rising
        self.holding_off = False  # this step's
        self.follows = 0  # steps on which follow_learning lowered the floor
        self.moment_scale = 1.0  # the brake factor Adam's moments follow now (brake_moments; 1: as the gradients)

    @property
    def bonus(self) -> float:
        """TRL's ``entropy_coef``: control x ``coef_max`` (0 while the learning gate holds the floor off)."""
        return 0.0 if self.holding_off else self.control * self.config.coef_max

    @property
    def pg_scale(self) -> float:
        """Factor on the loss's advantages: ``1 - control x pg_brake`` (exactly 1 with the brake off, and while the
        learning gate holds the floor off)."""
        if self.holding_off or self.config.pg_brake == 0:
            return 1.0
        return 1.0 - self.control * self.config.pg_brake

    def moment_rescale(self) -> float:
        """The factor for Adam's ``exp_avg`` (its square for ``exp_avg_sq``), ``max(pg_scale, brake_moments) /
        moment_scale``, recording the new scale; 1.0 with ``brake_moments`` off. Once per step, after ``observe``."""
        low = self.config.brake_moments
        if low == 0:
            return 1.0
        target = max(self.pg_scale, low)
        factor, self.moment_scale = target / self.moment_scale, target
        return factor

    def window_mean(self) -> float:
        return sum(self._window) / len(self._window) if self._window else math.nan

    def clip_scale(self) -> float:
        """Factor for PPO's clip epsilon: ``clip_factor`` while the floor is active, else 1."""
        return self.config.clip_factor if self.active and not self.holding_off else 1.0

    def reward_rising(self) -> bool:
        """The learning gate: the last ``GATE_WINDOW / 2`` rewards' mean above the previous half's by more than
        ``GATE_Z`` standard errors of the difference; False with the gate off or fewer than ``GATE_WINDOW`` rewards."""
        if not self.config.learning_gate or len(self._rewards) < GATE_WINDOW:
            return False
        half = GATE_WINDOW // 2
        values = list(self._rewards)
        old, new = values[:half], values[-half:]
        means = [sum(v) / half for v in (old, new)]
        variances = [sum((x - m) ** 2 for x in v) / (half - 1) for v, m in zip((old, new), means, strict=True)]
        difference = means[1] - means[0]
        return difference > 0 and difference > GATE_Z * math.sqrt(sum(variances) / half)

    def observe(self, entropy_mean: float, reward_mean: float = math.nan) -> str | None:
        """Record one optimizer step's mean token entropy (reduced over ranks) and its mean training reward (NaN:
        none this step); returns a warning or None."""
        self.warning = None
        self.holding_off = False
        if math.isfinite(float(reward_mean)):
            self._rewards.append(float(reward_mean))
        value = float(entropy_mean)
        if not math.isfinite(value):
            self.nan_count += 1
            return None
        c = self.config
        self.steps += 1
        self._window.append(value)
        if self.baseline is None:
            self._baseline_values.append(value)
            if len(self._baseline_values) >= c.baseline_steps:
                self.baseline = sum(self._baseline_values) / len(self._baseline_values)
                self.floor = c.floor_ratio * self.baseline
                self._baseline_values = []
            return None
        assert self.floor is not None
        mean = self.window_mean()
        rising = self.reward_rising()
        if c.enabled and rising and c.follow_learning and c.floor_ratio * mean < self.floor:
            self.floor = c.floor_ratio * mean  # entropy spent on a rising reward is not given back
            self.follows += 1
        if c.enabled and mean < self.floor and rising:  # sharpening that buys reward: leave it
            self.held_off += 1
            self.holding_off = True
            self.active, self.control, self.integral = False, 0.0, 0.0
            return None
        activated = c.enabled and not self.active and mean < self.floor
        if activated:
            self.active = True
            self.activations += 1
            self.check_ref, self.check_steps = mean, 0
        elif self.active and (mean > self.floor * HYSTERESIS or not c.enabled):
            self.active = False
        if self.active or self.integral > 0:  # runs from the first activation until the integral is back at 0
            gap = (self.floor - mean) / self.floor if self.floor > 0 else 0.0
            self.integral = min(max(self.integral + c.ki * gap, 0.0), 1.0) if c.enabled else 0.0
            self.control = min(max(self.integral + c.kp * gap, 0.0), 1.0) if c.enabled else 0.0
            if self.control >= 1.0 and mean < self.floor:
                self.at_cap += 1
        if self.active and not activated:  # the falling check: every `window` steps after activation
            self.check_steps += 1
            if self.check_steps >= c.window:
                if mean < self.check_ref:
                    self.warnings += 1
                    self.warning = (
                        f"entropy floor active and the window entropy still fell over {c.window} steps "
                        f"({self.check_ref:.4g} -> {mean:.4g}, floor {self.floor:.4g}, "
                        f"control {self.control:.4g}): it is not holding it yet; raise guards.quatro.entropy.ki "
                        "(faster), pg_brake or coef_max (if the control sits at 1), or raise trainer.beta to pull "
                        'the policy back to the reference (docs/DESIGN.md, "QUATRO: entropy floor")'
                    )
                self.check_ref, self.check_steps = mean, 0
        return self.warning

    def metrics(self) -> dict[str, float]:
        """``quatro/entropy``: the rolling window mean (what the floor is compared with); floor NaN until set."""
        return {
            QUATRO_ENTROPY: self.window_mean(),
            QUATRO_ENTROPY_FLOOR: self.floor if self.floor is not None else math.nan,
            QUATRO_ENTROPY_BONUS: self.bonus,
            QUATRO_ENTROPY_CONTROL: self.control,
            QUATRO_FLOOR_ACTIVE: 1.0 if self.active else 0.0,
            **({QUATRO_FLOOR_HELD_OFF: 1.0 if self.holding_off else 0.0} if self.config.learning_gate else {}),
            **({QUATRO_MOMENT_SCALE: self.moment_scale} if self.config.brake_moments > 0 else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 3,
            "window": list(self._window),
            "baseline_values": list(self._baseline_values),
            **{key: getattr(self, key) for key in _STATE[:12]},
            "rewards": list(self._rewards),
            **{key: getattr(self, key) for key in _STATE[12:]},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version(state, 3, "the QUATRO entropy floor")
        self._window = deque((float(v) for v in state["window"]), maxlen=self.config.window)
        self._baseline_values = [float(v) for v in state["baseline_values"]]
        self.baseline = None if state["baseline"] is None else float(state["baseline"])
        self.floor = None if state["floor"] is None else float(state["floor"])
        self.active = bool(state["active"])
        self.control, self.integral = float(state["control"]), float(state["integral"])
        for key in ("steps", "nan_count", "activations", "warnings", "check_steps", "at_cap", "held_off", "follows"):
            setattr(self, key, int(state[key]))
        self.check_ref = float(state["check_ref"])
        self._rewards = deque((float(v) for v in state["rewards"]), maxlen=GATE_WINDOW)
        self.holding_off = bool(state["holding_off"])
        self.moment_scale = float(state["moment_scale"])
        self.warning = None
