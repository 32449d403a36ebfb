"""Helpers over an optimizer's Adam state shared by OPEFO's pieces, and the injected collectives.

Nothing here knows about processes: every cross-rank operation goes through ``reduce_sum(t)`` (summed over ranks)
and ``all_gather(t)`` (1-D tensors of any lengths concatenated in rank order), the identity by default;
``distributed_ops()`` builds them from ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
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


def group_states(optimizer: torch.optim.Optimizer, group: dict[str, Any], key: str) -> list[torch.Tensor]:
    """The ``key`` state tensors of one param group, in parameter order; params without that state are skipped."""
    out = []
    for p in group["params"]:
        t = optimizer.state.get(p, {}).get(key)
        if isinstance(t, torch.Tensor) and t.numel():
            out.append(t)
    return out


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


def distributed_ops(group: Any = None, device: torch.device | str | None = None) -> tuple[ReduceSum, AllGather]:
    """``(reduce_sum, all_gather)`` over a ``torch.distributed`` process group (the default one when None).

    ``device``: where the collectives run (e.g. the rank's CUDA device for NCCL when the optimizer state is
    offloaded to the CPU); results come back on the input's device. ``all_gather`` exchanges the lengths first,
    pads to the longest and trims, so ranks may pass 1-D tensors of different lengths (including 0).
    """
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
