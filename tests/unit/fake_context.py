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


class Quatro:
    """QUATRO's pieces in the stations that own them, sharing one ``StepNotes``, against a ``FakeContext``."""

    def __init__(self, config: Any, setup: Any = None, ctx: FakeContext | None = None, observe: bool = False):
        from types import SimpleNamespace

        from steadyrl.trainers.context import StepNotes, TrainerSettings
        from steadyrl.trainers.layers import GuardParts
        from steadyrl.trainers.loss import LossStation
        from steadyrl.trainers.rollout import RolloutStation
        from steadyrl.trainers.scratch import HookScratch
        from steadyrl.trainers.step_end import StepEnd

        setup = setup or TrainerSettings(beta=0.04, seed=0, pad_token_id=0, loss_type="dapo")
        self.ctx = ctx if ctx is not None else FakeContext()
        parts = GuardParts(quatro=config, observe=frozenset({"quatro"} if observe else ()))
        self.notes = StepNotes()
        self.end = StepEnd(self.ctx, parts, True, self.notes, setup)
        pipeline = SimpleNamespace(always=False)
        self.rollout = RolloutStation(self.ctx, parts, pipeline, HookScratch(), self.notes, setup, self.end.entropy)
        self.loss = LossStation(self.ctx, parts, HookScratch(), self.notes, self.end.entropy)
