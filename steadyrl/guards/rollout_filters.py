"""Rollout quality filters (QUATRO, ``guards.quatro.filters``): drop rollouts before advantages -- reward z-score,
length, parrot (copies the prompt), repetition, zero-variance group -- and compute advantages without them
(docs/DESIGN.md, "QUATRO: rollout filters").

Filters work on token ids gathered over all ranks (every rank keeps the same rows), as padded tensors
(``TokenBatch``); n-gram sizes are in tokens. Every n-gram is one exact int64 code (``ngram_codes``).
``tests/unit/reference_rollout_filters.py`` keeps the per-row Python version they are tested against.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from steadyrl.metrics import QUATRO_FILTERED_SHARE, QUATRO_ROWS, QUATRO_ZERO_VARIANCE_GROUPS, quatro_filtered
from steadyrl.ranges import Checked, bounded

DROPPED_ROWS = ("zero_advantage", "exclude")
# A dropped row is counted under the first of these that dropped it (the order the filters run in).
FILTER_REASONS = ("zscore", "length", "parrot", "repetition", "zero_variance")
MIN_DISTINCT = 3  # the z-score filter is skipped when the finite rewards take fewer distinct values (pass/fail)
# the length filter's rolling range: Tukey's far-out fences, the quartiles (LENGTH_PERCENTILES) of the last
# LENGTH_HISTORY completion lengths widened by LENGTH_FENCE x their spread (at least LENGTH_MIN_SPREAD tokens), once
# LENGTH_MIN_HISTORY of them are remembered: a healthy run's lengths stay inside (percentiles alone drop 2 % by design)
LENGTH_PERCENTILES = (25.0, 75.0)
LENGTH_FENCE = 3.0
LENGTH_MIN_SPREAD = 1.0
LENGTH_HISTORY = 2048
LENGTH_MIN_HISTORY = 256
PARROT_N = 4  # the parrot filter's n-gram size, in tokens
# A share over fewer n-grams is not evidence of copying: a right short answer that restates the prompt's subject
# ("Noah has 16 pencils." + end of turn, 6 n-grams) shares all of them. Healthy SmolLM2 at its start (2,560
# completions): every share above 0.8 had 6 n-grams (docs/DESIGN.md, "QUATRO: rollout filters"). 8 = 11 tokens copied.
PARROT_MIN_NGRAMS = 8


@dataclass
class ZScoreConfig(Checked):
    enabled: bool = False  # off: on a sparse reward the rare right answer is the outlier (docs/DESIGN.md)
    max_abs_z: float = bounded(3.5, gt=0, finite=True)  # |r - mean| / std over the whole generation batch


@dataclass
class LengthConfig(Checked):
    enabled: bool = True
    min_tokens: int = bounded(0, ge=0)
    max_tokens: int | None = bounded(None, ge=0)  # >= min_tokens
    rolling: bool = False  # also drop lengths far outside the recent ones (Tukey's far-out fences, LENGTH_FENCE);
    # off: a run that learns shorter answers moves its lengths out of its own history (docs/DESIGN.md)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(
                f"invalid LengthConfig: max_tokens={self.max_tokens} must be >= min_tokens={self.min_tokens}"
            )


@dataclass
class ParrotConfig(Checked):
    enabled: bool = True
    max_overlap: float = bounded(0.8, ge=0, le=1)  # share of the completion's n-grams that occur in its prompt


@dataclass
class RepetitionConfig(Checked):
    enabled: bool = True
    n: int = bounded(3, ge=1)
    # share of the completion's n-grams that repeat an earlier one in it
    max_repeat_share: float = bounded(0.5, ge=0, le=1)


@dataclass
class ZeroVarianceConfig:
    enabled: bool = True  # drop groups without a learning signal (DAPO dynamic sampling)


@dataclass
class FilterConfig(Checked):
    zscore: ZScoreConfig = field(default_factory=ZScoreConfig)
    length: LengthConfig = field(default_factory=LengthConfig)
    parrot: ParrotConfig = field(default_factory=ParrotConfig)
    repetition: RepetitionConfig = field(default_factory=RepetitionConfig)
    zero_variance: ZeroVarianceConfig = field(default_factory=ZeroVarianceConfig)
    max_drop_share: float = bounded(0.5, ge=0, le=1)  # dropping more than this share of a batch comes with a warning
    # a dropped row in the loss: "zero_advantage" (stays, advantage 0) or "exclude" (completion mask zeroed)
    dropped_rows: str = bounded("zero_advantage", choices=DROPPED_ROWS)


@dataclass(eq=False)  # tensors: no elementwise ==
class TokenBatch:
    """B rows of token ids, left-aligned in a padded tensor: row b is ``ids[b, :lengths[b]]``. ids: (B, T) integer
    (stored as int64), anything past a row's length is padding; lengths: (B,) in [0, T]."""

    ids: torch.Tensor
    lengths: torch.Tensor

    def __post_init__(self) -> None:
        self.ids = _integer_ids(self.ids)
        if self.lengths.shape != (self.ids.shape[0],):
            raise ValueError(f"lengths must have shape ({self.ids.shape[0]},), got {tuple(self.lengths.shape)}")
        self.lengths = self.lengths.to(device=self.ids.device, dtype=torch.long)
        if self.lengths.numel():
            low, high = (int(v) for v in torch.aminmax(self.lengths))
            if low < 0 or high > self.width:
                raise ValueError(f"lengths must lie in [0, {self.width}] (the width of ids), got [{low}, {high}]")

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int] | torch.Tensor]) -> TokenBatch:
        """Unpadded rows (lists of ids, or 1-d tensors) -> one right-padded batch."""
        lists = [r.tolist() if isinstance(r, torch.Tensor) else r for r in rows]
        lengths = torch.tensor([len(r) for r in lists], dtype=torch.long)
        width = int(lengths.max()) if lists else 0
        ids = torch.zeros((len(lists), width), dtype=torch.long)
        ids[torch.arange(width) < lengths[:, None]] = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
        return cls(ids, lengths)

    @classmethod
    def from_mask(cls, ids: torch.Tensor, mask: torch.Tensor) -> TokenBatch:
        """The ids where ``mask`` is set, in order, left-aligned: ``row[mask.bool()]`` of every row (so left, right
        or any other padding)."""
        if ids.shape != mask.shape:
            raise ValueError(f"ids {tuple(ids.shape)} and mask {tuple(mask.shape)} must have the same shape")
        keep = mask.bool()
        if bool(keep.all()):  # no padding (prompts of one length): the rows as they are, without the sort
            lengths = torch.full((ids.shape[0],), ids.shape[1], dtype=torch.long, device=ids.device)
            return cls._unchecked(ids, lengths)
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept positions first, in order
        return cls._unchecked(ids.gather(1, order), keep.sum(dim=1))

    @classmethod
    def _unchecked(cls, ids: torch.Tensor, lengths: torch.Tensor) -> TokenBatch:
        """For lengths in [0, T] by construction (a mask's row sums): skips ``__post_init__``'s range check."""
        batch = object.__new__(cls)
        batch.ids, batch.lengths = _integer_ids(ids), lengths.long()
        return batch

    def valid(self) -> torch.Tensor:
        """(B, T) bool: the positions inside each row."""
        return torch.arange(self.width, device=self.ids.device) < self.lengths[:, None]

    def to(self, device: torch.device | str) -> TokenBatch:
        return self if self.ids.device == torch.device(device) else TokenBatch(self.ids.to(device), self.lengths)

    def to_lists(self) -> list[list[int]]:
        return [row[:n] for row, n in zip(self.ids.tolist(), self.lengths.tolist(), strict=True)]


