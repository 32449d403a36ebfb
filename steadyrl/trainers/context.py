"""What a station may use of the running trainer (``RuntimeContext``: metrics, events, a timer, collectives, the
step, the rank), the trainer settings read once (``TrainerSettings``), and what the stations note for the step end
during one optimizer step (``StepNotes``). Stations return what should change in TRL's state; the trainer writes it
(``trl_state``). Tests hand them a fake context (``tests/unit/fake_context.py``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger("steadyrl")


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass
class RuntimeContext:
    """The narrow view of a trainer; the defaults are a single process that logs nowhere (for tests).
    ``log_metric``: averaged over the logging interval; ``emit_event(kind, step=None, **fields)``: for callbacks that
    record events (``step`` defaults to ``global_step()``); ``reduce_sum`` / ``gather`` / ``gather_object``:
    collectives over all ranks (the identity itself on one process)."""

    log_metric: Callable[[str, float], None] = lambda name, value: None
    emit_event: Callable[..., None] = lambda kind, step=None, **fields: None
    reduce_sum: Callable[[torch.Tensor], torch.Tensor] = identity
    gather: Callable[[torch.Tensor], torch.Tensor] = identity
    gather_object: Callable[[list[Any]], list[Any]] = list
    global_step: Callable[[], int] = lambda: 0
    rank: int = 0
    processes: int = 1  # ranks in the run; on one, code may skip a collective's packing (``gather`` is the identity)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seconds: float = 0.0  # wall time spent inside ``timer()`` blocks (the guard overhead figure)
    seconds_by_part: dict[str, float] = field(default_factory=dict)  # the same seconds, split by ``timer(part)``
    _timer_stack: list[float] = field(default_factory=list)  # per open block: seconds of the blocks inside it

    @contextlib.contextmanager
    def timer(self, part: str = "other") -> Iterator[None]:
        """Adds the block's wall time to ``seconds`` (outermost blocks only) and its own time, less that of the
        blocks inside it, to ``seconds_by_part[part]``: the parts add up to ``seconds`` (bench_overhead.py)."""
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


@dataclass(frozen=True)
class TrainerSettings:
    """The trainer settings the stations read once, at init."""

    beta: float  # the base KL coefficient (trainer.beta before any factor)
    seed: int  # args.seed; the replay buffer is seeded with seed + rank
    pad_token_id: int
    loss_type: str
    entropy_coef: float = 0.0  # TRL's own coefficient, kept: the floor's bonus adds to it
    use_adaptive_entropy: bool = False
    kl_from_rollouts: bool = False  # PPO: the KL is in the reward, measured at the rollout
    reward_names: tuple[str, ...] = ()  # the reward functions' names, in the columns' order (GRPO)


@dataclass(frozen=True)
class Controls:
    """What the controllers want in TRL's state; None = leave that part alone."""

    kl_factor: float | None = None  # the ``quatro_kl`` factor of beta
    entropy_coef: float | None = None  # TRL's entropy_coef
    clip_scale: float | None = None  # epsilon_low/high = their initial values x this


@dataclass
class StepNotes:
    """What the rollout, loss and gate stations note during one optimizer step; the step end reads and clears it."""

    micro_batches: list[tuple[float, float, float]] = field(default_factory=list)  # (kl, entropy, global tokens)
    rewards: list[float] = field(default_factory=list)  # mean training reward per generation batch (learning gate)
    rollout_kl: list[tuple[float, float]] = field(default_factory=list)  # PPO: (kl, tokens) per generation batch
    check_now: str | None = None  # why the optimizer state is checked at this step's end (a skip, a non-finite loss)

    def forget_measurements(self) -> None:
        """Restored controllers start from what the checkpoint holds: this step's measurements so far go."""
        self.micro_batches, self.rollout_kl = [], []

    def record_rollout_kl(self, kl_mean: float, tokens: float) -> None:
        """PPO: a training generation batch's mean per-token KL to the reference (NaN without tokens), its tokens."""
        self.rollout_kl.append((float(kl_mean), float(tokens)))


@dataclass
class SavedTogether:
    """One checkpoint key over objects that different stations own: ``{"version": 1, name: state_dict() or None}``.
    Loading restores each saved one, warns ``missing % name`` for one the checkpoint lacks, then ``after_load()``."""

    objects: dict[str, Any]
    missing: str
    after_load: Callable[[], None] = lambda: None

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, **{n: o.state_dict() if o is not None else None for n, o in self.objects.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, obj in self.objects.items():
            if obj is not None and state.get(name) is not None:
                obj.load_state_dict(state[name])
            elif obj is not None:
                logger.warning(self.missing, name)
        self.after_load()

    rank_state_dict = state_dict
    load_rank_state_dict = load_state_dict
