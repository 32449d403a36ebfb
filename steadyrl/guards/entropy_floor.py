"""Entropy floor (QUATRO, ``guards.quatro.entropy``): keep the policy's entropy above a fraction of its early level
with TRL's own entropy bonus and a narrower clip range (docs/DESIGN.md, "QUATRO: entropy floor").

Baseline = mean token entropy of the first ``baseline_steps`` (10) optimizer steps, floor = ``floor_ratio`` (0.8) x
baseline, compared with the mean of a rolling ``window`` (5 steps). The floor turns on when the window mean falls
below it, and off above floor x ``hysteresis``; while it is on ``clip_scale()`` is ``clip_factor`` (0.5).

One proportional-integral controller drives three levers. Its output, the control ``u`` in ``[0, 1]``, follows the
relative gap ``gap = (floor - mean) / floor``: every step once the floor has turned on, ``integral += ki x gap``
and ``u = integral + kp x gap``, both kept in ``[0, 1]`` (``ki`` 0.1, ``kp`` 0.4 per unit of gap; the gains do not
depend on any lever's cap). Below the floor the integral grows towards the control that holds entropy there,
whatever the strength of the pressure that collapses it; above the floor it shrinks back. The proportional term
damps the loop: entropy integrates the levers' effect step after step, and an integral alone on such a plant
oscillates.

1. The covariance clip (``cov_clip``, 0: off by default, opt in with a share in (0, 1]; at 1 it cost a healthy
   SmolLM2-135M run 0.625 -> 0.420 held-out accuracy and did not hold a forced collapse either,
   docs/entropy_floor_log.md section 0): the policy gradient is taken off the ``u x cov_clip`` share of the
   tokens that sharpen the policy. A policy-gradient step on token ``a`` with advantage ``A`` moves the logits of
   its softmax by ``lr x A x (e_a - pi)``, and since ``dH/dz_b = -pi_b (log pi_b + H)`` the entropy of that
   distribution changes by ``-lr x A x [pi_a (log pi_a + H) - sum_b pi_b^2 (log pi_b + H)]``. The first term is
   ``sharpening_score``, ``A x pi(a) x (log pi(a) + H)``, computed from what the loss already has (each token's
   log-prob and the entropy of its distribution); the second, a covariance of ``pi`` and ``log pi`` under ``pi``
   that needs the whole distribution, is left out. Averaged over ``a ~ pi`` the change is
   ``-lr x Cov(log pi(a), pi(a) A(a))`` (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
   Reasoning Language Models", whose Clip-Cov centres log-probs and advantages on the batch instead of on each
   token's own distribution). A positive score marks a likely token reinforced or an unlikely one pushed further
   down: those lower entropy. Per micro-batch, the advantage of the top ``ceil(share x n_positive)`` tokens by
   score is set to 0 for that loss; their KL and entropy terms stay. At ``u = 1`` with ``cov_clip`` 1 no token
   left in the loss lowers its own distribution's entropy by its first term, so the lever grows with the
   pressure it has to hold, where a bonus of fixed size does not; the other tokens (an unlikely good token raised,
   a likely bad one lowered) keep learning. ``cov_clip_mask`` picks the tokens; the trainer applies it in the loss
   (``SteadyGRPOTrainer._cov_clip``). The rank is per rank's micro-batch, as the loss is.
2. The policy-gradient brake (``pg_brake``, 1 by default; 0: off): every advantage in the loss is multiplied by
   ``pg_scale = 1 - u x pg_brake``, so at ``u = 1`` with ``pg_brake`` 1 the reward's policy gradient is gone and
   only the bonus and the KL term move the policy. The bonus adds a force against the collapse; the brake takes
   away the force that causes it. On a forced collapse (a reward that pays for repeating) no bonus the real runs
   tolerate out-pulls the reward (docs/entropy_floor_log.md section 00: at 2.0 the reward still reaches 0.98), while
   the brake scales the reward's pull down in proportion to how far entropy is under the floor, however strong
   that pull is. It acts only while the floor does (never while the learning gate holds it off), and Adam's
   momentum carries about 10 steps of the old direction after it engages. ``SteadyGRPOTrainer._compute_loss``
   applies it to the micro-batch's advantages for that loss only (PPO's GAE advantages too). Measured on the
   forced collapse (docs/entropy_floor_log.md, section 000): at ``coef_max`` 0.01 entropy ends 4x higher than without
   it and the hack slows, but the band is not held, although the policy gradient was off on 49-88 of 200 steps.
   Adam's second moment still carries the removed gradient's size, so the remaining small gradients move the
   weights slowly; 2b is what makes it hold. On by default with 2b (both were off up to d25b1e6).
   2b. The brake's moments (``brake_moments``, 0.01 by default; 0: off; inert with ``pg_brake`` 0): Adam divides
   each update by the square root of its second-moment average, and with ``beta2`` 0.999 that average keeps the
   size of the policy gradient the brake has just removed for hundreds of steps, so the small gradients left (the
   bonus, the KL term) barely move the weights, and Adam's first moment keeps pushing the old direction for about
   10 steps.
   With ``brake_moments`` at ``m`` the moments follow the brake: after each step the trainer multiplies every
   ``exp_avg`` by ``r = max(pg_scale, m) / max(pg_scale_before, m)`` and every ``exp_avg_sq`` by ``r**2``
   (``moment_rescale``; ``scale_moments``), the state Adam would hold had every gradient it averaged been braked
   as this step's is. Adam is scale-invariant, so with the moments scaled the brake no longer shrinks the update:
   it changes its direction, from the reward's towards the bonus's and the KL term's, by the factor ``1 / r``
   (at most ``1 / m``). When the brake lets go the moments are scaled back up by the same factors. PPO's critic
   shares the optimizer, and its value loss is not braked: its param groups keep their moments (``UNBRAKED_GROUP``).
3. TRL's entropy bonus: ``bonus = u x coef_max`` (0.01), in TRL's ``entropy_coef`` units (loss - coef x mean token
   entropy). Why the cap is 0.01 and not more (docs/entropy_floor_log.md, section 0): at 0.5 the bonus alone kept a
   forced collapse's entropy 20x above plain TRL's but oscillated, and on SmolLM2-135M's healthy run (before the
   learning gate) it pushed entropy from 0.3 to 1.6 nats and held-out accuracy ended at 0.325 against plain's 0.575.

The control at 1 while entropy stays below the floor is counted (``at_cap``) and reported by ``steadyrl doctor``
with the key to change.

The learning gate (``learning_gate``, on by default): entropy alone cannot tell a collapse from a run that is
learning. A policy that learns a format or an answer sharpens: SmolLM2-135M's entropy falls to a quarter of its
start within 20 healthy steps, the tiny model's clean runs end at 0.15 nats while accuracy goes 0.54 -> 0.92. The
floor fought that sharpening on a real run (seed 1 of docs/benchmarks.md: the floor held entropy at 0.5 from step
15, and the run never learned the short-answer format, 0.215 against plain TRL's 0.975). So the floor acts only on
a fall that is not buying reward: it stays off, bonus 0, while the training reward is still rising, i.e. the mean
of the last ``gate_window / 2`` steps' rewards exceeds the mean of the ``gate_window / 2`` before them by more than
``gate_z`` standard errors of that difference. The steps held off this way are counted (``held_off``,
``quatro/floor_held_off``). Until ``gate_window`` rewards are known (and for a trainer that reports none) the floor
decides on entropy alone, as without the gate. With ``clip_while_learning`` the gate holds off only the bonus and
the narrower clip range: the controller keeps running and the covariance clip keeps acting under the floor while
the reward rises (it cannot raise entropy, only stop the sharpening tokens' share of the update). With
``keep_integral_while_held`` a held-off step still sets every lever to 0, but the integral is kept (not grown): on a
sparse verifier that ticks up by chance, each tick otherwise restarts the controller from 0.

Which reward the gate reads (``gate_reward``): by default the weighted training reward. A reward that pays for the
collapse itself (the forced collapse of docs/entropy_floor_log.md: a reward for repeating one character) rises while
entropy falls, exactly as a run that learns its task does (SmolLM2-135M seed 0: entropy 0.68 -> 0.07 nats while the
reward goes 0.16 -> 0.98 and 60 % of the groups end with one reward), so on that reward no gate can tell the two
apart. ``gate_reward`` names the reward the user trusts, for example a verifier with weight 0 that trains nothing;
the gate then holds the floor off only while *that* reward rises, and a fall that buys only the proxy reward meets
the floor.

``follow_learning`` (off by default): on every step the gate sees its reward rise, the floor moves down to
``floor_ratio`` x the window mean if that is lower (never up). Entropy spent while the trusted reward rose is not
asked back once the reward stalls: the floor then holds the entropy the run had when it last learned, instead of
pulling a run that has learned its format back to 0.8 x the entropy of its first steps. With both, the floor's
rule is "entropy may fall only while the reward you trust rises".
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.metrics import (
    QUATRO_ENTROPY,
    QUATRO_ENTROPY_BONUS,
    QUATRO_ENTROPY_CONTROL,
    QUATRO_ENTROPY_FLOOR,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_FLOOR_HELD_OFF,
    QUATRO_MOMENT_SCALE,
)


def sharpening_score(logps: torch.Tensor, entropies: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """Each token's first-order entropy cost of its policy-gradient term (module docstring, lever 1), up to the
    learning rate: ``A x pi(a) x (log pi(a) + H)``, with ``H`` the entropy of the distribution it was drawn from.
    Positive: the token's update lowers that entropy. ``advantages`` is per row (batch,) or per token."""
    lp = logps.detach().float()
    adv = advantages.detach().float()
    adv = adv.unsqueeze(1).expand_as(lp) if adv.dim() == 1 else adv
    return adv * lp.exp() * (lp + entropies.detach().float())