def _integer_ids(ids: torch.Tensor) -> torch.Tensor:
    if ids.ndim != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a (B, T) integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    return ids.long()


# parrot_shares compares every (completion n-gram, prompt n-gram) pair of a row at once up to this many pairs per row,
# and binary-searches the sorted prompt n-grams above it
BROADCAST_PAIRS = 1024
NO_GRAM = torch.iinfo(torch.int64).max  # the code of a window that is no n-gram: above every real code, sorts last


def _windows(batch: TokenBatch, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L, n) windows ``ids[b, j : j + n]`` (L = max(T - n + 1, 0)) and (B, L) bool: the window is an n-gram."""
    rows, width = batch.ids.shape
    count = max(width - n + 1, 0)
    windows = batch.ids.unfold(1, n, 1) if count else batch.ids.new_zeros((rows, 0, n))
    grams = torch.arange(count, device=batch.ids.device) < (batch.lengths - (n - 1))[:, None]
    return windows, grams


@functools.lru_cache(maxsize=64)
def _powers(base: int, k: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([base ** (k - 1 - j) for j in range(k)], dtype=torch.long, device=device)


def ngram_codes(batches: Sequence[TokenBatch], n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every n-gram of every row as one int64, in one code space for all ``batches``: equal codes <=> equal n-grams.

    Returns per batch (codes, grams), both (B, L) with L = max(T - n + 1, 0): window j of row b is
    ``ids[b, j : j + n]``, an n-gram where ``grams`` (j + n <= lengths[b]); ``codes`` is ``NO_GRAM`` elsewhere.
    Exact, no hashing: the base-``base`` number of the n ids shifted to [0, base) (base: the range of the whole id
    tensors, padding included) when base**n < 2**63, else the dense ranks of the n-grams (``torch.unique(dim=0)``).
    """
    parts = [_windows(b, n) for b in batches]
    ranges = [torch.aminmax(b.ids) for b in batches if b.ids.numel()]
    if not ranges:  # no ids at all, so no n-grams
        return [(torch.full(g.shape, NO_GRAM, dtype=torch.long, device=g.device), g) for _, g in parts]
    lo, hi = min(int(low) for low, _ in ranges), max(int(high) for _, high in ranges)
    if (hi - lo + 1) ** n <= NO_GRAM:
        powers = _powers(hi - lo + 1, n, parts[0][0].device)
        return [(torch.where(grams, ((windows - lo) * powers).sum(dim=-1), NO_GRAM), grams) for windows, grams in parts]
    _, ranks = torch.unique(torch.cat([w[g] for w, g in parts]), dim=0, return_inverse=True)
    out, start = [], 0
    for _, grams in parts:
        codes = torch.full(grams.shape, NO_GRAM, dtype=torch.long, device=grams.device)
        count = int(grams.sum())
        codes[grams] = ranks[start : start + count]
        start += count
        out.append((codes, grams))
    return out


