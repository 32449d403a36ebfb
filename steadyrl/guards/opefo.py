"""OPEFO optimizer-state protection (design note seed 000 §3.2, §6.3): pure torch over an optimizer's state.

Works on any ``torch.optim.Optimizer`` whose state holds ``exp_avg``/``exp_avg_sq`` (torch AdamW; under DeepSpeed
ZeRO-2 pass the base optimizer, whose params are one flat fp32 partition per param group, a different slice on each
rank). Nothing here knows about processes: every cross-rank operation goes through two injected callables,
``reduce_sum(t) -> t summed over ranks`` and ``all_gather(t) -> 1-D tensors of any lengths concatenated in rank
order``, both the identity by default (one process). ``distributed_ops()`` builds them from ``torch.distributed``.
Every collective is called the same number of times on every rank, with tensors on the device of the optimizer
state (or of the gradients); every decision comes from reduced values, so all ranks decide the same.

Three pieces, with the seed's numbers as defaults:

1. ``SecondMomentFloor``: every ``interval`` = 100 steps, per param group, the global fraction of ``exp_avg_sq``
   entries ``<= tiny`` (1e-20). Above ``trigger_frac`` = 1 %, every entry below the group's p10 is raised to p10,
   so ``lr * m / (sqrt(v) + eps)`` cannot take a huge step where v underflowed. The percentile comes from a
   random sample of ``sample_size`` = 65536 entries (a ``torch.Generator`` seeded with ``seed + step``: the same
   on every rank and after resume), each rank drawing its share in proportion to its local numel and
   ``all_gather`` joining them; a group with at most ``sample_size`` entries uses all of them (exact). Accuracy:
   for n iid draws the rank of the sample p-quantile has standard deviation sqrt(p(1-p)/n); p = 0.1, n = 65536
   gives 0.00117, so the floor sits at the 10th percentile +-0.12 percentile points (1 sigma). Deviation from the
   seed, on by default (``exclude_tiny``): the percentile is taken over the entries above ``tiny`` (finite ones),
   because the seed's literal p10 over all entries is itself ~0 once more than 10 % underflowed, which switches
   the floor off exactly when it is most needed; ``exclude_tiny=False`` gives the literal rule.
2. ``ErrorFeedback``: the gradient of a step GEPO skipped is kept as a residual r and fed back over the next 4
   taken steps with weights 0.3, 0.3, 0.2, 0.2, each piece renormalised to the current gradient's scale:
   ``g += w_k * ||g|| * r / ||r||`` (global norms), so a norm-20 residual cannot become a new spike in a norm-2
   gradient. Only r's direction is used. A second skip while r is pending merges: the not-yet-injected fraction R
   of the old direction plus the new one, ``r <- R * r_old / ||r_old|| + g_new / ||g_new||``, computed in place,
   and the 4-step schedule restarts. Why merge, not replace: replacing drops the old, not-yet-injected signal for
   no reason; merging keeps both directions, each in proportion to what it had left, while every injected piece
   stays at most ``w_k * ||g||`` (the safety bound), at the price that the total fed back is 1 ||g|| rather than
   R + 1. Memory: one copy of this rank's gradients in their own dtype while pending (all trainable parameters
   under DDP, e.g. 28 GB for 7B fp32 grads; this rank's 1/world partition under ZeRO-2); nothing otherwise.
3. Rollback support: ``optimizer_state_finite`` (one ``aminmax`` per state tensor, reduced over ranks),
   ``SnapshotStore`` (a healthy snapshot every ``snapshot_interval`` = 500 steps, in memory or on disk written
   to a temp file and ``os.replace``d, seed §6.3), and ``RollbackPolicy`` (after a rollback the learning rate is
   scaled by 0.3 for 100 steps; more than ``max_rollbacks`` within ``rollback_window`` steps stops the run).

What this simplifies or leaves out: the floor treats a ZeRO-2 partition's alignment padding (a few zero entries)
as ordinary entries; its sample is drawn with replacement; NaN/inf state entries are neither counted, sampled nor
repaired (that is the rollback's job) and stay NaN/inf. Error feedback never offloads its residual to the CPU,
and a gradient norm whose sum of squares overflows counts as non-finite. Deciding *when* to skip, check, snapshot
or roll back, and restoring the payload into model/optimizer/scheduler, is the trainer's job.
"""

from __future__ import annotations

