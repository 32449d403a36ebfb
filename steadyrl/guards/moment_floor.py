"""Second-moment floor (OPEFO, ``guards.opefo.floor``): when many of a tensor's ``exp_avg_sq`` entries underflowed,
give each underflowed entry back a v its first moment can explain (the tensor's median healthy Adam step) and raise
the other live entries below the tensor's 10th percentile to it, so ``lr * m / (sqrt(v) + eps)`` cannot take a huge
step where v is ~0 (docs/DESIGN.md, "OPEFO: second-moment floor").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.optimizer_state import CHUNK, ReduceSum, flat, identity, optimizer_device
from steadyrl.metrics import OPEFO_FLOOR_TRIGGERED, opefo_floor_raised_frac, opefo_floor_value, opefo_tiny_frac
from steadyrl.ranges import Checked, bounded

TINY = 1e-20  # the percentile is taken over the entries above this (the literal p10 over all is ~0 once they are many)
# the percentile is exact up to this many entries per tensor, else taken from a sample of this many drawn with a
# generator seeded with SAMPLE_SEED + step (the same on every replica and after resume)
SAMPLE_SIZE = 65536
SAMPLE_SEED = 0


@dataclass
class FloorConfig(Checked):
    enabled: bool = True
    interval: int = bounded(100, ge=1)
    trigger_frac: float = bounded(0.01, ge=0, lt=1)
    percentile: float = bounded(10.0, gt=0, lt=100)


def _moments(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(exp_avg_sq, exp_avg) of each param of ``group`` that has both moments, in parameter order."""
    out = []
    for p in group["params"]:
        state = optimizer.state.get(p, {})
        v, m = state.get("exp_avg_sq"), state.get("exp_avg")
        if isinstance(v, torch.Tensor) and isinstance(m, torch.Tensor) and v.numel() and m.shape == v.shape:
            out.append((v, m))
    return out


def consistency_bound(beta1: float, beta2: float) -> float:
    """The largest |exp_avg| / sqrt(exp_avg_sq) any gradient history can give Adam's raw moments.

    ``m = (1 - b1) sum_k b1^k g_k`` and ``v = (1 - b2) sum_k b2^k g_k^2``; by Cauchy-Schwarz
    ``|sum b1^k g_k| <= sqrt(sum (b1^2 / b2)^k) sqrt(sum b2^k g_k^2)``, so ``|m| <= C sqrt(v)`` with
    ``C = (1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))`` (7.27 for (0.9, 0.999)). Infinite when ``b1^2 >= b2``."""
    if beta1**2 >= beta2 or beta2 >= 1.0:
        return math.inf
    return (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - beta1**2 / beta2))


def _inconsistent(v: torch.Tensor, m: torch.Tensor, bound: float, eps: float) -> torch.Tensor:
    """Entries whose Adam step |m| / (sqrt(v) + eps) exceeds ``bound``: v too small for m (NaN/inf v: False).

    ``|m| > bound (sqrt(v) + eps)`` is ``v < t^2`` with ``t = |m| / bound - eps > 0``; one temporary, in place."""
    t = m.abs()
    t.div_(bound).sub_(eps).clamp_(min=0).square_()
    return v < t


def _floored(v: torch.Tensor, m: torch.Tensor, value: float, step: float, bound: float, eps: float) -> torch.Tensor:
    """The floor of each entry of a triggered tensor, ``<= v`` where nothing is raised: an underflowed entry gets
    ``max(value, (|m| / step)^2)`` (its next Adam step is the tensor's median healthy ``step``, not ``|m| / eps``);
    another live entry below ``value`` gets ``value``; a never-touched one (m == 0) and NaN/inf stay."""
    live = m != 0
    out = torch.where(live & (v < value), torch.full_like(v, value), v)
    if step > 0:
        estimate = (m.double().abs() / step).square().clamp(min=value).to(v.dtype)
        out = torch.where(live & _inconsistent(v, m, bound, eps), torch.maximum(out, estimate), out)
    return out