def repeat_shares(completions: TokenBatch, n: int) -> torch.Tensor:
    """(B,) float64 share of each row's n-grams that repeat an earlier one: 1 - distinct / total; 0 without
    n-grams."""
    ((codes, grams),) = ngram_codes([completions], n)
    ordered = codes.sort(dim=1).values
    first = ordered != NO_GRAM  # the first of each distinct n-gram
    first[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    # 1 - distinct / total, rounded as the reference rounds it (repeated / total can differ in the last bit)
    return (1.0 - first.sum(dim=1).double() / grams.sum(dim=1)).nan_to_num_(nan=0.0)


def parrot_shares(prompts: TokenBatch, completions: TokenBatch, n: int) -> torch.Tensor:
    """(B,) float64 share of the completion's n-gram positions whose n-gram occurs in the prompt of the same row; 0
    without completion n-grams."""
    if prompts.rows != completions.rows:
        raise ValueError(f"got {prompts.rows} prompts for {completions.rows} completions")
    (prompt_codes, _), (codes, grams) = ngram_codes([prompts, completions], n)
    if prompt_codes.shape[1] * codes.shape[1] <= BROADCAST_PAIRS:  # short rows: compare every pair at once
        hits = ((codes[:, :, None] == prompt_codes[:, None, :]).any(dim=2) & grams).sum(dim=1)
    elif codes.shape[0] and prompt_codes.shape[1]:  # sorted prompt n-grams, one binary search per completion n-gram
        ordered = prompt_codes.sort(dim=1).values
        at = torch.searchsorted(ordered, codes).clamp_(max=ordered.shape[1] - 1)
        hits = ((ordered.gather(1, at) == codes) & grams).sum(dim=1)
    else:
        hits = torch.zeros(completions.rows, dtype=torch.long, device=completions.ids.device)
    return (hits.double() / grams.sum(dim=1)).nan_to_num_(nan=0.0)  # as Python's int / int; 0 where no n-grams


def reinforced(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(N,) bool: a finite reward above the mean of its group's finite rewards (a positive advantage in GRPO)."""
    values = rewards.view(-1, num_generations)
    mean = torch.nanmean(torch.where(torch.isfinite(values), values, math.nan), dim=1, keepdim=True)
    return (torch.isfinite(values) & (values > mean)).reshape(-1)


def no_signal_groups(rewards: torch.Tensor, kept: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(P,) bool: groups whose kept rows have fewer than 2 finite rewards, or all-equal ones. rewards, kept: (N,)."""
    shape = (rewards.numel() // num_generations, num_generations)
    values = rewards.view(shape)
    members = kept.view(shape) & torch.isfinite(values)
    high = torch.where(members, values, -math.inf).amax(dim=1)
    low = torch.where(members, values, math.inf).amin(dim=1)
    return (members.sum(dim=1) < 2) | (high == low)


class LengthHistory:
    """The last ``capacity`` completion lengths, oldest first, in an int64 tensor of ``capacity`` entries."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buffer = torch.zeros(capacity, dtype=torch.long)  # the remembered lengths are its last _count entries
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def extend(self, lengths: torch.Tensor) -> None:
        """Append (k,) non-negative lengths; the oldest ones fall out past ``capacity``."""
        lengths = lengths.reshape(-1).long()
        self._buffer = torch.cat([self._buffer, lengths])[-self.capacity :].clone()
        self._count = min(self._count + lengths.numel(), self.capacity)

    def values(self) -> torch.Tensor:
        """The remembered lengths, oldest first."""
        return self._buffer[self.capacity - self._count :]

    def quantiles(self, qs: Sequence[float]) -> list[float]:
        """``torch.quantile`` (linear interpolation) of the remembered lengths at each of ``qs``, as floats."""
        if not self._count:
            raise ValueError("no lengths remembered")
        q = torch.tensor(qs, dtype=torch.float64)
        return torch.quantile(self.values().double(), q, interpolation="linear").tolist()

    def tolist(self) -> list[int]:
        return self.values().tolist()


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
        out[QUATRO_ROWS] = float(n)
        return out


def fences(low: float, high: float) -> tuple[float, float]:
    """[low, high] widened by ``LENGTH_FENCE`` x max(high - low, ``LENGTH_MIN_SPREAD``) on each side."""
    if LENGTH_FENCE == 0:
        return low, high
    margin = LENGTH_FENCE * max(high - low, LENGTH_MIN_SPREAD)
    return low - margin, high + margin


class RolloutFilter:
    """Rollout quality filters: ``filt(rewards, prompt_ids, completion_ids, num_generations) -> FilterResult``.

    Inputs cover the whole generation batch: rewards (N,) with NaN = unscorable, N prompts and N completions (each
    a ``TokenBatch`` or N unpadded id lists); groups are consecutive runs of ``num_generations`` rows. The filters
    run in the order of ``FILTER_REASONS``; the first four judge each row on its own, the last the rows still kept:

    - zscore: |r - mean| / std > ``max_abs_z`` over the finite rewards of the batch (unbiased std; skipped when
      std == 0 or with fewer than ``MIN_DISTINCT`` distinct finite values). NaN rewards never drop.
    - length: outside [``min_tokens``, ``max_tokens``], or (``rolling``) outside ``length_range()`` of the lengths
      before this batch; every row's length then enters the history.
    - parrot: ``parrot_shares(prompt, completion, PARROT_N) > max_overlap`` on a row the reward would reinforce
      (``reinforced``: above its group's mean) with at least ``PARROT_MIN_NGRAMS`` n-grams; a degenerate row below
      the mean keeps its negative advantage.
    - repetition: ``repeat_shares(completion, n) > max_repeat_share`` on a reinforced row, likewise.
    - zero_variance: a group whose kept rows have fewer than 2 finite rewards, or all-equal ones (no learning
      signal); its kept rows are dropped. ``zero_variance_groups`` flags these groups even when this filter is off.

    Dropping more than ``max_drop_share`` of the batch still drops, with ``warning`` set. The share counts the rows
    the first four filters drop, and zero-variance rows only with ``dropped_rows: exclude`` (else they train as in
    plain GRPO, with advantage 0).
    """

    def __init__(self, config: FilterConfig | None = None) -> None:
        self.config = config or FilterConfig()
        self._lengths = LengthHistory(LENGTH_HISTORY)
        self.calls = 0
        self.dropped = dict.fromkeys(FILTER_REASONS, 0)  # totals over all calls

    def length_range(self) -> tuple[float, float] | None:
        """The rolling fences of the remembered lengths (module constants), or None before ``LENGTH_MIN_HISTORY``."""
        if not self.config.length.rolling or len(self._lengths) < LENGTH_MIN_HISTORY:
            return None
        low, high = self._lengths.quantiles([p / 100.0 for p in LENGTH_PERCENTILES])
        return fences(low, high)

    def __call__(
        self,
        rewards: torch.Tensor,
        prompt_ids: TokenBatch | Sequence[Sequence[int]],
        completion_ids: TokenBatch | Sequence[Sequence[int]],
        num_generations: int,
    ) -> FilterResult:
        if rewards.ndim != 1:
            raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
        n_rows = rewards.shape[0]
        prompts, completions = _token_batch(prompt_ids), _token_batch(completion_ids)
        if prompts.rows != n_rows or completions.rows != n_rows:
            raise ValueError(
                f"got {prompts.rows} prompts and {completions.rows} completions for {n_rows} rewards; "
                "need one of each per row"
            )
        if num_generations < 1 or n_rows % num_generations:
            raise ValueError(f"num_generations={num_generations} does not divide the batch of {n_rows}")
        cfg = self.config
        r = rewards.detach().to(device="cpu", dtype=torch.float64)
        # reason: 0 kept, k dropped by FILTER_REASONS[k - 1], the first filter (in that order) that drops the row
        reason = torch.zeros(n_rows, dtype=torch.long)
        own: list[tuple[str, torch.Tensor]] = []  # the filters that judge each row on its own
        if cfg.zscore.enabled:
            own.append(("zscore", self._zscore_hits(r)))
        lengths = completions.lengths
        if cfg.length.enabled:
            own.append(("length", self._length_hits(lengths)))
        paid = reinforced(r, num_generations)
        if cfg.parrot.enabled and bool(paid.any()):
            shares = parrot_shares(prompts, completions, PARROT_N)
            judged = completions.lengths - (PARROT_N - 1) >= PARROT_MIN_NGRAMS
            own.append(("parrot", paid & judged & (shares > cfg.parrot.max_overlap)))
        repeat = cfg.repetition
        if repeat.enabled and bool(paid.any()) and _can_repeat_over(lengths, repeat.n, repeat.max_repeat_share):
            own.append(("repetition", paid & (repeat_shares(completions, repeat.n) > repeat.max_repeat_share)))
        for name, hits in reversed(own):  # the last write wins: the earliest filter's
            reason.masked_fill_(hits, FILTER_REASONS.index(name) + 1)
        no_signal = no_signal_groups(r, reason == 0, num_generations)
        if cfg.zero_variance.enabled:
            hits = (reason == 0) & no_signal.repeat_interleave(num_generations)
            reason.masked_fill_(hits, FILTER_REASONS.index("zero_variance") + 1)

        self._lengths.extend(lengths)
        self.calls += 1
        per_reason = torch.bincount(reason, minlength=len(FILTER_REASONS) + 1).tolist()[1:]
        counts = dict(zip(FILTER_REASONS, per_reason, strict=True))
        for name, count in counts.items():
            self.dropped[name] += count
        # zero-variance rows have advantage 0 in plain GRPO too: they count only when they leave the loss normaliser
        counted = {k: v for k, v in counts.items() if k != "zero_variance" or cfg.dropped_rows == "exclude"}
        n_dropped = sum(counted.values())
        warning = None
        if n_rows and n_dropped / n_rows > cfg.max_drop_share:
            detail = ", ".join(f"{name} {count}" for name, count in counted.items() if count)
            warning = (
                f"the rollout filters dropped {n_dropped} of {n_rows} rollouts ({n_dropped / n_rows:.0%} > "
                f"guards.quatro.filters.max_drop_share={cfg.max_drop_share}): {detail}. Check the rewards and the "
                "filter thresholds (guards.quatro.filters.<filter>), or turn the busiest filter off"
            )
        keep = (reason == 0).to(rewards.device)
        return FilterResult(keep, counts, no_signal.to(rewards.device), warning)

    def _zscore_hits(self, r: torch.Tensor) -> torch.Tensor:
        zc = self.config.zscore
        finite = torch.isfinite(r)
        values = r if bool(finite.all()) else r[finite]
        if values.numel() < 2 or torch.unique(values).numel() < MIN_DISTINCT:
            return torch.zeros_like(finite)
        std = values.std().item()
        if not std > 0:
            return torch.zeros_like(finite)
        z = (r - values.mean()) / std
        return finite & (z.abs() > zc.max_abs_z)

    def _length_hits(self, lengths: torch.Tensor) -> torch.Tensor:
        """Outside [min_tokens, max_tokens] or outside the rolling range: outside the intersection of the two, so
        two comparisons whatever is configured."""
        ln = self.config.length
        low, high = float(ln.min_tokens), math.inf if ln.max_tokens is None else float(ln.max_tokens)
        bounds = self.length_range()
        if bounds is not None:
            low, high = max(low, bounds[0]), min(high, bounds[1])
        # integer lengths: n < low <=> n < ceil(low), n > high <=> n > floor(high); comparing the int64 lengths
        # with ints is exact (with a float, both would be rounded to float32)
        hits = lengths < math.ceil(low)
        return hits if high == math.inf else hits | (lengths > math.floor(high))

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "lengths": self._lengths.tolist(), "calls": self.calls, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._lengths = LengthHistory(LENGTH_HISTORY)
        self._lengths.extend(torch.tensor([int(v) for v in state["lengths"]], dtype=torch.long))
        self.calls = int(state["calls"])
        self.dropped = {name: int(state["dropped"].get(name, 0)) for name in FILTER_REASONS}


def _can_repeat_over(lengths: torch.Tensor, n: int, share: float) -> bool:
    """Whether any row could have a ``repeat_shares`` value above ``share``: a row of t n-grams has at most
    1 - 1 / t, rounded as ``repeat_shares`` rounds it (monotone in t, so the longest row bounds them all). When no
    row can, the n-gram pass is skipped."""
    grams = int(lengths.max()) - n + 1 if lengths.numel() else 0
    return grams > 0 and 1.0 - 1.0 / grams > share


def _token_batch(ids: TokenBatch | Sequence[Sequence[int]]) -> TokenBatch:
    return (ids if isinstance(ids, TokenBatch) else TokenBatch.from_lists(ids)).to("cpu")


def masked_group_advantages(
    rewards: torch.Tensor,
    keep: torch.Tensor,
    num_generations: int,
    advantage_fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Group advantages without the dropped rows. rewards, keep: (N,) -> advantages (N,), rewards' float dtype.
    Dropped rows are NaN for ``advantage_fn`` ((num_prompts, G) -> same shape) and get exactly 0, as does every row
    of a group with fewer than 2 kept rows with a finite reward."""
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
