"""The per-row, pure-Python rollout filters that ``RolloutFilter`` replaced: the reference its tensor code is tested
against (tests/unit/test_rollout_filters_vectorised.py). Trainers do not use this module.

``ReferenceRolloutFilter`` is ``RolloutFilter`` with the old ``__call__``: token ids as Python lists, the n-gram
measures below (``ngrams``, ``parrot_share``, ``repeat_share``) row by row. It shares the config,
the module constants (read at call time, so a test may patch them), the length history and the state of
``RolloutFilter``, so two filters fed the same batches stay in step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from steadyrl.guards import rollout_filters
from steadyrl.guards.rollout_filters import (
    FILTER_REASONS,
    FilterConfig,
    FilterResult,
    RolloutFilter,
    TokenBatch,
)


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


def _as_lists(ids: Sequence[Sequence[int]] | TokenBatch) -> list[list[int]]:
    if isinstance(ids, TokenBatch):
        return ids.to_lists()
    return [i.tolist() if isinstance(i, torch.Tensor) else list(i) for i in ids]


class ReferenceRolloutFilter(RolloutFilter):
    """``RolloutFilter`` computed row by row in Python (the implementation before the tensor one), with its own
    length history (a deque of ints) and its own ``length_range`` and state."""

    def __init__(self, config: FilterConfig | None = None) -> None:
        super().__init__(config)
        self._ref_lengths: deque[int] = deque(maxlen=rollout_filters.LENGTH_HISTORY)

    def length_range(self) -> tuple[float, float] | None:
        if not self.config.length.rolling or len(self._ref_lengths) < rollout_filters.LENGTH_MIN_HISTORY:
            return None
        history = torch.tensor(list(self._ref_lengths), dtype=torch.float64)
        low, high = rollout_filters.LENGTH_PERCENTILES
        q = torch.tensor([low / 100.0, high / 100.0], dtype=torch.float64)
        low, high = torch.quantile(history, q, interpolation="linear").tolist()
        return rollout_filters.fences(low, high)

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "lengths": list(self._ref_lengths), "calls": self.calls, "dropped": dict(self.dropped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ref_lengths = deque((int(v) for v in state["lengths"]), maxlen=rollout_filters.LENGTH_HISTORY)
        self.calls = int(state["calls"])
        self.dropped = {name: int(state["dropped"].get(name, 0)) for name in FILTER_REASONS}

    def __call__(
        self,
        rewards: torch.Tensor,
        prompt_ids: Sequence[Sequence[int]] | TokenBatch,
        completion_ids: Sequence[Sequence[int]] | TokenBatch,
        num_generations: int,
    ) -> FilterResult:
        if rewards.ndim != 1:
            raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
        n_rows = rewards.shape[0]
        prompts, completions = _as_lists(prompt_ids), _as_lists(completion_ids)
        if len(prompts) != n_rows or len(completions) != n_rows:
            raise ValueError(
                f"got {len(prompts)} prompts and {len(completions)} completions for {n_rows} rewards; "
                "need one of each per row"
            )
        if num_generations < 1 or n_rows % num_generations:
            raise ValueError(f"num_generations={num_generations} does not divide the batch of {n_rows}")
        cfg = self.config
        r = rewards.detach().to(device="cpu", dtype=torch.float64)
        finite = torch.isfinite(r)
        reason: list[str | None] = [None] * n_rows

        def mark(hits: Sequence[bool], name: str) -> None:
            for i, hit in enumerate(hits):
                if hit and reason[i] is None:
                    reason[i] = name

        if cfg.zscore.enabled:
            mark(self._reference_zscore_hits(r, finite), "zscore")
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
        values = r.tolist()
        num_groups = n_rows // num_generations
        paid = []  # above the mean of the group's finite rewards
        for g in range(num_groups):
            group = values[g * num_generations : (g + 1) * num_generations]
            scored = [v for v in group if math.isfinite(v)]
            paid += [bool(scored) and math.isfinite(v) and v > sum(scored) / len(scored) for v in group]
        if cfg.parrot.enabled:
            n, p = rollout_filters.PARROT_N, cfg.parrot
            shares = [parrot_share(a, b, n) for a, b in zip(prompts, completions, strict=True)]
            judged = [len(c) - (n - 1) >= rollout_filters.PARROT_MIN_NGRAMS for c in completions]
            hits = zip(paid, judged, shares, strict=True)
            mark([up and long and share > p.max_overlap for up, long, share in hits], "parrot")
        if cfg.repetition.enabled:
            rep = cfg.repetition
            shares = [repeat_share(c, rep.n) for c in completions]
            mark([up and share > rep.max_repeat_share for up, share in zip(paid, shares, strict=True)], "repetition")

        no_signal = [False] * num_groups
        for g in range(num_groups):
            rows = range(g * num_generations, (g + 1) * num_generations)
            kept = [values[i] for i in rows if reason[i] is None and math.isfinite(values[i])]
            no_signal[g] = len(kept) < 2 or max(kept) == min(kept)
        if cfg.zero_variance.enabled:
            mark([no_signal[i // num_generations] for i in range(n_rows)], "zero_variance")

        self._ref_lengths.extend(lengths)
        self.calls += 1
        counts = {name: sum(x == name for x in reason) for name in FILTER_REASONS}
        for name, count in counts.items():
            self.dropped[name] += count
        # the share that changes training: zero-variance rows have advantage 0 in plain GRPO too, so they count
        # only when dropping them shrinks the loss normaliser (dropped_rows: exclude)
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
        keep = torch.tensor([x is None for x in reason], dtype=torch.bool, device=rewards.device)
        groups = torch.tensor(no_signal, dtype=torch.bool, device=rewards.device)
        return FilterResult(keep, counts, groups, warning)

    def _reference_zscore_hits(self, r: torch.Tensor, finite: torch.Tensor) -> list[bool]:
        zc = self.config.zscore
        values = r[finite]
        if values.numel() < 2 or torch.unique(values).numel() < rollout_filters.MIN_DISTINCT:
            return [False] * r.numel()
        std = values.std().item()
        if not std > 0:
            return [False] * r.numel()
        z = (r - values.mean()) / std
        return (finite & (z.abs() > zc.max_abs_z)).tolist()


def reference_shares(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], parrot_n: int, repeat_n: int
) -> tuple[list[float], list[float]]:
    """Per-row ``parrot_share`` and ``repeat_share`` (the values the tensor ``parrot_shares`` / ``repeat_shares``
    must equal)."""
    parrot = [parrot_share(p, c, parrot_n) for p, c in zip(prompts, completions, strict=True)]
    return parrot, [repeat_share(c, repeat_n) for c in completions]
