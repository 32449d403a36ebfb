"""A RuntimeContext that records what a runtime logs and emits, for unit tests without a trainer."""

from __future__ import annotations

from typing import Any

from steadyrl.trainers.context import RuntimeContext


class FakeContext(RuntimeContext):
    """One process; ``step`` is the global step the runtime sees; ``metrics`` / ``events`` record its output."""

    def __init__(self, step: int = 0, rank: int = 0, world: int = 1) -> None:
        self.metrics: list[tuple[str, float]] = []
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.step = step
        super().__init__(
            log_metric=lambda name, value: self.metrics.append((name, value)),
            emit_event=self._event,
            reduce_sum=lambda t: t * world,  # every rank holds the same values
            gather=lambda t: t.repeat(world) if t.dim() else t.reshape(1).repeat(world),
            gather_object=lambda objects: list(objects) * world,
            global_step=lambda: self.step,
            rank=rank,
            processes=world,
        )

    def _event(self, kind: str, step: int | None = None, **fields: Any) -> None:
        self.events.append((self.step if step is None else step, kind, fields))

    def last(self, name: str) -> float:
        return [v for n, v in self.metrics if n == name][-1]
