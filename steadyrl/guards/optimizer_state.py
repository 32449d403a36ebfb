"""Helpers over an optimizer's Adam state shared by OPEFO's pieces and QUATRO's ``brake_moments``. Cross-rank
operations go through ``reduce_sum(t)`` (summed over ranks) and ``all_gather(t)`` (1-D tensors of any lengths
concatenated in rank order), the identity by default; ``distributed_ops()`` builds them from ``torch.distributed``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

ReduceSum = Callable[[torch.Tensor], torch.Tensor]
AllGather = Callable[[torch.Tensor], torch.Tensor]
CHUNK = 1 << 22  # entries per piece of an elementwise pass: a bool temporary of at most 4 MiB


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def optimizer_device(optimizer: torch.optim.Optimizer, keys: Iterable[str] = ("exp_avg_sq",)) -> torch.device:
    """Device of the first state tensor under ``keys``, else of the first parameter, else the CPU."""
    for state in optimizer.state.values():
        for key in keys:
            t = state.get(key)
            if isinstance(t, torch.Tensor):
                return t.device
    for group in optimizer.param_groups:
        for p in group["params"]:
            return p.device
    return torch.device("cpu")


def slot_squares(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Local squared L2 norm of each entry (0 for None), float64 (len(tensors),) on ``device``."""
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    for i, t in enumerate(tensors):
        if t is not None and t.numel():
            low = t.dtype in (torch.bfloat16, torch.float16)
            out[i] = torch.linalg.vector_norm(t, dtype=torch.float32 if low else None).to(device, torch.float64) ** 2
    return out


def first_device(tensors: Sequence[torch.Tensor | None]) -> torch.device:
    return next((t.device for t in tensors if t is not None), torch.device("cpu"))


def optimizer_state_finite(
    optimizer: torch.optim.Optimizer,
    keys: Sequence[str] = ("exp_avg", "exp_avg_sq"),
    reduce_sum: ReduceSum | None = None,
) -> bool:
    """True when every ``keys`` state tensor is finite on every rank: one ``aminmax`` per tensor, no copies, one
    all-reduce of the count of bad tensors, one host sync."""
    home = optimizer_device(optimizer, keys)
    bad = torch.zeros(1, dtype=torch.float64, device=home)
    with torch.no_grad():
        for state in optimizer.state.values():
            for key in keys:
                t = state.get(key)
                if isinstance(t, torch.Tensor) and t.numel():
                    lo, hi = torch.aminmax(t)  # NaN propagates into both, +-inf into one of them
                    bad += (~(torch.isfinite(lo) & torch.isfinite(hi))).to(home, torch.float64)
        return (reduce_sum or identity)(bad).item() == 0


MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # Adam's (and AMSGrad's) per-entry moments
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq")


def _moment_tensors(optimizer: torch.optim.Optimizer) -> list[dict[str, torch.Tensor]]:
    """Per parameter, its moment tensors that hold entries (keys of ``MOMENT_KEYS``)."""
    out = []
    for state in optimizer.state.values():
        moments = {k: t for k in MOMENT_KEYS if isinstance(t := state.get(k), torch.Tensor) and t.numel()}
        if moments:
            out.append(moments)
    return out


def _bad_pieces(moments: dict[str, torch.Tensor]) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """One parameter's moments in pieces of ``CHUNK`` entries: (the pieces by key, views of the tensors; the bool
    mask of the entries where any of them is not finite)."""
    if all(t.is_contiguous() for t in moments.values()):
        views = {k: t.view(-1) for k, t in moments.items()}
        size = min(v.numel() for v in views.values())
        chunks = [{k: v[start : start + CHUNK] for k, v in views.items()} for start in range(0, size, CHUNK)]
    else:  # a flat view would be a copy: the whole tensors at once
        chunks = [dict(moments)]
    for pieces in chunks:
        first = next(iter(pieces.values()))
        bad = torch.zeros(first.shape, dtype=torch.bool, device=first.device)
        for piece in pieces.values():
            bad |= ~torch.isfinite(piece)
        yield pieces, bad