import copy
import math
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from steadyrl.metrics import (
    OPEFO_EF_INJECTED_NORM,
    OPEFO_EF_PENDING,
    OPEFO_EF_WEIGHT,
    OPEFO_FLOOR_TRIGGERED,
    opefo_floor_raised_frac,
    opefo_floor_value,
    opefo_tiny_frac,
)

ReduceSum = Callable[[torch.Tensor], torch.Tensor]
AllGather = Callable[[torch.Tensor], torch.Tensor]

_CHUNK = 1 << 22  # entries per piece of an elementwise pass: a bool temporary of at most 4 MiB


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


def _optimizer_device(optimizer: torch.optim.Optimizer, keys: Iterable[str] = ("exp_avg_sq",)) -> torch.device:
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


def _group_states(optimizer: torch.optim.Optimizer, group: dict[str, Any], key: str) -> list[torch.Tensor]:
    """The ``key`` state tensors of one param group, in parameter order; params without that state are skipped."""
    out = []
    for p in group["params"]:
        t = optimizer.state.get(p, {}).get(key)
        if isinstance(t, torch.Tensor) and t.numel():
            out.append(t)
    return out


def _slot_squares(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Local squared L2 norm of each entry (0 for None), float64 (len(tensors),) on ``device``."""
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    for i, t in enumerate(tensors):
        if t is not None and t.numel():
            low = t.dtype in (torch.bfloat16, torch.float16)
            out[i] = torch.linalg.vector_norm(t, dtype=torch.float32 if low else None).to(device, torch.float64) ** 2
    return out


def _first_device(tensors: Sequence[torch.Tensor | None]) -> torch.device:
    return next((t.device for t in tensors if t is not None), torch.device("cpu"))


# ---------------------------------------------------------------------------------------- second-moment floor


@dataclass
class FloorConfig:
    enabled: bool = True
    interval: int = 100
    tiny: float = 1e-20
    trigger_frac: float = 0.01
    percentile: float = 10.0
    sample_size: int = 65536
    seed: int = 0
    exclude_tiny: bool = True  # percentile over entries > tiny (see the module docstring); False: the seed literally

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
        self.reduce_sum = reduce_sum or _identity
        self.all_gather = all_gather or _identity
        self.checks = 0
        self.floored_groups = 0

    def maybe_apply(self, optimizer: torch.optim.Optimizer, step: int) -> dict[str, float]:
        """At ``step % interval == 0`` (step > 0): check each group, floor those above ``trigger_frac``.

        Returns ``opefo/floor_triggered`` (groups floored), and per group index g ``opefo/tiny_frac/<g>``,
        ``opefo/floor_value/<g>`` (0 when not floored) and ``opefo/floor_raised_frac/<g>`` (entries changed);
        ``{}`` when this step is not a check step.
        """
        cfg = self.config
        if not cfg.enabled or step <= 0 or step % cfg.interval:
            return {}
        self.checks += 1
        home = _optimizer_device(optimizer)
        groups = [_group_states(optimizer, g, "exp_avg_sq") for g in optimizer.param_groups]
        with torch.no_grad():
            # 1) global count of tiny entries and numel per group: one all-reduce of (num_groups, 2)
            counts = torch.zeros(len(groups), 2, dtype=torch.float64, device=home)
            for i, states in enumerate(groups):
                tiny = torch.zeros((), dtype=torch.int64, device=home)
                for v in states:
                    for piece in _flat(v).split(_CHUNK):
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
                    for piece in _flat(v).split(_CHUNK):
                        count += torch.count_nonzero(piece < value).to(home)
                    v.clamp_(min=value)
                floored.append(i)
                raised.append(count.to(torch.float64))
                metrics[opefo_floor_value(i)] = value
            if floored:
                raised_list = self.reduce_sum(torch.stack(raised)).tolist()
                for i, n in zip(floored, raised_list, strict=True):
                    metrics[opefo_floor_raised_frac(i)] = n / counts_list[i][1]
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
            parts = [_flat(v).to(home, torch.float64) for v in states]
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
                parts.append(_flat(v)[(idx - start).to(v.device)].to(home, torch.float64))
        return parts

    def state_dict(self) -> dict[str, Any]:
        return {"checks": self.checks, "floored_groups": self.floored_groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checks = int(state["checks"])
        self.floored_groups = int(state["floored_groups"])


# ---------------------------------------------------------------------------------------------- error feedback


@dataclass
class ErrorFeedbackConfig:
    enabled: bool = True
    weights: tuple[float, ...] = (0.3, 0.3, 0.2, 0.2)

    def __post_init__(self) -> None:
        self.weights = tuple(float(w) for w in self.weights)
        problems = []
        if not self.weights:
            problems.append("weights must not be empty")
        elif not all(math.isfinite(w) and w > 0 for w in self.weights):
            problems.append(f"weights must all be > 0, got {list(self.weights)}")
        elif abs(sum(self.weights) - 1.0) > 1e-6:
            problems.append(f"weights must sum to 1 (+-1e-6), got {list(self.weights)} (sum {sum(self.weights)!r})")
        if problems:
            raise ValueError("invalid ErrorFeedbackConfig: " + "; ".join(problems))


class ErrorFeedback:
    """Feeds a skipped step's gradient back over the next taken steps (``store`` on a skip, ``apply`` per step).

    ``gradients`` are this rank's tensors in a fixed order (full gradients under one process or DDP, this rank's
    partitions under ZeRO-2); ``None`` entries are allowed. Call ``apply`` only for steps that are taken, after
    the skip decision (so the injection cannot itself trigger a skip) and before gradient clipping. State is per
    rank: under ZeRO-2 save it per rank.
    """

    def __init__(self, config: ErrorFeedbackConfig | None = None, reduce_sum: ReduceSum | None = None) -> None:
        self.config = config or ErrorFeedbackConfig()
        self.reduce_sum = reduce_sum or _identity
        self._residual: list[torch.Tensor | None] | None = None
        self._slot_sq: torch.Tensor | None = None  # local squared norm per slot, float64
        self._norm = 0.0  # global ||r||
        self._position = 0  # index of the next weight
        self.stored = 0
        self.merged = 0
        self.rejected_nonfinite = 0
        self.rejected_zero = 0
        self.deferred = 0
        self.completed = 0

    @property
    def pending(self) -> bool:
        return self._residual is not None

    @property
    def position(self) -> int:
        return self._position

    def _global_sq(self, slot_sq: torch.Tensor) -> float:
        return self.reduce_sum(slot_sq.sum().reshape(1)).item()

    def store(self, gradients: list[torch.Tensor | None]) -> bool:
        """Keep the gradients of a skipped step as the residual; returns whether a residual is now pending anew.

        Non-finite anywhere (the global sum of squares is NaN/inf on every rank then): nothing stored, counted in
        ``rejected_nonfinite``, a pending residual keeps its schedule. All-zero: nothing stored (no direction).
        """
        if not self.config.enabled:
            return False
        home = _first_device(gradients)
        with torch.no_grad():
            slot_sq = _slot_squares(gradients, home)
            total = self._global_sq(slot_sq)
            if not math.isfinite(total):
                self.rejected_nonfinite += 1
                return False
            if total == 0.0:
                self.rejected_zero += 1
                return False
            if self._residual is None:
                self._residual = [None if g is None else g.detach().clone() for g in gradients]
                self._slot_sq, self._norm = slot_sq, math.sqrt(total)
            else:
                self._merge(gradients, math.sqrt(total), home)
                if self._residual is None:
                    return False
            self._position = 0
            self.stored += 1
        return True

    def _merge(self, gradients: list[torch.Tensor | None], norm: float, home: torch.device) -> None:
        """r <- R * r / ||r|| + g / ||g|| in place (R = the weight not yet injected); schedule restarts."""
        residual = self._residual
        assert residual is not None
        self._check_slots(gradients)
        old_scale = sum(self.config.weights[self._position :]) / self._norm
        for i, (r, g) in enumerate(zip(residual, gradients, strict=True)):
            if g is None:
                if r is not None:
                    r.mul_(old_scale)
                continue
            g = g.detach()
            if r is None:
                residual[i] = g / norm
                continue
            if r.device != g.device:
                r = residual[i] = r.to(g.device)
            r.mul_(old_scale).add_(g, alpha=1.0 / norm)
        self.merged += 1
        slot_sq = _slot_squares(residual, home)
        total = self._global_sq(slot_sq)
        if not math.isfinite(total) or total == 0.0:  # the two directions cancelled exactly: nothing left
            self._free()
            self.rejected_zero += 1
            return
        self._slot_sq, self._norm = slot_sq, math.sqrt(total)

    def apply(self, gradients: list[torch.Tensor | None]) -> dict[str, float]:
        """If a residual is pending: ``g += w_k * ||g|| * r / ||r||`` in place (global norms), k += 1.

        Returns ``opefo/ef_pending`` (1 when a residual was pending at this call), ``opefo/ef_weight`` (w_k used,
        0 when none) and ``opefo/ef_injected_norm`` (global norm of what was added). When ||g|| is 0 or not finite
        nothing is added and k stays (the schedule is delayed to the next taken step, never lost); counted in
        ``deferred``. Slots whose gradient (or stored residual) is None are left out.
        """
        out = {OPEFO_EF_PENDING: 0.0, OPEFO_EF_WEIGHT: 0.0, OPEFO_EF_INJECTED_NORM: 0.0}
        residual = self._residual
        if not self.config.enabled or residual is None:
            return out
        self._check_slots(gradients)
        out[OPEFO_EF_PENDING] = 1.0
        home = _first_device(gradients)
        with torch.no_grad():
            present = torch.tensor(
                [g is not None and r is not None for g, r in zip(gradients, residual, strict=True)], device=home
            )
            assert self._slot_sq is not None
            r_sq = torch.where(present, self._slot_sq.to(home), 0.0).sum()
            g_total, r_total = self.reduce_sum(torch.stack([_slot_squares(gradients, home).sum(), r_sq])).tolist()
            g_norm = math.sqrt(g_total) if g_total >= 0 else float("nan")
            if not math.isfinite(g_norm) or g_norm == 0.0:
                self.deferred += 1
                return out
            weight = self.config.weights[self._position]
            scale = weight * g_norm / self._norm
            for i, (g, r) in enumerate(zip(gradients, residual, strict=True)):
                if g is None or r is None:
                    continue
                if r.device != g.device:
                    r = residual[i] = r.to(g.device)
                g.add_(r, alpha=scale)
        self._position += 1
        if self._position >= len(self.config.weights):
            self._free()
            self.completed += 1
        out[OPEFO_EF_WEIGHT] = weight
        out[OPEFO_EF_INJECTED_NORM] = scale * math.sqrt(r_total)
        return out

    def _check_slots(self, gradients: list[torch.Tensor | None]) -> None:
        residual = self._residual or []
        if len(gradients) != len(residual):
            raise ValueError(
                f"error feedback got {len(gradients)} gradients but holds a residual of {len(residual)}: "
                "pass the same parameters, in the same order, on every call"
            )
        for i, (g, r) in enumerate(zip(gradients, residual, strict=True)):
            if g is not None and r is not None and g.shape != r.shape:
                raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, the residual {tuple(r.shape)}")

    def _free(self) -> None:
        self._residual, self._slot_sq, self._norm, self._position = None, None, 0.0, 0

    def clear(self) -> None:
        """Drop a pending residual (e.g. after a rollback: it belongs to the state that was abandoned)."""
        self._free()

    def state_dict(self) -> dict[str, Any]:
        """Pending residual (CPU copies), its position and norm, counters."""

        def cpu(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to("cpu", copy=True)

        return {
            "version": 1,
            "weights": list(self.config.weights),
            "position": self._position,
            "norm": self._norm,
            "residual": None if self._residual is None else [cpu(r) for r in self._residual],
            "slot_sq": cpu(self._slot_sq),
            "counters": {name: getattr(self, name) for name in _EF_COUNTERS},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None) -> None:
        """Restore; tensors go to ``device`` now, or (None) stay on the CPU until the first store/apply moves them.

        If the configured weights are shorter than the saved position the residual is dropped.
        """
        for name in _EF_COUNTERS:
            setattr(self, name, int(state["counters"][name]))
        self._free()
        if state["residual"] is None or int(state["position"]) >= len(self.config.weights):
            return
        target = torch.device(device) if device is not None else torch.device("cpu")
        self._residual = [None if r is None else r.to(target, copy=True) for r in state["residual"]]
        self._slot_sq = state["slot_sq"].to(target, copy=True)
        self._norm = float(state["norm"])
        self._position = int(state["position"])


_EF_COUNTERS = ("stored", "merged", "rejected_nonfinite", "rejected_zero", "deferred", "completed")


# -------------------------------------------------------------------------------------------- rollback support


def optimizer_state_finite(
    optimizer: torch.optim.Optimizer,
    keys: Sequence[str] = ("exp_avg", "exp_avg_sq"),
    reduce_sum: ReduceSum | None = None,
) -> bool:
    """True when every ``keys`` state tensor is finite on every rank: one ``aminmax`` per tensor, no copies, one
    all-reduce of the count of bad tensors, one host sync."""
    home = _optimizer_device(optimizer, keys)
    bad = torch.zeros(1, dtype=torch.float64, device=home)
    with torch.no_grad():
        for state in optimizer.state.values():
            for key in keys:
                t = state.get(key)
                if isinstance(t, torch.Tensor) and t.numel():
                    lo, hi = torch.aminmax(t)  # NaN propagates into both, +-inf into one of them
                    bad += (~(torch.isfinite(lo) & torch.isfinite(hi))).to(home, torch.float64)
        return (reduce_sum or _identity)(bad).item() == 0


STORAGES = ("memory", "disk")


@dataclass
class RollbackConfig:
    enabled: bool = True
    snapshot_interval: int = 500
    storage: str = "memory"
    snapshot_dir: str | None = None  # disk storage: base directory; the caller adds one folder per rank
    check_interval: int = 10
    recovery_lr_factor: float = 0.3
    recovery_steps: int = 100
    max_rollbacks: int = 3
    rollback_window: int = 1000

    def __post_init__(self) -> None:
        problems = []
        if self.snapshot_interval < 1:
            problems.append(f"snapshot_interval must be >= 1, got {self.snapshot_interval}")
        if self.storage not in STORAGES:
            problems.append(f"storage must be one of {', '.join(STORAGES)}, got {self.storage!r}")
        if self.check_interval < 1:
            problems.append(f"check_interval must be >= 1, got {self.check_interval}")
        if not 0 < self.recovery_lr_factor <= 1:
            problems.append(f"recovery_lr_factor must be in (0, 1], got {self.recovery_lr_factor}")
        if self.recovery_steps < 0:
            problems.append(f"recovery_steps must be >= 0, got {self.recovery_steps}")
        if self.max_rollbacks < 0:
            problems.append(f"max_rollbacks must be >= 0, got {self.max_rollbacks}")
        if self.rollback_window < 1:
            problems.append(f"rollback_window must be >= 1, got {self.rollback_window}")
        if problems:
            raise ValueError("invalid RollbackConfig: " + "; ".join(problems))


def _cpu_copy(obj: Any) -> Any:
    """Deep copy of a nested payload with every tensor cloned onto the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, _cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class SnapshotStore:
    """The latest healthy snapshot: ``save(step, payload)``, ``load() -> (step, payload)``, ``latest_step``, ``clear``.

    ``payload`` is a nested dict of tensors and Python objects (trainable weights, optimizer state_dict, scheduler
    state, RNG states, guard states). ``memory`` keeps a CPU deep copy and ``load`` returns a fresh copy each time
    (``Optimizer.load_state_dict`` keeps same-device tensors by reference, which would let training overwrite the
    snapshot). ``disk`` writes ``snapshot-<step>.pt`` through a temp file and ``os.replace`` in the same folder, so
    a crash mid-write leaves the previous snapshot intact, then deletes older ones; a store opened on a folder
    that already holds a snapshot sees it (``clear()`` it when stale, e.g. after resuming from an earlier
    checkpoint). Under ZeRO-2 every rank holds a different partition: give each rank its own directory.
    Cost: a full copy of the payload per rank (host RAM for ``memory``; for 7B under DDP about 28 GB of fp32
    weights + 56 GB of Adam moments), so big models want ``disk``.
    """

    _NAME = re.compile(r"^snapshot-(\d+)\.pt$")

    def __init__(self, storage: str = "memory", directory: str | os.PathLike[str] | None = None) -> None:
        if storage not in STORAGES:
            raise ValueError(f"snapshot storage must be one of {', '.join(STORAGES)}, got {storage!r}")
        if storage == "disk" and directory is None:
            raise ValueError("snapshot storage 'disk' needs a directory (one per rank)")
        self.storage = storage
        self.directory = Path(directory) if directory is not None else None
        self._memory: tuple[int, Any] | None = None

    def _files(self) -> list[tuple[int, Path]]:
        assert self.directory is not None
        if not self.directory.is_dir():
            return []
        found = [(self._NAME.match(p.name), p) for p in self.directory.iterdir()]
        return sorted((int(m.group(1)), p) for m, p in found if m)

    @property
    def latest_step(self) -> int | None:
        if self.storage == "memory":
            return None if self._memory is None else self._memory[0]
        files = self._files()
        return files[-1][0] if files else None

    def save(self, step: int, payload: dict[str, Any]) -> None:
        if self.storage == "memory":
            self._memory = (int(step), _cpu_copy(payload))
            return
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".snapshot-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save({"version": 1, "step": int(step), "payload": payload}, f)
                f.flush()
                os.fsync(f.fileno())
            final = self.directory / f"snapshot-{int(step):012d}.pt"
            os.replace(tmp, final)  # atomic on POSIX within one filesystem
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for _, path in self._files():
            if path != final:
                path.unlink(missing_ok=True)

    def load(self) -> tuple[int, dict[str, Any]]:
        if self.storage == "memory":
            if self._memory is None:
                raise LookupError("no snapshot has been saved in memory yet")
            return self._memory[0], _cpu_copy(self._memory[1])
        files = self._files()
        if not files:
            raise LookupError(f"no snapshot in {self.directory}")
        # weights_only=False: our own file, and payloads hold numpy RNG states
        data = torch.load(files[-1][1], map_location="cpu", weights_only=False)
        return int(data["step"]), data["payload"]

    def clear(self) -> None:
        self._memory = None
        if self.storage == "disk" and self.directory is not None and self.directory.is_dir():
            for path in self.directory.iterdir():
                if self._NAME.match(path.name) or (path.name.startswith(".snapshot-") and path.suffix == ".tmp"):
                    path.unlink(missing_ok=True)


