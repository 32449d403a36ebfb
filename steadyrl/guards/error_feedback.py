"""Error feedback (OPEFO, ``guards.opefo.error_feedback``): the gradient of a skipped step is kept and fed back over
the next taken steps, each piece rescaled to the current gradient's norm (docs/DESIGN.md, "OPEFO: error feedback").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.optimizer_state import ReduceSum, first_device, identity, slot_squares
from steadyrl.guards.rollback import cpu_copy
from steadyrl.metrics import OPEFO_EF_INJECTED_NORM, OPEFO_EF_PENDING, OPEFO_EF_WEIGHT
from steadyrl.ranges import Checked, bounded


@dataclass
class ErrorFeedbackConfig(Checked):
    enabled: bool = False  # off by default: docs/DESIGN.md, "OPEFO: error feedback"
    weights: tuple[float, ...] = bounded((0.3, 0.3, 0.2, 0.2), gt=0, finite=True, min_len=1)

    def __post_init__(self) -> None:
        self.weights = tuple(float(w) for w in self.weights)
        super().__post_init__()
        if abs(sum(self.weights) - 1.0) > 1e-6:
            raise ValueError(
                f"invalid ErrorFeedbackConfig: weights must sum to 1 (+-1e-6), got {list(self.weights)} "
                f"(sum {sum(self.weights)!r})"
            )


class ErrorFeedback:
    """Feeds a skipped step's gradient back over the next taken steps (``store`` on a skip, ``apply`` per step).

    ``gradients``: this rank's tensors (or None) in a fixed order. Call ``apply`` only for taken steps, after the
    skip decision and before gradient clipping. State is per rank."""

    def __init__(self, config: ErrorFeedbackConfig | None = None, reduce_sum: ReduceSum | None = None) -> None:
        self.config = config or ErrorFeedbackConfig()
        self.reduce_sum = reduce_sum or identity
        self._residual: list[torch.Tensor | None] | None = None
        self._slot_sq: torch.Tensor | None = None  # local squared norm per slot, float64
        self._norm = 0.0  # global ||r||
        self._position = 0  # index of the next weight
        self.stored = self.merged = self.rejected_nonfinite = self.rejected_zero = self.deferred = self.completed = 0

    @property
    def pending(self) -> bool:
        return self._residual is not None

    def _global_sq(self, slot_sq: torch.Tensor) -> float:
        return self.reduce_sum(slot_sq.sum().reshape(1)).item()

    def store(self, gradients: list[torch.Tensor | None]) -> bool:
        """Keep the gradients of a skipped step as the residual; returns whether a residual is now pending anew.
        Non-finite or all-zero gradients are not stored (a pending residual keeps its schedule)."""
        if not self.config.enabled:
            return False
        home = first_device(gradients)
        with torch.no_grad():
            slot_sq = slot_squares(gradients, home)
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
        slot_sq = slot_squares(residual, home)
        total = self._global_sq(slot_sq)
        if not math.isfinite(total) or total == 0.0:  # the two directions cancelled exactly: nothing left
            self.clear()
            self.rejected_zero += 1
            return
        self._slot_sq, self._norm = slot_sq, math.sqrt(total)

    def apply(self, gradients: list[torch.Tensor | None]) -> dict[str, float]:
        """If a residual is pending: ``g += w_k * ||g|| * r / ||r||`` in place (global norms), k += 1.

        Returns ``opefo/ef_pending``, ``opefo/ef_weight`` (w_k used, 0 when none) and ``opefo/ef_injected_norm``
        (global norm of what was added). When ||g|| is 0 or not finite nothing is added and k stays (``deferred``).
        Slots whose gradient (or stored residual) is None are left out.
        """
        out = {OPEFO_EF_PENDING: 0.0, OPEFO_EF_WEIGHT: 0.0, OPEFO_EF_INJECTED_NORM: 0.0}
        residual = self._residual
        if not self.config.enabled or residual is None:
            return out
        self._check_slots(gradients)
        out[OPEFO_EF_PENDING] = 1.0
        home = first_device(gradients)
        with torch.no_grad():
            present = torch.tensor(
                [g is not None and r is not None for g, r in zip(gradients, residual, strict=True)], device=home
            )
            assert self._slot_sq is not None
            r_sq = torch.where(present, self._slot_sq.to(home), 0.0).sum()
            g_total, r_total = self.reduce_sum(torch.stack([slot_squares(gradients, home).sum(), r_sq])).tolist()
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
            self.clear()
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

    def clear(self) -> None:
        """Drop a pending residual (e.g. after a rollback: it belongs to the state that was abandoned)."""
        self._residual, self._slot_sq, self._norm, self._position = None, None, 0.0, 0

    def state_dict(self) -> dict[str, Any]:
        """Pending residual (CPU copies), its position and norm, counters."""
        return {
            "version": 1,
            "weights": list(self.config.weights),
            "position": self._position,
            "norm": self._norm,
            "residual": cpu_copy(self._residual),
            "slot_sq": cpu_copy(self._slot_sq),
            "counters": {name: getattr(self, name) for name in _EF_COUNTERS},
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | str | None = None) -> None:
        """Restore; tensors go to ``device`` (None: the CPU, until the first store/apply moves them). A residual
        past the end of the configured weights is dropped."""
        for name in _EF_COUNTERS:
            setattr(self, name, int(state["counters"][name]))
        self.clear()
        if state["residual"] is None or int(state["position"]) >= len(self.config.weights):
            return
        target = torch.device(device) if device is not None else torch.device("cpu")
        self._residual = [None if r is None else r.to(target, copy=True) for r in state["residual"]]
        self._slot_sq = state["slot_sq"].to(target, copy=True)
        self._norm = float(state["norm"])
        self._position = int(state["position"])


_EF_COUNTERS = ("stored", "merged", "rejected_nonfinite", "rejected_zero", "deferred", "completed")