def nonfinite_moment_entries(optimizer: torch.optim.Optimizer, reduce_sum: ReduceSum | None = None) -> tuple[int, int]:
    """(entries with a non-finite moment, all entries) over this rank's parameters, summed over ranks by
    ``reduce_sum``: an entry is one position of a parameter, bad when any of its moments (``MOMENT_KEYS``) is not
    finite, as ``repair_moments`` counts them."""
    home = optimizer_device(optimizer, MOMENT_KEYS)
    counts = torch.zeros(2, dtype=torch.float64, device=home)
    with torch.no_grad():
        for moments in _moment_tensors(optimizer):
            for _, bad in _bad_pieces(moments):
                counts[0] += bad.sum().to(home, torch.float64)
                counts[1] += bad.numel()
        bad_entries, total = (reduce_sum or identity)(counts).tolist()
    return int(bad_entries), int(total)


def repair_moments(optimizer: torch.optim.Optimizer) -> int:
    """Reset this rank's non-finite moment entries in place; returns how many entries were reset.

    An entry is bad when any of its moments is not finite. Its first moment becomes 0 and its second moment the
    largest finite second moment of the same tensor (of all this rank's tensors when that one has none; 0 when none
    is finite anywhere), so its next updates are no larger than that tensor's smallest. Nothing else changes.
    """
    tensors = _moment_tensors(optimizer)
    repaired = 0
    with torch.no_grad():
        largest = [_largest_finite([m[k] for k in SECOND_MOMENTS if k in m]) for m in tensors]
        fallback = max((v for v in largest if v is not None), default=0.0)
        for moments, top in zip(tensors, largest, strict=True):
            value = fallback if top is None else top
            for pieces, bad in _bad_pieces(moments):
                count = int(bad.sum())
                if not count:
                    continue
                repaired += count
                for key, piece in pieces.items():
                    piece.masked_fill_(bad, value if key in SECOND_MOMENTS else 0.0)
    return repaired


def _largest_finite(tensors: Sequence[torch.Tensor]) -> float | None:
    """The largest finite entry over ``tensors`` (chunked); None when there is none."""
    best: float | None = None
    for t in tensors:
        view = flat(t)
        for start in range(0, view.numel(), CHUNK):
            piece = view[start : start + CHUNK]
            finite = piece[torch.isfinite(piece)]
            if finite.numel():
                top = float(finite.max())
                best = top if best is None else max(best, top)
    return best


def distributed_ops(group: Any = None, device: torch.device | str | None = None) -> tuple[ReduceSum, AllGather]:
    """``(reduce_sum, all_gather)`` over a ``torch.distributed`` process group (the default one when None).
    ``device``: where the collectives run (e.g. CUDA for NCCL with offloaded state); results come back on the
    input's device."""
    import torch.distributed as dist

    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        buf = t.detach().to(device or t.device, copy=True)
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        return buf.to(t.device)

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        if t.ndim != 1:
            raise ValueError(f"all_gather takes 1-D tensors, got shape {tuple(t.shape)}")
        local = t.detach().to(device or t.device)
        world = dist.get_world_size(group)
        size = torch.tensor([local.numel()], dtype=torch.int64, device=local.device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        if longest == 0:
            return t.detach().clone()
        padded = local.new_zeros(longest)
        padded[: local.numel()] = local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, lengths, strict=True)]).to(t.device)

    return reduce_sum, all_gather


UNBRAKED_GROUP = "steadyrl_unbraked"  # a param-group key: True on groups whose loss the floor's brake does not scale


def scale_moments(optimizer: torch.optim.Optimizer, factor: float) -> int:
    """Multiply every Adam first moment (``exp_avg``) by ``factor`` and every second moment by ``factor**2``, in
    place: the state Adam would hold had every gradient been ``factor`` times as large. Groups marked
    ``UNBRAKED_GROUP`` (PPO's critic) keep theirs. Per rank, no collective; returns the number of tensors scaled."""
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"scale_moments: factor must be finite and > 0, got {factor}")
    scaled = 0
    with torch.no_grad():
        for group in optimizer.param_groups:
            if group.get(UNBRAKED_GROUP, False):
                continue
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                for key in MOMENT_KEYS:
                    t = state.get(key)
                    if isinstance(t, torch.Tensor) and t.numel():
                        t.mul_(factor if key == "exp_avg" else factor * factor)
                        scaled += 1
    return scaled