class RollbackLimitError(RuntimeError):
    """Rollbacks keep happening: restoring the snapshot does not remove the cause."""


class RollbackPolicy:
    """Counts rollbacks, sets the recovery learning-rate factor, stops the run after too many in a window.

    ``step`` is the optimizer-step counter the trainer continues from after the rollback (the same counter is
    then passed to ``lr_factor``/``recovery_active``).
    """

    def __init__(self, config: RollbackConfig | None = None) -> None:
        self.config = config or RollbackConfig()
        self.rollbacks = 0
        self.last_step: int | None = None
        self.recent: list[tuple[int, str]] = []  # (step, cause) within rollback_window of the latest rollback

    def record(self, step: int, cause: str) -> None:
        """Register a rollback at ``step``; raises RollbackLimitError when more than ``max_rollbacks`` rollbacks
        fall within the last ``rollback_window`` steps (this one included)."""
        cfg = self.config
        self.rollbacks += 1
        self.last_step = int(step)
        self.recent = [(s, c) for s, c in self.recent if step - s < cfg.rollback_window] + [(int(step), cause)]
        if len(self.recent) > cfg.max_rollbacks:
            steps = ", ".join(str(s) for s, _ in self.recent)
            raise RollbackLimitError(
                f"step {step}: rollback #{self.rollbacks} (cause: {cause}) makes {len(self.recent)} rollbacks within "
                f"{cfg.rollback_window} steps (at steps {steps}; max_rollbacks={cfg.max_rollbacks}). "
                "Restoring the last snapshot does not remove the cause: check the rewards, log-probs and loss for "
                "NaN/inf, lower the learning rate, or resume from an earlier checkpoint with another seed"
            )

    def recovery_active(self, step: int) -> bool:
        return self.config.enabled and self.last_step is not None and step < self.last_step + self.config.recovery_steps

    def lr_factor(self, step: int) -> float:
        """``recovery_lr_factor`` during the recovery period after the last rollback, else 1.0."""
        return self.config.recovery_lr_factor if self.recovery_active(step) else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": self.rollbacks, "last_step": self.last_step, "recent": [list(r) for r in self.recent]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks = int(state["rollbacks"])
        self.last_step = None if state["last_step"] is None else int(state["last_step"])
        self.recent = [(int(s), str(c)) for s, c in state["recent"]]


@dataclass
class OpefoConfig:
    enabled: bool = False
    floor: FloorConfig = field(default_factory=FloorConfig)
    error_feedback: ErrorFeedbackConfig = field(default_factory=ErrorFeedbackConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)


# ------------------------------------------------------------------------------------------ torch.distributed


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
