"""QUATRO loop layer (seed 000 §4.1, §5.2, §6.2, §6.4; seed 003 §3.3, §5.1): the pure, trainer-independent parts.

QUATRO breaks the "bad policy -> bad rollouts -> worse policy" loop. Four pieces, the seeds' numbers as defaults:

1. ``AdaptiveKL``: every ``update_every`` optimizer steps the mean per-token KL to the reference is compared with
   ``target`` (0.02): above -> beta x 1.2, below -> beta x 0.8, equal -> unchanged, clamped to
   [``beta_min``, ``beta_max``]. ``factor = beta / beta0`` is one multiplicative factor of the trainer's KL
   coefficient; GRADE's KL compensation is another, so the effective coefficient is
   ``trainer.beta x factor x grade_compensation`` (``steadyrl.trainers.trl_state.set_beta_factor``). The clamp
   bounds the controller's own beta only, so the effective value can leave [beta_min, beta_max] by GRADE's factor
   (<= 2).
2. ``EntropyFloor``: baseline = mean token entropy of the first ``baseline_steps`` (10) optimizer steps,
   floor = ``floor_ratio`` (0.8) x baseline, compared with the mean of a rolling ``window`` (20 steps). Below the
   floor the floor turns active; it releases when the window mean is above floor x ``hysteresis``. While active the
   entropy bonus coefficient ramps up by ``coef_delta`` per step to ``coef_max`` and ``clip_scale()`` is
   ``clip_factor`` (0.5; the trainer multiplies PPO's epsilon by it); inactive, the bonus ramps down to 0 and the
   clip scale is 1. If the window mean still fell over ``window`` active steps, ``observe`` returns a warning that
   suggests a smaller KL target (seed 000 §6.2).
3. ``RolloutFilter``: drops rollouts before advantages (reward z-score, length, parrot, repetition, near-duplicate,
   zero-variance group), see ``FILTER_REASONS``; ``masked_group_advantages`` computes advantages without them.
4. ``ReplayBuffer``: keeps the rows with a learning signal of the last ``capacity`` (8) scored micro-batches, and
   replaces ``replay_ratio`` (0.3) of each fresh micro-batch with rows drawn from it, padded to a common width.

TRL's entropy term, which the trainer reuses instead of adding a second one (TRL 1.16, ``GRPOTrainer._compute_loss``):
with ``H`` the per-token Shannon entropy in nats of ``softmax(logits / temperature)`` (gradient flows through it) and
``m`` the completion mask (times the high-entropy mask when ``top_entropy_quantile < 1``),
``entropy_loss = sum(H * m) / max(sum(m), 1) / gradient_accumulation_steps`` (a per-micro-batch token mean, the same
for every ``loss_type``) and ``loss = loss - self.entropy_coef * entropy_loss``: a positive coefficient is a bonus
that raises entropy. The term is only added when ``self._entropy_bonus_enabled``, which TRL fixes at init
(``args.entropy_coef != 0 or args.use_adaptive_entropy``); with ``use_adaptive_entropy`` TRL's own controller
rewrites ``entropy_coef`` every step. ``EntropyFloor.bonus`` is a coefficient in exactly these units.

Nothing here knows about processes. The caller passes values that are identical on all ranks (KL and entropy
reduced over ranks, rewards and token ids gathered over ranks for the filters), so every rank decides the same.
The replay buffer is per rank (each rank replays its own micro-batches; seed it with ``seed + rank`` and save it per
rank).

What this simplifies or leaves out:

- KL and entropy controllers count ``observe`` calls (optimizer steps); a NaN observation is ignored and counted
  (KL: the step still counts towards ``update_every``; entropy: the step is skipped entirely). A KL window with no
  finite value leaves beta unchanged.
- Filters work on token ids (tokenizer-agnostic); n-gram sizes are therefore in tokens: with a byte-level tokenizer,
  raise ``n`` (ordinary English text already repeats many byte trigrams). N-grams are Python tuples in sets: one
  call takes about 0.4 s for 512 completions of 1024 tokens on one CPU core (0.9 s with near-duplicates on).
- The z-score filter uses the batch's unbiased std; with N scorable rewards no |z| can exceed (N - 1) / sqrt(N), so
  3.5 can only fire from N >= 15. It is skipped when the batch's finite rewards take fewer than ``min_distinct``
  (3) values: with pass/fail rewards a rare success is the signal, not an outlier (seed: |z| > 3.5 without this).
- Replay needs the sampling policy's log-probs of every row (``old_per_token_logps``); it supports text batches
  (the keys in ``REPLAY_ROW_KEYS``), not multimodal ones, and passes ``num_items_in_batch`` through unchanged.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from steadyrl.metrics import (
    QUATRO_ENTROPY,
    QUATRO_ENTROPY_BONUS,
    QUATRO_ENTROPY_FLOOR,
    QUATRO_FILTERED_SHARE,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_KL_COEF,
    QUATRO_KL_FACTOR,
    QUATRO_KL_MEAN,
    QUATRO_KL_NAN,
    QUATRO_KL_TARGET,
    QUATRO_REPLAY_AGE_MEAN,
    QUATRO_REPLAY_FRAC,
    QUATRO_ZERO_VARIANCE_GROUPS,
    quatro_filtered,
)

NAN = float("nan")


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


# ------------------------------------------------------------------------------------------------ adaptive KL


@dataclass
class KLConfig:
    enabled: bool = True
    target: float = 0.02  # mean per-token KL to the reference (seed 000 §4.1)
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
        self.last_mean = NAN  # window mean of the last update
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


# ---------------------------------------------------------------------------------------------- entropy floor


@dataclass
class EntropyConfig:
    enabled: bool = True
    baseline_steps: int = 10  # optimizer steps whose mean entropy is the baseline (seed 000 §4.1)
    floor_ratio: float = 0.8  # floor = floor_ratio x baseline
    window: int = 20  # rolling window (steps) compared with the floor
    coef_delta: float = 0.001  # bonus ramp per step, in TRL's entropy_coef units
    coef_max: float = 0.01
    clip_factor: float = 0.5  # epsilon x clip_factor while the floor is active
    hysteresis: float = 1.05  # release when the window mean > floor x hysteresis

    def __post_init__(self) -> None:
        problems = []
        if self.baseline_steps < 1:
            problems.append(f"baseline_steps must be >= 1, got {self.baseline_steps}")
        if not 0 < self.floor_ratio <= 1:
            problems.append(f"floor_ratio must be in (0, 1], got {self.floor_ratio}")
        if self.window < 1:
            problems.append(f"window must be >= 1, got {self.window}")
        if not (math.isfinite(self.coef_delta) and self.coef_delta > 0):
            problems.append(f"coef_delta must be finite and > 0, got {self.coef_delta}")
        if not (math.isfinite(self.coef_max) and self.coef_max >= 0):
            problems.append(f"coef_max must be finite and >= 0, got {self.coef_max}")
        if not 0 < self.clip_factor <= 1:
            problems.append(f"clip_factor must be in (0, 1], got {self.clip_factor}")
        if not (math.isfinite(self.hysteresis) and self.hysteresis >= 1):
            problems.append(f"hysteresis must be finite and >= 1, got {self.hysteresis}")
        if problems:
            raise ValueError("invalid EntropyConfig: " + "; ".join(problems))


class EntropyFloor:
    """Entropy floor controller: ``observe(entropy_mean)`` once per optimizer step (after the step's loss).

    ``bonus`` and ``clip_scale()`` then apply to the next step. The bonus is ``level x coef_delta`` (capped at
    ``coef_max``) with an integer ``level``, so its values are exact multiples of ``coef_delta``.
    """

    def __init__(self, config: EntropyConfig | None = None) -> None:
        self.config = config or EntropyConfig()
        c = self.config
        self._max_level = math.ceil(c.coef_max / c.coef_delta - 1e-9)
        self._window: deque[float] = deque(maxlen=c.window)
        self._baseline_values: list[float] = []
        self.baseline: float | None = None
        self.floor: float | None = None
        self.active = False
        self.level = 0
        self.steps = 0  # finite observations
        self.nan_count = 0
        self.activations = 0
        self.warnings = 0
        self.warning: str | None = None  # the warning of the last observe() call, else None
        self._check_ref = NAN  # window mean at the start of the current falling check
        self._check_steps = 0

    @property
    def bonus(self) -> float:
        """Entropy bonus coefficient for TRL's ``entropy_coef`` (0 when inactive and fully ramped down)."""
        return min(self.level * self.config.coef_delta, self.config.coef_max)

    def window_mean(self) -> float:
        return sum(self._window) / len(self._window) if self._window else NAN

    def clip_scale(self) -> float:
        """Factor for PPO's clip epsilon: ``clip_factor`` while the floor is active, else 1."""
        return self.config.clip_factor if self.active else 1.0

    def observe(self, entropy_mean: float) -> str | None:
        """Record one optimizer step's mean token entropy (reduced over ranks); returns a warning or None."""
        self.warning = None
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
        activated = c.enabled and not self.active and mean < self.floor
        if activated:
            self.active = True
            self.activations += 1
            self._check_ref, self._check_steps = mean, 0
        elif self.active and (mean > self.floor * c.hysteresis or not c.enabled):
            self.active = False
        if self.active:
            self.level = min(self.level + 1, self._max_level)
            if not activated:  # the falling check: every `window` steps after activation
                self._check_steps += 1
                if self._check_steps >= c.window:
                    if mean < self._check_ref:
                        self.warnings += 1
                        self.warning = (
                            f"entropy floor active and the window entropy still fell over {c.window} steps "
                            f"({self._check_ref:.4g} -> {mean:.4g}, floor {self.floor:.4g}, bonus {self.bonus:.4g}): "
                            "the bonus is not holding it; set a smaller guards.quatro.kl.target (e.g. halve it) to "
                            "pull the policy back to the reference, or raise guards.quatro.entropy.coef_max "
                            "(seed 000 §6.2)"
                        )
                    self._check_ref, self._check_steps = mean, 0
        else:
            self.level = max(self.level - 1, 0)
        return self.warning

    def metrics(self) -> dict[str, float]:
        """``quatro/entropy``: the rolling window mean (what the floor is compared with); floor NaN until set."""
        return {
            QUATRO_ENTROPY: self.window_mean(),
            QUATRO_ENTROPY_FLOOR: self.floor if self.floor is not None else NAN,
            QUATRO_ENTROPY_BONUS: self.bonus,
            QUATRO_FLOOR_ACTIVE: 1.0 if self.active else 0.0,
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "window": list(self._window),
            "baseline_values": list(self._baseline_values),
            "baseline": self.baseline,
            "floor": self.floor,
            "active": self.active,
            "level": self.level,
            "steps": self.steps,
            "nan_count": self.nan_count,
            "activations": self.activations,
            "warnings": self.warnings,
            "check_ref": self._check_ref,
            "check_steps": self._check_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._window = deque((float(v) for v in state["window"]), maxlen=self.config.window)
        self._baseline_values = [float(v) for v in state["baseline_values"]]
        self.baseline = None if state["baseline"] is None else float(state["baseline"])
        self.floor = None if state["floor"] is None else float(state["floor"])
        self.active = bool(state["active"])
        self.level = min(int(state["level"]), self._max_level)
        self.steps = int(state["steps"])
        self.nan_count = int(state["nan_count"])
        self.activations = int(state["activations"])
        self.warnings = int(state["warnings"])
        self._check_ref = float(state["check_ref"])
        self._check_steps = int(state["check_steps"])
        self.warning = None


# ---------------------------------------------------------------------------------------------------- filters

# A dropped row is counted under the first of these that dropped it (the order the filters run in).
FILTER_REASONS = ("zscore", "length", "parrot", "repetition", "near_duplicate", "zero_variance")


@dataclass
class ZScoreConfig:
    enabled: bool = True
    max_abs_z: float = 3.5  # |r - mean| / std over the whole generation batch (seed 000 §4.1)
    min_distinct: int = 3  # skip the filter when the finite rewards take fewer distinct values (pass/fail rewards)


@dataclass
class LengthConfig:
    enabled: bool = True
    min_tokens: int = 0
    max_tokens: int | None = None
    rolling: bool = True  # also drop lengths outside the rolling [percentile_low, percentile_high] of recent ones
    percentile_low: float = 1.0
    percentile_high: float = 99.0
    history: int = 2048  # completion lengths remembered
    min_history: int = 256  # the rolling range applies once the history holds this many


@dataclass
class ParrotConfig:
    enabled: bool = True
    n: int = 4
    max_overlap: float = 0.8  # share of the completion's n-grams that occur in its prompt


@dataclass
class RepetitionConfig:
    enabled: bool = True
    n: int = 3
    max_repeat_share: float = 0.5  # share of the completion's n-grams that repeat an earlier one in it


@dataclass
class NearDuplicateConfig:
    enabled: bool = False  # off by default: see RolloutFilter's docstring
    n: int = 3
    max_jaccard: float = 0.9  # n-gram-set Jaccard similarity to an earlier kept member of the group


@dataclass
class ZeroVarianceConfig:
    enabled: bool = True  # drop groups without a learning signal (DAPO dynamic sampling, seed 003 §5.1)


@dataclass
class FilterConfig:
    zscore: ZScoreConfig = field(default_factory=ZScoreConfig)
    length: LengthConfig = field(default_factory=LengthConfig)
    parrot: ParrotConfig = field(default_factory=ParrotConfig)
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    near_duplicate: NearDuplicateConfig = field(default_factory=NearDuplicateConfig)
    zero_variance: ZeroVarianceConfig = field(default_factory=ZeroVarianceConfig)
    max_drop_share: float = 0.5  # dropping more than this share of a batch comes with a warning

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.zscore.max_abs_z) and self.zscore.max_abs_z > 0):
            problems.append(f"zscore.max_abs_z must be finite and > 0, got {self.zscore.max_abs_z}")
        if self.zscore.min_distinct < 1:
            problems.append(f"zscore.min_distinct must be >= 1, got {self.zscore.min_distinct}")
        ln = self.length
        if ln.min_tokens < 0:
            problems.append(f"length.min_tokens must be >= 0, got {ln.min_tokens}")
        if ln.max_tokens is not None and ln.max_tokens < ln.min_tokens:
            problems.append(f"length.max_tokens={ln.max_tokens} must be >= length.min_tokens={ln.min_tokens}")
        if not 0 <= ln.percentile_low < ln.percentile_high <= 100:
            problems.append(
                f"need 0 <= length.percentile_low < length.percentile_high <= 100, got {ln.percentile_low}, "
                f"{ln.percentile_high}"
            )
        if not 1 <= ln.min_history <= ln.history:
            problems.append(f"length.min_history must be in [1, length.history={ln.history}], got {ln.min_history}")
        for name in ("parrot", "repetition", "near_duplicate"):
            if getattr(self, name).n < 1:
                problems.append(f"{name}.n must be >= 1, got {getattr(self, name).n}")
        for name, value in (
            ("parrot.max_overlap", self.parrot.max_overlap),
            ("repetition.max_repeat_share", self.repetition.max_repeat_share),
            ("near_duplicate.max_jaccard", self.near_duplicate.max_jaccard),
            ("max_drop_share", self.max_drop_share),
        ):
            if not 0 <= value <= 1:
                problems.append(f"{name} must be in [0, 1], got {value}")
        if problems:
            raise ValueError("invalid FilterConfig: " + "; ".join(problems))


