"""Second-moment floor (OPEFO, ``guards.opefo.floor``): when many ``exp_avg_sq`` entries underflowed, raise the ones
below the group's 10th percentile to it, so ``lr * m / (sqrt(v) + eps)`` cannot take a huge step where v is ~0
(docs/DESIGN.md, "OPEFO: second-moment floor"). Pure torch over the optimizer's state; see steadyrl.guards.opefo.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.optimizer_state import CHUNK, AllGather, ReduceSum, flat, group_states, identity, optimizer_device
from steadyrl.metrics import (
    OPEFO_FLOOR_TRIGGERED,
    opefo_floor_raised_frac,
    opefo_floor_value,
    opefo_tiny_frac,
)


@dataclass
class FloorConfig:
    enabled: bool = True
    interval: int = 100
    tiny: float = 1e-20
    trigger_frac: float = 0.01
    percentile: float = 10.0
    sample_size: int = 65536
    seed: int = 0
    exclude_tiny: bool = (
        True  # percentile over entries > tiny (see the module docstring); False: the original rule literally
    )

    def __post_init__(self) -> None:
        problems = []
        if self.interval < 1:
            problems.append(f"interval must be >= 1, got {self.interval}")
        if not (math.isfinite(self.tiny) and self.tiny >= 0):
            problems.append(f"tiny must be finite and >= 0, got {self.tiny}")
        if not 0 <= self.trigger_frac < 1:
            problems.append(f"trigger_frac must be in [0, 1), got {self.trigger_frac}")
        if not 0 < self.percentile < 100:
            problems.append(f"percentile must be in (0, 100), got {self.percentile}")
        if self.sample_size < 1:
            problems.append(f"sample_size must be >= 1, got {self.sample_size}")
        if problems:
            raise ValueError("invalid FloorConfig: " + "; ".join(problems))


class SecondMomentFloor:
    """``maybe_apply(optimizer, step)`` raises underflowed ``exp_avg_sq`` entries to a percentile floor, in place.

    Stateless between calls apart from counters (the sample depends only on ``seed + step``).
    """

    def __init__(
        self,
        config: FloorConfig | None = None,
        reduce_sum: ReduceSum | None = None,
        all_gather: AllGather | None = None,
    ) -> None:
        self.config = config or FloorConfig()
        self.reduce_sum = reduce_sum or identity
        self.all_gather = all_gather or identity
        self.checks = 0
        self.floored_groups = 0
        self.last_raised = 0  # entries the last check raised (or would have raised, with apply=False)

    def maybe_apply(self, optimizer: torch.optim.Optimizer, step: int, apply: bool = True) -> dict[str, float]:
        """At ``step % interval == 0`` (step > 0): check each group, floor those above ``trigger_frac``.

        Returns ``opefo/floor_triggered`` (groups floored), and per group index g ``opefo/tiny_frac/<g>``,
        ``opefo/floor_value/<g>`` (0 when not floored) and ``opefo/floor_raised_frac/<g>`` (entries changed);
        ``{}`` when this step is not a check step. ``last_raised`` holds the number of entries raised (all ranks).
        ``apply=False`` (observe mode): the same decision and counts, but no entry is changed and the
        ``floored_groups`` total stays.
        """
        cfg = self.config
        if not cfg.enabled or step <= 0 or step % cfg.interval:
            return {}
        self.checks += 1
        home = optimizer_device(optimizer)
        groups = [group_states(optimizer, g, "exp_avg_sq") for g in optimizer.param_groups]
        with torch.no_grad():
            # 1) global count of tiny entries and numel per group: one all-reduce of (num_groups, 2)
            counts = torch.zeros(len(groups), 2, dtype=torch.float64, device=home)
            for i, states in enumerate(groups):
                tiny = torch.zeros((), dtype=torch.int64, device=home)
                for v in states:
                    for piece in flat(v).split(CHUNK):
                        tiny += torch.count_nonzero(piece <= cfg.tiny).to(home)
                counts[i, 0] = tiny
                counts[i, 1] = float(sum(v.numel() for v in states))
            counts_list = self.reduce_sum(counts).tolist()

            # 2) percentile of each triggered group (same on every rank), then the in-place floor
            metrics: dict[str, float] = {}
            generator = torch.Generator().manual_seed(cfg.seed + step)
            floored: list[int] = []
            raised = []
            for i, states in enumerate(groups):
                n_tiny, numel = counts_list[i]
                frac = n_tiny / numel if numel else 0.0
                metrics[opefo_tiny_frac(i)] = frac
                metrics[opefo_floor_value(i)] = 0.0
                metrics[opefo_floor_raised_frac(i)] = 0.0
                if frac <= cfg.trigger_frac:
                    continue
                value = self._percentile(states, int(numel), generator, home)
                if value is None:  # no finite (above-tiny) entry anywhere: nothing to floor to
                    continue
                count = torch.zeros((), dtype=torch.int64, device=home)
                for v in states:
                    for piece in flat(v).split(CHUNK):
                        count += torch.count_nonzero(piece < value).to(home)
                    if apply:
                        v.clamp_(min=value)
                floored.append(i)
                raised.append(count.to(torch.float64))
                metrics[opefo_floor_value(i)] = value
            self.last_raised = 0
            if floored:
                raised_list = self.reduce_sum(torch.stack(raised)).tolist()
                for i, n in zip(floored, raised_list, strict=True):
                    metrics[opefo_floor_raised_frac(i)] = n / counts_list[i][1]
                self.last_raised = round(sum(raised_list))
        if apply:
            self.floored_groups += len(floored)
        metrics[OPEFO_FLOOR_TRIGGERED] = float(len(floored))
        return metrics

    def _percentile(
        self, states: list[torch.Tensor], global_numel: int, generator: torch.Generator, home: torch.device
    ) -> float | None:
        """The group's ``percentile``-th percentile (linear interpolation) of the gathered sample; None if empty."""
        cfg = self.config
        local = sum(v.numel() for v in states)
        if global_numel <= cfg.sample_size:  # small group: every entry, exact
            parts = [flat(v).to(home, torch.float64) for v in states]
        else:  # this rank's share of the sample, in proportion to its numel
            share = min(local, round(cfg.sample_size * local / global_numel))
            parts = self._sample(states, share, generator, home)
        sample = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=home)
        keep = torch.isfinite(sample)
        if cfg.exclude_tiny:
            keep &= sample > cfg.tiny
        gathered = self.all_gather(sample[keep])
        if gathered.numel() == 0:
            return None
        return torch.quantile(gathered, cfg.percentile / 100.0).item()

    @staticmethod
    def _sample(
        states: list[torch.Tensor], k: int, generator: torch.Generator, home: torch.device
    ) -> list[torch.Tensor]:
        """k entries drawn uniformly with replacement over the concatenation of ``states``, as float64."""
        if k <= 0:
            return []
        sizes = torch.tensor([v.numel() for v in states], dtype=torch.int64)
        ends = sizes.cumsum(0)
        index = torch.randint(0, int(ends[-1]), (k,), generator=generator).sort().values
        owner = torch.searchsorted(ends, index, right=True)
        per_tensor = torch.bincount(owner, minlength=len(states)).tolist()
        parts = []
        for v, start, idx in zip(states, (ends - sizes).tolist(), index.split(per_tensor), strict=True):
            if idx.numel():
                parts.append(flat(v)[(idx - start).to(v.device)].to(home, torch.float64))
        return parts

    def state_dict(self) -> dict[str, Any]:
        return {"checks": self.checks, "floored_groups": self.floored_groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checks = int(state["checks"])
        self.floored_groups = int(state["floored_groups"])
