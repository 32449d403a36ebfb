"""What a guard runtime may use of the running trainer: metrics, events, a timer, collectives, the step, the rank.

Runtimes (``quatro_runtime``, ``opefo_runtime``, ``step_gate``) get a ``RuntimeContext`` instead of the trainer.
They read nothing else of it and write nothing into it: what should change in TRL's state (a KL factor, the
entropy coefficient, the clip range, an LR factor) they return, and the trainer writes it (``trl_state``).
Tests hand them a fake context (``tests/unit/test_runtimes.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _same(objects: list[Any]) -> list[Any]:
    return list(objects)


@dataclass
class RuntimeContext:
    """The narrow view of a trainer. The defaults are a single process that logs nowhere (for tests).

    log_metric(name, value): averaged over the logging interval and logged with TRL's metrics.
    emit_event(kind, step=None, **fields): a discrete event for callbacks that record them (``MetricsLog``);
        ``step`` defaults to the current ``global_step``.
    reduce_sum / gather / gather_object: collectives over all ranks (identity on one process: the trainer passes
        the identity itself there, so a guard pays nothing for a collective that moves nothing).
    global_step(): optimizer steps done so far.
    """

    log_metric: Callable[[str, float], None] = lambda name, value: None
    emit_event: Callable[..., None] = lambda kind, step=None, **fields: None
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = identity
    gather: Callable[[torch.Tensor], torch.Tensor] = identity
    gather_object: Callable[[list[Any]], list[Any]] = _same
    global_step: Callable[[], int] = lambda: 0
    rank: int = 0
    processes: int = 1  # ranks in the run; on one, code may skip a collective's packing (``gather`` is the identity)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seconds: float = 0.0  # wall time spent inside ``timer()`` blocks (the guard overhead figure)
    seconds_by_part: dict[str, float] = field(default_factory=dict)  # the same seconds, split by ``timer(part)``
    _timer_stack: list[float] = field(default_factory=list)  # per open block: seconds of the blocks inside it

    @contextlib.contextmanager
    def timer(self, part: str = "other") -> Iterator[None]:
        """Adds the wall time of the block to ``seconds`` (the overhead figure of bench_overhead.py) and its own
        time to ``seconds_by_part[part]`` (``part``: the layer or mechanism whose code runs, e.g. ``"quatro"``).

        Blocks may nest (a timed hook that calls a timed runtime): ``seconds`` counts only the outermost block, so
        no second is counted twice, and each part gets its block's time minus that of the blocks inside it, so the
        parts always add up to ``seconds``.
        """
        self._timer_stack.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            inner = self._timer_stack.pop()
            self.seconds_by_part[part] = self.seconds_by_part.get(part, 0.0) + elapsed - inner
            if self._timer_stack:
                self._timer_stack[-1] += elapsed
            else:
                self.seconds += elapsed

    def log_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.log_metric(name, value)