def ngrams(ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """The n-grams of ``ids`` at every position (len(ids) - n + 1 of them; none when shorter than n)."""
    return [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]


def parrot_share(prompt: Sequence[int], completion: Sequence[int], n: int) -> float:
    """Share of the completion's n-gram positions whose n-gram also occurs in the prompt; 0 without n-grams."""
    grams = ngrams(completion, n)
    if not grams:
        return 0.0
    seen = set(ngrams(prompt, n))
    return sum(g in seen for g in grams) / len(grams)


def repeat_share(completion: Sequence[int], n: int) -> float:
    """1 - distinct / total n-grams of the completion: the share of n-grams that repeat an earlier one."""
    grams = ngrams(completion, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def _gram_set(ids: Sequence[int], n: int) -> set[tuple[int, ...]]:
    """The n-gram set; a sequence shorter than n is one gram (itself), so identical short sequences match."""
    return set(ngrams(ids, n)) if len(ids) >= n else {tuple(ids)}


def jaccard(a: set[tuple[int, ...]], b: set[tuple[int, ...]]) -> float:
    """|a & b| / |a | b|; 1.0 for two empty sets."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0


@dataclass
class FilterResult:
    keep: torch.Tensor  # (N,) bool, on the rewards' device
    reasons: dict[str, int]  # dropped rows per reason, every name of FILTER_REASONS, in that order
    zero_variance_groups: torch.Tensor  # (N // G,) bool: groups whose kept, finite rewards carry no signal
    warning: str | None = None

    def metrics(self) -> dict[str, float]:
        n = self.keep.numel()
        out = {quatro_filtered(reason): float(count) for reason, count in self.reasons.items()}
        out[QUATRO_FILTERED_SHARE] = (n - int(self.keep.sum())) / n if n else 0.0
        out[QUATRO_ZERO_VARIANCE_GROUPS] = float(self.zero_variance_groups.sum())
        return out


class RolloutFilter:
    """Rollout quality filters: ``filt(rewards, prompt_ids, completion_ids, num_generations) -> FilterResult``.

    Inputs cover the whole generation batch, gathered over ranks: rewards (N,) with NaN = unscorable, and N token-id
    lists without padding; groups are consecutive runs of ``num_generations`` rows. The filters run in the order of
    ``FILTER_REASONS``; the first four judge each row on its own, the last two look at the rows still kept:

    - zscore: |r - mean| / std > ``max_abs_z`` over the finite rewards of the batch (unbiased std; skipped when
      std == 0, fewer than 2 or fewer than ``min_distinct`` distinct finite values). NaN rewards never drop.
    - length: fewer than ``min_tokens`` or more than ``max_tokens`` tokens, or (``rolling``, once the history holds
      ``min_history`` lengths) outside [p_low, p_high] of the last ``history`` lengths, computed from the history
      before this batch (linear interpolation), so a batch never sets its own range. Every row's length then
      enters the history, dropped or not.
    - parrot: ``parrot_share(prompt, completion, n) > max_overlap``.
    - repetition: ``repeat_share(completion, n) > max_repeat_share``.
    - near_duplicate: within a group, a row whose n-gram-set Jaccard similarity to an earlier kept row is above
      ``max_jaccard`` is dropped, so the first of each cluster stays. Off by default: when a task has one short right
      answer, the right completions are exact duplicates and this would leave one of them per group, turning
      "most samples were right" into "one was" (it changes GRPO's estimate, not only its noise).
    - zero_variance: a group whose kept rows have fewer than 2 finite rewards, or all-equal ones, has no learning
      signal (zero advantage for every row); its kept rows are dropped so they leave the loss normaliser too (DAPO
      dynamic sampling). ``zero_variance_groups`` flags these groups even when this filter is off.

    Dropping more than ``max_drop_share`` of the batch still drops, with ``warning`` set.
    """

    def __init__(self, config: FilterConfig | None = None) -> None:
        self.config = config or FilterConfig()
        self._lengths: deque[int] = deque(maxlen=self.config.length.history)
        self.calls = 0
        self.dropped = dict.fromkeys(FILTER_REASONS, 0)  # totals over all calls

    def length_range(self) -> tuple[float, float] | None:
        """The rolling [p_low, p_high] of the remembered lengths, or None before ``min_history`` of them."""
        ln = self.config.length
        if not ln.rolling or len(self._lengths) < ln.min_history:
            return None
        history = torch.tensor(list(self._lengths), dtype=torch.float64)
        q = torch.tensor([ln.percentile_low / 100.0, ln.percentile_high / 100.0], dtype=torch.float64)
        low, high = torch.quantile(history, q, interpolation="linear").tolist()
        return low, high

    def __call__(
        self,
        rewards: torch.Tensor,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        num_generations: int,
    ) -> FilterResult:
        if rewards.ndim != 1:
            raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
        n_rows = rewards.shape[0]
        if len(prompt_ids) != n_rows or len(completion_ids) != n_rows:
            raise ValueError(
                f"got {len(prompt_ids)} prompts and {len(completion_ids)} completions for {n_rows} rewards; "
                "need one of each per row"
            )
        if num_generations < 1 or n_rows % num_generations:
            raise ValueError(f"num_generations={num_generations} does not divide the batch of {n_rows}")
        cfg = self.config
        prompts = [_as_list(p) for p in prompt_ids]
        completions = [_as_list(c) for c in completion_ids]
        r = rewards.detach().to(device="cpu", dtype=torch.float64)
        finite = torch.isfinite(r)
        reason: list[str | None] = [None] * n_rows

        def mark(hits: Sequence[bool], name: str) -> None:
            for i, hit in enumerate(hits):
                if hit and reason[i] is None:
                    reason[i] = name

        if cfg.zscore.enabled:
            mark(self._zscore_hits(r, finite), "zscore")
        lengths = [len(c) for c in completions]
        if cfg.length.enabled:
            ln = cfg.length
            bounds = self.length_range()
            mark(
                [
                    n < ln.min_tokens
                    or (ln.max_tokens is not None and n > ln.max_tokens)
                    or (bounds is not None and not bounds[0] <= n <= bounds[1])
                    for n in lengths
                ],
                "length",
            )
        if cfg.parrot.enabled:
            p = cfg.parrot
            mark([parrot_share(a, b, p.n) > p.max_overlap for a, b in zip(prompts, completions, strict=True)], "parrot")
        if cfg.repetition.enabled:
            rep = cfg.repetition
            mark([repeat_share(c, rep.n) > rep.max_repeat_share for c in completions], "repetition")
        if cfg.near_duplicate.enabled:
            mark(self._near_duplicate_hits(completions, reason, num_generations), "near_duplicate")

        values = r.tolist()
        num_groups = n_rows // num_generations
        no_signal = [False] * num_groups
        for g in range(num_groups):
            rows = range(g * num_generations, (g + 1) * num_generations)
            kept = [values[i] for i in rows if reason[i] is None and math.isfinite(values[i])]
            no_signal[g] = len(kept) < 2 or max(kept) == min(kept)
        if cfg.zero_variance.enabled:
            mark([no_signal[i // num_generations] for i in range(n_rows)], "zero_variance")

        self._lengths.extend(lengths)
        self.calls += 1
        counts = {name: sum(x == name for x in reason) for name in FILTER_REASONS}
        for name, count in counts.items():
            self.dropped[name] += count
        n_dropped = sum(counts.values())
        warning = None
        if n_rows and n_dropped / n_rows > cfg.max_drop_share:
            detail = ", ".join(f"{name} {count}" for name, count in counts.items() if count)
            warning = (
                f"the rollout filters dropped {n_dropped} of {n_rows} rollouts ({n_dropped / n_rows:.0%} > "
                f"guards.quatro.filters.max_drop_share={cfg.max_drop_share}): {detail}. Check the rewards and the "
                "filter thresholds (guards.quatro.filters.<filter>), or turn the busiest filter off"
            )
        keep = torch.tensor([x is None for x in reason], dtype=torch.bool, device=rewards.device)
        groups = torch.tensor(no_signal, dtype=torch.bool, device=rewards.device)
        return FilterResult(keep, counts, groups, warning)

    def _zscore_hits(self, r: torch.Tensor, finite: torch.Tensor) -> list[bool]:
        zc = self.config.zscore
        values = r[finite]
        if values.numel() < 2 or torch.unique(values).numel() < zc.min_distinct:
            return [False] * r.numel()
        std = values.std().item()
        if not std > 0:
            return [False] * r.numel()
        z = (r - values.mean()) / std
        return (finite & (z.abs() > zc.max_abs_z)).tolist()

    def _near_duplicate_hits(
        self, completions: list[list[int]], reason: list[str | None], num_generations: int
    ) -> list[bool]:
        nd = self.config.near_duplicate
        hits = [False] * len(completions)
        for start in range(0, len(completions), num_generations):
            representatives: list[set[tuple[int, ...]]] = []
            for i in range(start, start + num_generations):
                if reason[i] is not None:
                    continue
                grams = _gram_set(completions[i], nd.n)
                if any(jaccard(grams, rep) > nd.max_jaccard for rep in representatives):
                    hits[i] = True
                else:
                    representatives.append(grams)
        return hits

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "lengths": list(self._lengths), "calls": self.calls, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._lengths = deque((int(v) for v in state["lengths"]), maxlen=self.config.length.history)
        self.calls = int(state["calls"])
        self.dropped = {name: int(state["dropped"].get(name, 0)) for name in FILTER_REASONS}


def _as_list(ids: Sequence[int] | torch.Tensor) -> list[int]:
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def masked_group_advantages(
    rewards: torch.Tensor,
    keep: torch.Tensor,
    num_generations: int,
    advantage_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Group advantages without the dropped rows. rewards, keep: (N,) -> advantages (N,), rewards' float dtype.

    Dropped rows are set to NaN before ``advantage_fn`` ((num_prompts, G) -> same shape, NaN = unscorable), so they
    leave their group's statistics; they get exactly 0. A group with fewer than 2 kept rows with a finite reward
    gets 0 on every row.
    """
    if rewards.ndim != 1 or keep.shape != rewards.shape:
        raise ValueError(f"rewards and keep must both have shape (N,), got {tuple(rewards.shape)}, {tuple(keep.shape)}")
    n_rows = rewards.shape[0]
    if num_generations < 1 or n_rows % num_generations:
        raise ValueError(f"num_generations={num_generations} does not divide the batch of {n_rows}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    keep = keep.to(device=r.device, dtype=torch.bool)
    masked = torch.where(keep, r, torch.full_like(r, NAN))
    advantages = advantage_fn(masked.reshape(-1, num_generations)).reshape(n_rows).to(r.dtype)
    members = (keep & torch.isfinite(r)).view(-1, num_generations).sum(dim=1, keepdim=True)
    signal = (members >= 2).expand(-1, num_generations).reshape(n_rows) & keep
    return torch.where(signal, advantages, torch.zeros_like(advantages))


# ----------------------------------------------------------------------------------------------------- replay

# Per-row keys a replayed batch may hold, with (side, pad value); None = the tokenizer's pad id. "prompt" keys are
# left-padded like TRL's prompts; "completion" keys right-padded like its completions when they are token-aligned
# (2-D with the completion width); other shapes (advantages (B,), importance_sampling_ratio (B, 1)) are per row.
# Known gap: a sequence-level (B, 1) ratio in a batch whose completions are 1 token wide looks token-aligned.
REPLAY_ROW_KEYS: dict[str, tuple[str, float | None]] = {
    "prompt_ids": ("prompt", None),
    "prompt_mask": ("prompt", 0),
    "completion_ids": ("completion", None),
    "completion_mask": ("completion", 0),
    "advantages": ("completion", 0.0),
    "old_per_token_logps": ("completion", 0.0),
    "ref_per_token_logps": ("completion", 0.0),
    "sampling_per_token_logps": ("completion", 0.0),
    "importance_sampling_ratio": ("completion", 1.0),
    "tool_mask": ("completion", 1),
    "old_values": ("completion", 0.0),  # PPO: the critic's values at sampling time (B, T)
    "returns": ("completion", 0.0),  # PPO: GAE returns (B, T)
}
REPLAY_REQUIRED_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "completion_ids",
    "completion_mask",
    "advantages",
    "old_per_token_logps",
)
REPLAY_PASS_THROUGH_KEYS = ("num_items_in_batch",)  # batch-level values, taken from the fresh batch unchanged
LOGPROB_KEYS = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")  # finite on stored rows


@dataclass
class ReplayConfig:
    enabled: bool = True
    capacity: int = 8  # micro-batches remembered, FIFO (seed 000 §4.1)
    replay_ratio: float = 0.3  # share of each micro-batch replaced by replayed rows
    min_abs_advantage: float = 1e-6  # rows with a smaller |advantage| carry no learning signal and are not stored

    def __post_init__(self) -> None:
        problems = []
        if self.capacity < 1:
            problems.append(f"capacity must be >= 1, got {self.capacity}")
        if not 0 <= self.replay_ratio < 1:
            problems.append(f"replay_ratio must be in [0, 1), got {self.replay_ratio}")
        if not (math.isfinite(self.min_abs_advantage) and self.min_abs_advantage >= 0):
            problems.append(f"min_abs_advantage must be finite and >= 0, got {self.min_abs_advantage}")
        if problems:
            raise ValueError("invalid ReplayConfig: " + "; ".join(problems))

    def rows_per_batch(self, batch_size: int) -> int:
        """Rows replayed in a micro-batch of ``batch_size`` once the buffer is warm: round_half_up(ratio x B)."""
        return _round_half_up(self.replay_ratio * batch_size)


@dataclass
class ReplayInfo:
    replay_frac: float  # replayed rows / batch rows
    replay_age_mean: float  # mean of (step - the step a replayed row was sampled at); 0.0 when nothing replayed
    indices: list[int]  # rows of the returned batch that were replayed, ascending
    ages: list[int]  # age of each of those rows, same order

    def metrics(self) -> dict[str, float]:
        return {QUATRO_REPLAY_FRAC: self.replay_frac, QUATRO_REPLAY_AGE_MEAN: self.replay_age_mean}

    def mask(self, batch_size: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(batch_size,) bool, True on replayed rows."""
        out = torch.zeros(batch_size, dtype=torch.bool, device=device)
        out[self.indices] = True
        return out


def _row_signal(batch: dict[str, Any], i: int) -> float:
    """|advantage| of row i: the scalar, or for per-token advantages (PPO's GAE, (B, T)) the mean |advantage| over
    its loss tokens (completion mask, times the tool mask when there is one); 0.0 without loss tokens.

    The mean, not the largest token: a row's share of the policy gradient grows with all its tokens' advantages, and
    one large token (e.g. the last, where the sequence reward lands) should not make an otherwise flat row look
    like the strongest signal. A row without signal still has mean 0, so ``min_abs_advantage`` keeps its meaning.
    """
    adv = batch["advantages"][i]
    if adv.ndim == 0:
        return abs(float(adv))
    mask = batch["completion_mask"][i].to(adv.dtype)
    if batch.get("tool_mask") is not None:
        mask = mask * batch["tool_mask"][i].to(adv.dtype)
    tokens = float(mask.sum())
    return float((adv.abs() * mask).sum()) / tokens if tokens > 0 else 0.0


class ReplayBuffer:
    """Rollout replay: ``add(micro_batch, step)`` after scoring, ``mix(micro_batch, step)`` before training.

    What is stored: the rows of a scored micro-batch with a learning signal, |advantage| > ``min_abs_advantage``
    and at least one unmasked completion token. Rows of zero-variance groups (advantage 0) and rows the filters
    dropped (mask 0, advantage 0) contribute no policy gradient, so replaying them would only displace fresh rows.
    Rows with a non-finite log-prob on an unmasked token (``LOGPROB_KEYS``: a policy that went NaN) are not stored
    either: each replay would turn a later loss NaN, long after the step that caused it was skipped or rolled back.
    Each row keeps its tensors (``REPLAY_ROW_KEYS``: ids, masks, advantage, the sampling policy's
    ``old_per_token_logps``, which are required, ``ref_per_token_logps`` when present; under PPO also its (B, T)
    token advantages, ``old_values`` and ``returns``, all right-padded like the completion) trimmed to its own length,
    on the CPU, and the step it was sampled at. A replayed row's importance ratio is exp(current - its own old
    log-probs). The buffer is FIFO by micro-batch: the last ``capacity`` calls of ``add``, a call with no signal
    row included (so no row is older than ``capacity`` micro-batches).

    ``mix`` replaces k = round_half_up(``replay_ratio`` x B) rows (at most the rows stored) of the fresh micro-batch
    with rows drawn uniformly without replacement from the buffer by a seeded ``torch.Generator``. The fresh rows
    replaced are the k with the smallest |advantage| (ties: lower index first): they carry the least gradient, so
    replay displaces as little fresh signal as possible. Replayed rows take the freed positions in draw order. The
    batch keeps B rows; prompt tensors are left-padded and completion tensors right-padded to a common width (ids
    with ``pad_token_id``, masks 0, log-probs 0, ratios and tool masks 1), as TRL pads them. Call ``mix`` with the
    fresh batch before ``add``-ing that same fresh batch, so a batch never replays itself.
    """

    def __init__(self, config: ReplayConfig | None = None, seed: int = 0, pad_token_id: int = 0) -> None:
        self.config = config or ReplayConfig()
        self.seed = seed
        self.pad_token_id = pad_token_id
        self._entries: deque[tuple[int, list[dict[str, torch.Tensor]]]] = deque(maxlen=self.config.capacity)
        self._generator = torch.Generator().manual_seed(seed)
        self.added_rows = 0
        self.replayed_rows = 0

    def __len__(self) -> int:
        """Rows stored."""
        return sum(len(rows) for _, rows in self._entries)

    @property
    def num_batches(self) -> int:
        return len(self._entries)

    def _check_keys(self, batch: dict[str, Any]) -> list[str]:
        """The per-row keys of ``batch`` (in REPLAY_ROW_KEYS order); raises on a missing or unknown key."""
        missing = [k for k in REPLAY_REQUIRED_KEYS if batch.get(k) is None]
        if missing:
            hint = (
                " (the sampling policy's log-probs: the trainer must compute them for every batch when replay is on, "
                "TRL skips them when it thinks the data is on-policy)"
                if "old_per_token_logps" in missing
                else ""
            )
            raise ValueError(f"replay needs the batch keys {missing}{hint}")
        unknown = [k for k in batch if k not in REPLAY_ROW_KEYS and k not in REPLAY_PASS_THROUGH_KEYS]
        if unknown:
            raise ValueError(
                f"replay does not know how to pad the batch keys {unknown} (it supports text batches with "
                f"{sorted(REPLAY_ROW_KEYS)}); set guards.quatro.replay.enabled=false"
            )
        return [k for k in REPLAY_ROW_KEYS if k in batch and batch[k] is not None]

    @staticmethod
    def _token_aligned(batch: dict[str, Any], key: str) -> bool:
        side = REPLAY_ROW_KEYS[key][0]
        width = batch["prompt_ids" if side == "prompt" else "completion_ids"].shape[1]
        value = batch[key]
        return side == "prompt" or (value.ndim == 2 and value.shape[1] == width)

    def add(self, batch: dict[str, Any], step: int) -> int:
        """Store the signal rows of one scored micro-batch sampled at optimizer step ``step``; returns how many."""
        if not self.config.enabled:
            return 0
        keys = self._check_keys(batch)
        rows: list[dict[str, torch.Tensor]] = []
        prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_mask"]
        aligned = {k: self._token_aligned(batch, k) for k in keys}
        for i in range(batch["completion_ids"].shape[0]):
            tokens = torch.nonzero(completion_mask[i]).flatten()
            if tokens.numel() == 0 or not _row_signal(batch, i) > self.config.min_abs_advantage:
                continue
            end = int(tokens[-1]) + 1
            live = completion_mask[i, :end].bool()
            if not all(bool(torch.isfinite(batch[k][i, :end][live]).all()) for k in LOGPROB_KEYS if k in keys):
                continue
            prompt_tokens = torch.nonzero(prompt_mask[i]).flatten()
            start = int(prompt_tokens[0]) if prompt_tokens.numel() else prompt_mask.shape[1]
            row = {}
            for k in keys:
                value = batch[k][i].detach()
                if aligned[k]:
                    value = value[start:] if REPLAY_ROW_KEYS[k][0] == "prompt" else value[:end]
                row[k] = value.to("cpu", copy=True)
            rows.append(row)
        self._entries.append((int(step), rows))
        self.added_rows += len(rows)
        return len(rows)

    def mix(self, batch: dict[str, Any], step: int) -> tuple[dict[str, Any], ReplayInfo]:
        """A new batch with k fresh rows replaced by replayed ones (see the class docstring); ``batch`` is unchanged."""
        if not self.config.enabled:
            return dict(batch), ReplayInfo(0.0, 0.0, [], [])
        keys = self._check_keys(batch)
        size = batch["completion_ids"].shape[0]
        stored = [(row_step, row) for row_step, rows in self._entries for row in rows]
        k = min(self.config.rows_per_batch(size), len(stored))
        if k == 0:
            return dict(batch), ReplayInfo(0.0, 0.0, [], [])
        drawn = [stored[j] for j in torch.randperm(len(stored), generator=self._generator)[:k].tolist()]
        for _, row in drawn:
            if set(row) != set(keys):
                raise ValueError(
                    f"a stored row has the keys {sorted(row)} but the fresh batch has {sorted(keys)}; replay needs "
                    "the same keys in every batch"
                )
        signal = [_row_signal(batch, i) for i in range(size)]
        positions = sorted(sorted(range(size), key=lambda i: signal[i])[:k])

        out = dict(batch)
        for key in keys:
            fresh = batch[key]
            side, pad_value = REPLAY_ROW_KEYS[key]
            pad = self.pad_token_id if pad_value is None else pad_value
            aligned = self._token_aligned(batch, key)
            rows = [row[key].to(device=fresh.device, dtype=fresh.dtype) for _, row in drawn]
            if aligned:
                width = max([fresh.shape[1], *(r.shape[0] for r in rows)])
                fresh = _pad_to(fresh, width, side, pad)
                rows = [_pad_to(r.unsqueeze(0), width, side, pad)[0] for r in rows]
            if any(r.shape != fresh.shape[1:] for r in rows):
                raise ValueError(
                    f"replay: stored rows of {key!r} have shapes {sorted({tuple(r.shape) for r in rows})}, the fresh "
                    f"batch's rows {tuple(fresh.shape[1:])}"
                )
            merged = fresh.clone()
            merged[positions] = torch.stack(rows)
            out[key] = merged
        ages = [int(step) - row_step for row_step, _ in drawn]
        self.replayed_rows += k
        return out, ReplayInfo(k / size, sum(ages) / k, positions, ages)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "entries": [
                {"step": s, "rows": [{k: v.cpu() for k, v in row.items()} for row in rows]} for s, rows in self._entries
            ],
            "generator": self._generator.get_state(),
            "seed": self.seed,
            "added_rows": self.added_rows,
            "replayed_rows": self.replayed_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._entries = deque(
            (
                (int(e["step"]), [{k: v.to("cpu", copy=True) for k, v in row.items()} for row in e["rows"]])
                for e in state["entries"]
            ),
            maxlen=self.config.capacity,
        )
        self._generator = torch.Generator()
        self._generator.set_state(state["generator"].cpu())  # a checkpoint may be loaded with map_location=cuda
        self.seed = int(state["seed"])
        self.added_rows = int(state["added_rows"])
        self.replayed_rows = int(state["replayed_rows"])


def _pad_to(t: torch.Tensor, width: int, side: str, value: float) -> torch.Tensor:
    """Pad dim 1 of (B, W, ...) to ``width`` on the left ("prompt") or right ("completion")."""
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    filler = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([filler, t] if side == "prompt" else [t, filler], dim=1)


def replay_importance_ratio_sum(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of exp(current - stored log-probs) over the unmasked tokens of the ``rows`` (B,) bool selection, and
    their count. per_token_logps, old_per_token_logps, mask: (B, T) -> two float64 scalars (summable over ranks)."""
    selected = mask.to(torch.bool) & rows.to(device=mask.device, dtype=torch.bool).unsqueeze(1)
    ratio = torch.exp(per_token_logps.detach().double() - old_per_token_logps.detach().double())
    return ratio[selected].sum(), selected.sum().double()


def replay_importance_ratio_mean(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
) -> float:
    """Token mean of exp(current - stored log-probs) over the unmasked tokens of the ``rows`` (B,) bool selection.

    per_token_logps, old_per_token_logps, mask: (B, T) -> a float (``quatro/replay_ratio_mean``); NaN without tokens.
    """
    total, count = replay_importance_ratio_sum(per_token_logps, old_per_token_logps, mask, rows)
    return float(total / count) if count > 0 else NAN


# ----------------------------------------------------------------------------------------------------- layer


@dataclass
class QuatroConfig:
    """The parts of QUATRO a trainer runs; None turns a part off (``guards.quatro`` -> ``QuatroSection.to_config``)."""

    kl: KLConfig | None = None
    entropy: EntropyConfig | None = None
    filters: FilterConfig | None = None
    replay: ReplayConfig | None = None
