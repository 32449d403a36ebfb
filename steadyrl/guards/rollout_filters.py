"""Rollout quality filters (QUATRO, ``guards.quatro.filters``): drop rollouts before advantages -- reward z-score,
length, parrot (copies the prompt), repetition, near-duplicate, zero-variance group -- and compute advantages without
them (docs/DESIGN.md, "QUATRO: rollout filters").

Filters work on token ids (tokenizer-agnostic), so n-gram sizes are in tokens. The caller passes rewards and ids
gathered over all ranks, so every rank keeps the same rows.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from steadyrl.metrics import (
    QUATRO_FILTERED_SHARE,
    QUATRO_ZERO_VARIANCE_GROUPS,
    quatro_filtered,
)

# A dropped row is counted under the first of these that dropped it (the order the filters run in).
DROPPED_ROWS = ("zero_advantage", "exclude")
FILTER_REASONS = ("zscore", "length", "parrot", "repetition", "near_duplicate", "zero_variance")


@dataclass
class ZScoreConfig:
    enabled: bool = True
    max_abs_z: float = 3.5  # |r - mean| / std over the whole generation batch
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
    enabled: bool = True  # drop groups without a learning signal (DAPO dynamic sampling)


@dataclass
class FilterConfig:
    zscore: ZScoreConfig = field(default_factory=ZScoreConfig)
    length: LengthConfig = field(default_factory=LengthConfig)
    parrot: ParrotConfig = field(default_factory=ParrotConfig)
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    near_duplicate: NearDuplicateConfig = field(default_factory=NearDuplicateConfig)
    zero_variance: ZeroVarianceConfig = field(default_factory=ZeroVarianceConfig)
    max_drop_share: float = 0.5  # dropping more than this share of a batch comes with a warning
    # what a dropped row becomes in the loss: "zero_advantage" (it stays in the loss with advantage 0, so the
    # kept rows keep the weight they have without filters, and the KL term still sees it) or "exclude" (its
    # completion mask is zeroed: the normaliser shrinks and the kept rows' effective learning rate grows by
    # rows / kept rows)
    dropped_rows: str = "zero_advantage"

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
        if self.dropped_rows not in DROPPED_ROWS:
            problems.append(f"dropped_rows must be one of {', '.join(DROPPED_ROWS)}, got {self.dropped_rows!r}")
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
    masked = torch.where(keep, r, torch.full_like(r, math.nan))
    advantages = advantage_fn(masked.reshape(-1, num_generations)).reshape(n_rows).to(r.dtype)
    members = (keep & torch.isfinite(r)).view(-1, num_generations).sum(dim=1, keepdim=True)
    signal = (members >= 2).expand(-1, num_generations).reshape(n_rows) & keep
    return torch.where(signal, advantages, torch.zeros_like(advantages))
