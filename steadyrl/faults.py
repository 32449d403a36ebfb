"""Fault injectors for tests and benchmarks: rewards and training steps that misbehave reproducibly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from steadyrl.tasks.arithmetic import exact_match


def exact_match_cauchy(
    completions: Sequence[Any],
    answer: Sequence[str],
    scale: float = 1.0,
    seed: int = 0,
    trainer_state: Any = None,
    **_: Any,
) -> list[float]:
    """Exact match plus Cauchy noise of the given scale: a heavy-tailed reward model (seed 004's scenario).

    The noise is drawn from a generator seeded by (seed, optimizer step), so a run is reproducible and the
    same step sees the same noise in every variant of a benchmark.
    """
    step = int(getattr(trainer_state, "global_step", 0) or 0)
    rng = np.random.default_rng([seed, step])
    noise = scale * rng.standard_cauchy(len(completions))
    return [r + float(n) for r, n in zip(exact_match(completions, answer), noise, strict=True)]


def inject_nan_loss(trainer: Any, micro_step: int) -> Callable[[], None]:
    """Make the loss of one micro-batch NaN: its advantages are multiplied by NaN after TRL prepared them.

    ``micro_step`` counts backward passes from 0 (TRL's ``trainer._step``). Works on ``trl.GRPOTrainer`` and
    every subclass; the NaN flows through the loss into every gradient, as a NaN from a real numeric overflow
    would. Returns a function that removes the fault.
    """
    original = trainer._prepare_inputs

    def poisoned(generation_batch: Any) -> Any:
        inputs = original(generation_batch)
        if trainer.model.training and trainer._step == micro_step:
            inputs = {**inputs, "advantages": inputs["advantages"] * float("nan")}
        return inputs

    trainer._prepare_inputs = poisoned
    return lambda: setattr(trainer, "_prepare_inputs", original)


class CorruptOptimizerState(TrainerCallback):
    """Write ``value`` (inf by default) into one Adam moment at the end of optimizer step ``step``.

    The entry is the first element of ``key`` (``exp_avg_sq``) of the first parameter the innermost optimizer
    holds state for (under ZeRO-2: this rank's first partition). ``rank``: only that process (``RANK``), or
    every process when None. It runs after steadyrl's own step-end work (snapshot, checks), so the next
    step trains on the corrupted state and the next check finds it.
    """

    def __init__(self, step: int = 2, value: float = float("inf"), rank: int | None = None, key: str = "exp_avg_sq"):
        self.step, self.value, self.rank, self.key = step, value, rank, key
        self.fired = False

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        import os

        from steadyrl.trainers.opefo_runtime import optimizer_chain

        if state.global_step != self.step or self.fired:
            return
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return
        base = optimizer_chain(optimizer)[-1]
        first = next(st for st in base.state.values() if self.key in st)
        with torch.no_grad():
            first[self.key].view(-1)[0] = self.value
        self.fired = True