class SecondMomentFloor:
    """``maybe_apply(optimizer, step)`` raises underflowed ``exp_avg_sq`` entries to a per-tensor percentile floor.

    The unit is one state tensor (one parameter's ``exp_avg_sq``; under ZeRO-2, this rank's flat fp32 partition of a
    param group). An entry counts as underflowed when ``|m| > C (sqrt(v) + eps)`` (``consistency_bound``). A tensor
    with more than ``trigger_frac`` of its entries underflowed gets its live entries (m != 0) below its own
    ``percentile`` (over its entries above ``TINY``) raised to it, and each underflowed entry raised further to
    ``(|m| / s)^2``, s the median Adam step of its healthy live entries: its next step is a typical one of the tensor
    whatever the spread of v (a percentile alone sits orders of magnitude below most entries where v is spread
    wide, as early in training). Stateless apart from counters; decisions need no
    collective (DDP replicas hold equal states, a ZeRO partition belongs to one rank).
    """

    def __init__(self, config: FloorConfig | None = None, reduce_sum: ReduceSum | None = None) -> None:
        self.config = config or FloorConfig()
        self.reduce_sum = reduce_sum or identity
        self.checks = 0
        self.floored_groups = 0
        self.last_raised = 0  # entries the last check raised (or would have raised, with apply=False)

    def maybe_apply(self, optimizer: torch.optim.Optimizer, step: int, apply: bool = True) -> dict[str, float]:
        """At ``step % interval == 0`` (step > 0): check each state tensor, floor those above ``trigger_frac``.

        Returns ``opefo/floor_triggered`` (groups with a floored tensor), and per group index g
        ``opefo/tiny_frac/<g>`` (underflowed entries / entries, over all ranks), ``opefo/floor_value/<g>`` (the
        lowest floor this rank applied in the group, 0 when none) and ``opefo/floor_raised_frac/<g>``; ``{}`` off
        check steps. ``last_raised``: entries raised, over ranks. ``apply=False`` (observe mode): the same decisions
        and counts, nothing changed. One ``reduce_sum`` per check, on every rank.
        """
        cfg = self.config
        if not cfg.enabled or step <= 0 or step % cfg.interval:
            return {}
        self.checks += 1
        home = optimizer_device(optimizer)
        generator = torch.Generator().manual_seed(SAMPLE_SEED + step)
        # per group: underflowed live entries, entries, entries raised, tensors floored
        totals = torch.zeros(len(optimizer.param_groups), 4, dtype=torch.float64, device=home)
        lowest = [math.inf] * len(optimizer.param_groups)
        with torch.no_grad():
            for i, group in enumerate(optimizer.param_groups):
                beta1, beta2 = group.get("betas", (0.9, 0.999))
                bound = consistency_bound(float(beta1), float(beta2)) * (1.0 + 1e-3)  # margin: float rounding
                eps = float(group.get("eps", 1e-8))
                for v, m in _moments(optimizer, group):
                    pieces = list(zip(flat(v).split(CHUNK), flat(m).split(CHUNK), strict=True))
                    underflowed = sum(int(_inconsistent(pv, pm, bound, eps).count_nonzero()) for pv, pm in pieces)
                    totals[i, 0] += underflowed
                    totals[i, 1] += v.numel()
                    if underflowed <= cfg.trigger_frac * v.numel():
                        continue
                    reference = self._reference(v, m, bound, eps, generator, home)
                    if reference is None:  # no finite entry above tiny in this tensor: nothing to floor to
                        continue
                    value, step = reference
                    for pv, pm in pieces:
                        raised = _floored(pv, pm, value, step, bound, eps)
                        low = raised > pv
                        totals[i, 2] += int(torch.count_nonzero(low))
                        if apply:
                            pv.copy_(torch.where(low, raised.to(pv.dtype), pv))
                    totals[i, 3] += 1
                    lowest[i] = min(lowest[i], value)
        reduced = self.reduce_sum(totals).tolist()
        metrics: dict[str, float] = {}
        floored = 0
        for i, (n_tiny, numel, n_raised, n_tensors) in enumerate(reduced):
            metrics[opefo_tiny_frac(i)] = n_tiny / numel if numel else 0.0
            metrics[opefo_floor_value(i)] = lowest[i] if math.isfinite(lowest[i]) else 0.0
            metrics[opefo_floor_raised_frac(i)] = n_raised / numel if numel else 0.0
            floored += n_tensors > 0
        self.last_raised = round(sum(row[2] for row in reduced))
        if apply:
            self.floored_groups += floored
        metrics[OPEFO_FLOOR_TRIGGERED] = float(floored)
        return metrics

    def _reference(
        self, v: torch.Tensor, m: torch.Tensor, bound: float, eps: float, generator: torch.Generator, home: torch.device
    ) -> tuple[float, float] | None:
        """(the tensor's ``percentile``-th percentile over its finite entries above ``TINY``, linear interpolation;
        the median Adam step ``|m| / (sqrt(v) + eps)`` of its healthy live entries, 0 when it has none): exact up to
        ``SAMPLE_SIZE`` entries, else over a seeded sample of that many; None when no entry is above ``TINY``."""
        if v.numel() <= SAMPLE_SIZE:
            sv, sm = flat(v).to(home, torch.float64), flat(m).to(home, torch.float64)
        else:  # SAMPLE_SIZE entries drawn uniformly with replacement, in index order
            index = torch.randint(0, v.numel(), (SAMPLE_SIZE,), generator=generator).sort().values.to(v.device)
            sv, sm = flat(v)[index].to(home, torch.float64), flat(m)[index].to(home, torch.float64)
        above = torch.isfinite(sv) & (sv > TINY)
        if not bool(above.any()):
            return None
        value = torch.quantile(sv[above], self.config.percentile / 100.0).item()
        healthy = above & torch.isfinite(sm) & (sm != 0) & ~_inconsistent(sv, sm, bound, eps)
        steps = sm[healthy].abs() / (sv[healthy].sqrt() + eps)
        return value, (steps.median().item() if steps.numel() else 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"checks": self.checks, "floored_groups": self.floored_groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checks = int(state["checks"])
        self.floored_groups = int(state["floored_groups"])