def cov_clip_mask(
    logps: torch.Tensor, entropies: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, share: float
) -> torch.Tensor:
    """The tokens whose advantage the covariance clip drops: a bool tensor shaped like ``logps`` (batch, tokens),
    True for the top ``ceil(share x n)`` of the ``n`` loss tokens (``mask`` > 0) with a positive
    ``sharpening_score``. Tokens with a non-finite score are never chosen (the step guard deals with them). Ties at
    the cut are broken by position, so the count is exact."""
    if logps.dim() != 2 or entropies.shape != logps.shape:
        raise ValueError(
            f"cov_clip_mask: logps and entropies must both be (batch, tokens), got {tuple(logps.shape)} and "
            f"{tuple(entropies.shape)}"
        )
    score = sharpening_score(logps, entropies, advantages)
    positive = (mask > 0) & torch.isfinite(score) & (score > 0)
    chosen = torch.zeros_like(positive)
    n_positive = int(positive.sum())
    k = min(math.ceil(share * n_positive), n_positive) if share > 0 else 0
    if k == 0:
        return chosen
    ranked = torch.where(positive, score, torch.full_like(score, -math.inf)).flatten()
    chosen.view(-1)[torch.topk(ranked, k).indices] = True
    return chosen


@dataclass
class EntropyConfig:
    enabled: bool = True
    baseline_steps: int = 10  # optimizer steps whose mean entropy is the baseline
    floor_ratio: float = 0.8  # floor = floor_ratio x baseline
    window: int = 5  # rolling window (steps) compared with the floor
    ki: float = 0.1  # integral gain: control change per step at a relative gap of 1 (the control is in [0, 1])
    kp: float = 0.4  # proportional gain: control per unit relative gap, on top of the integral
    coef_max: float = 0.01  # entropy bonus at control 1 (TRL's entropy_coef); 0.5 wrecked a real run (docstring)
    cov_clip: float = 0.0  # share of the sharpening tokens whose policy gradient is dropped at control 1; 0: off
    # (off by default: at 1 it cost SmolLM2-135M 0.625 -> 0.420 held-out accuracy, docs/entropy_floor_log.md section 0)
    pg_brake: float = 1.0  # share of every advantage taken off at control 1 (module docstring, lever 2); 0: off
    # Adam's moments follow the brake's factor, floored at this value (module docstring, lever 2b); 0: off. With the
    # brake at 1 they held a forced collapse in 3 seeds of 3, where the brake alone did not, at no measured cost on
    # healthy tiny and SmolLM2-135M runs (docs/entropy_floor_log.md section 0000). Inert with pg_brake 0.
    brake_moments: float = 0.01
    clip_factor: float = 0.5  # epsilon x clip_factor while the floor is active
    hysteresis: float = 1.05  # release when the window mean > floor x hysteresis
    learning_gate: bool = True  # stay off while the training reward still rises (module docstring)
    clip_while_learning: bool = False  # the gate holds off only the bonus and the clip range, not the covariance clip
    # a held-off step sets the control to 0 but keeps the integral, so the controller resumes where it was when the
    # gate lets go (off: the integral restarts at 0, as measured in docs/entropy_floor_log.md section 000)
    keep_integral_while_held: bool = False
    gate_window: int = 10  # steps of reward compared: the last half against the half before
    gate_z: float = 1.0  # "rising": the halves' mean difference above gate_z standard errors
    # the reward the gate reads: a `rewards[].name` (weight 0 allowed: a verifier that only watches); None: the
    # weighted training reward, which a reward that pays for the collapse itself also raises (module docstring)
    gate_reward: str | None = None
    follow_learning: bool = False  # while the gate's reward rises the floor follows entropy down (module docstring)

    def __post_init__(self) -> None:
        problems = []
        if self.baseline_steps < 1:
            problems.append(f"baseline_steps must be >= 1, got {self.baseline_steps}")
        if not 0 < self.floor_ratio <= 1:
            problems.append(f"floor_ratio must be in (0, 1], got {self.floor_ratio}")
        if self.window < 1:
            problems.append(f"window must be >= 1, got {self.window}")
        if not (math.isfinite(self.ki) and self.ki > 0):
            problems.append(f"ki must be finite and > 0, got {self.ki}")
        if not (math.isfinite(self.kp) and self.kp >= 0):
            problems.append(f"kp must be finite and >= 0, got {self.kp}")
        if not (math.isfinite(self.coef_max) and self.coef_max >= 0):
            problems.append(f"coef_max must be finite and >= 0, got {self.coef_max}")
        if not 0 <= self.cov_clip <= 1:
            problems.append(f"cov_clip must be in [0, 1], got {self.cov_clip}")
        if not (isinstance(self.pg_brake, (int, float)) and 0 <= self.pg_brake <= 1):
            problems.append(f"pg_brake must be in [0, 1], got {self.pg_brake!r}")
        elif self.coef_max == 0 and self.cov_clip == 0 and self.pg_brake == 0:
            problems.append(
                "coef_max, cov_clip and pg_brake are all 0: the floor has no lever (set enabled: false instead)"
            )
        if not (isinstance(self.brake_moments, (int, float)) and 0 <= self.brake_moments < 1):
            problems.append(f"brake_moments must be in [0, 1), got {self.brake_moments!r}")
        if self.clip_while_learning and self.cov_clip == 0:
            problems.append(
                "clip_while_learning needs the covariance clip, but cov_clip is 0 (its default): set cov_clip to a "
                "share in (0, 1], or drop clip_while_learning"
            )
        if not 0 < self.clip_factor <= 1:
            problems.append(f"clip_factor must be in (0, 1], got {self.clip_factor}")
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 1):
            problems.append(f"hysteresis must be finite and >= 1, got {self.hysteresis}")
        if self.gate_window < 4:
            problems.append(f"gate_window must be >= 4 (two halves of at least 2 steps), got {self.gate_window}")
        if not (math.isfinite(self.gate_z) and self.gate_z >= 0):
            problems.append(f"gate_z must be finite and >= 0, got {self.gate_z}")
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
    """Entropy floor controller: ``observe(entropy_mean)`` once per optimizer step (after the step's loss).

    ``bonus``, ``cov_share`` and ``clip_scale()`` then apply to the next step.
    """

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
        self.nan_count = 0
        self.activations = 0
        self.at_cap = 0  # steps with the control at 1 while below the floor
        self.warnings = 0
        self.warning: str | None = None  # the warning of the last observe() call, else None
        self._check_ref = math.nan  # window mean at the start of the current falling check
        self._check_steps = 0
        self._rewards: deque[float] = deque(maxlen=c.gate_window)  # per-step training reward means
        self.held_off = 0  # steps with the entropy under the floor while the reward was rising
        self.holding_off = False  # this step's
        self.follows = 0  # steps on which follow_learning lowered the floor
        self.moment_scale = 1.0  # the brake factor Adam's moments follow now (brake_moments; 1: as the gradients)

    @property
    def bonus(self) -> float:
        """Entropy bonus coefficient for TRL's ``entropy_coef``: control x ``coef_max`` (0 until the floor turns on,
        and while the learning gate holds the floor off)."""
        return 0.0 if self.holding_off else self.control * self.config.coef_max

    @property
    def cov_share(self) -> float:
        """Share of the sharpening tokens whose advantage the loss drops: control x ``cov_clip``."""
        return self.control * self.config.cov_clip

    @property
    def pg_scale(self) -> float:
        """Factor on the loss's advantages: ``1 - control x pg_brake`` (exactly 1 with the brake off, until the floor
        turns on, and while the learning gate holds it off)."""
        if self.holding_off or self.config.pg_brake == 0:
            return 1.0
        return 1.0 - self.control * self.config.pg_brake

    def moment_rescale(self) -> float:
        """``brake_moments`` (module docstring, lever 2b): the factor for Adam's ``exp_avg`` (its square for
        ``exp_avg_sq``) that moves the moments from the brake factor they follow to this step's, ``max(pg_scale,
        brake_moments) / moment_scale``; it records the new scale. 1.0 with ``brake_moments`` off. Call once per
        optimizer step, after ``observe``, and apply the factor before the next step's update."""
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
        """The learning gate: the last ``gate_window / 2`` rewards' mean above the mean of the ``gate_window / 2``
        before them by more than ``gate_z`` standard errors of the difference (unbiased variance within each half).
        False with the gate off or fewer than ``gate_window`` rewards."""
        c = self.config
        if not c.learning_gate or len(self._rewards) < c.gate_window:
            return False
        half = c.gate_window // 2
        values = list(self._rewards)
        old, new = values[:half], values[-half:]
        means = [sum(v) / half for v in (old, new)]
        variances = [sum((x - m) ** 2 for x in v) / (half - 1) for v, m in zip((old, new), means, strict=True)]
        difference = means[1] - means[0]
        return difference > 0 and difference > c.gate_z * math.sqrt(sum(variances) / half)

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
            if not c.clip_while_learning:
                self.active, self.control = False, 0.0
                if not c.keep_integral_while_held:
                    self.integral = 0.0
                return None
        activated = c.enabled and not self.active and mean < self.floor
        if activated:
            self.active = True
            self.activations += 1
            self._check_ref, self._check_steps = mean, 0
        elif self.active and (mean > self.floor * c.hysteresis or not c.enabled):
            self.active = False
        if self.active or self.integral > 0:  # runs from the first activation until the integral is back at 0
            gap = (self.floor - mean) / self.floor if self.floor > 0 else 0.0
            self.integral = min(max(self.integral + c.ki * gap, 0.0), 1.0) if c.enabled else 0.0
            self.control = min(max(self.integral + c.kp * gap, 0.0), 1.0) if c.enabled else 0.0
            if self.control >= 1.0 and mean < self.floor:
                self.at_cap += 1
        if self.active:
            if not activated:  # the falling check: every `window` steps after activation
                self._check_steps += 1
                if self._check_steps >= c.window:
                    if mean < self._check_ref:
                        self.warnings += 1
                        self.warning = (
                            f"entropy floor active and the window entropy still fell over {c.window} steps "
                            f"({self._check_ref:.4g} -> {mean:.4g}, floor {self.floor:.4g}, "
                            f"control {self.control:.4g}): it is not holding it yet; raise guards.quatro.entropy.ki "
                            "(faster), pg_brake, cov_clip or coef_max (if the control sits at 1), or raise "
                            "trainer.beta to pull "
                            "the policy back to the reference "
                            '(docs/DESIGN.md, "QUATRO: entropy floor")'
                        )
                    self._check_ref, self._check_steps = mean, 0
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
            "baseline": self.baseline,
            "floor": self.floor,
            "active": self.active,
            "control": self.control,
            "integral": self.integral,
            "at_cap": self.at_cap,
            "steps": self.steps,
            "nan_count": self.nan_count,
            "activations": self.activations,
            "warnings": self.warnings,
            "check_ref": self._check_ref,
            "check_steps": self._check_steps,
            "rewards": list(self._rewards),
            "held_off": self.held_off,
            "holding_off": self.holding_off,
            "follows": self.follows,
            "moment_scale": self.moment_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window = deque((float(v) for v in state["window"]), maxlen=self.config.window)
        self._baseline_values = [float(v) for v in state["baseline_values"]]
        self.baseline = None if state["baseline"] is None else float(state["baseline"])
        self.floor = None if state["floor"] is None else float(state["floor"])
        self.active = bool(state["active"])
        cap = self.config.coef_max
        if "control" in state:
            self.control, self.integral = float(state["control"]), float(state["integral"])
        elif "coef" in state:  # version 2: the bonus and its integral in entropy_coef units, capped at coef_max
            self.control = min(float(state["coef"]) / cap, 1.0) if cap > 0 else 0.0
            self.integral = min(float(state["integral"]) / cap, 1.0) if cap > 0 else 0.0
        else:  # version 1: an integer ramp level of 0.001 per step (the old default ramp)
            self.control = self.integral = min(int(state["level"]) * 0.001 / cap, 1.0) if cap > 0 else 0.0
        self.at_cap = int(state.get("at_cap", 0))
        self.steps = int(state["steps"])
        self.nan_count = int(state["nan_count"])
        self.activations = int(state["activations"])
        self.warnings = int(state["warnings"])
        self._check_ref = float(state["check_ref"])
        self._check_steps = int(state["check_steps"])
        self._rewards = deque((float(v) for v in state.get("rewards", [])), maxlen=self.config.gate_window)
        self.held_off = int(state.get("held_off", 0))  # absent in checkpoints from before the learning gate
        self.holding_off = bool(state.get("holding_off", False))
        self.follows = int(state.get("follows", 0))  # absent before follow_learning
        self.moment_scale = float(state.get("moment_scale", 1.0))  # absent before brake_moments
        self.warning = None
