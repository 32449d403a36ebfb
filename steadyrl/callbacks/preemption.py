"""Preemption (config ``preemption``): a signal ends the run at the next optimizer-step boundary, with a checkpoint.

The first of ``preemption.signals`` is only recorded; at every step end one all-reduce (MAX) of a flag lets all
ranks stop at the same step with ``should_save`` (``build.run`` then raises ``Preempted``, the CLI prints how to
resume and exits with ``preemption.exit_code``). A second signal within ``relay_window_s`` is a launcher's relayed
copy and is ignored; a later one exits at once with 128 + the signal number (docs/DESIGN.md, "Preemption").
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class Preempted(Exception):
    """The run stopped on a signal after writing ``checkpoint`` at ``step`` (raised by ``build.run``)."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None, exit_code: int) -> None:
        self.signal_name, self.step, self.checkpoint, self.exit_code = signal_name, step, checkpoint, exit_code
        where = f"checkpoint written to {checkpoint}" if checkpoint else "no complete checkpoint was found"
        super().__init__(f"preempted by {signal_name} after step {step}: {where}")


@dataclass
class _Received:
    signum: int
    at: float  # time.monotonic()


def any_rank(flag: bool) -> bool:
    """``flag`` OR-ed over every rank of the default process group (the flag itself without one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


class PreemptionCallback(TrainerCallback):
    """Signal handlers for the length of ``train()`` and the agreed stop (see the module docstring)."""

    def __init__(self, signals: list[str], relay_window_s: float = 3.0) -> None:
        self.signals = [getattr(signal, name) for name in signals]
        self.relay_window_s = relay_window_s
        self.received: _Received | None = None
        self.stopped_at: int | None = None  # the global step the run stopped after, once agreed
        self._previous: dict[int, Any] = {}

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received.signum).name if self.received else "a signal on another rank"

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        now = time.monotonic()
        name = signal.Signals(signum).name
        if self.received is None:
            self.received = _Received(signum, now)
            logger.warning(
                "received %s: finishing the current step, then writing a checkpoint and exiting "
                "(a second signal more than %.0f s from now exits at once)", name, self.relay_window_s
            )  # fmt: skip
            return
        if now - self.received.at < self.relay_window_s:
            return  # a launcher's relayed copy of the same event
        logger.error("second signal (%s): exiting at once; the last complete checkpoint is untouched", name)
        logging.shutdown()
        os._exit(128 + signum)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.warning("preemption: train() is not on the main thread; signals keep their default handlers")
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self.handle)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.stopped_at is None and any_rank(self.received is not None):
            self.stopped_at = state.global_step
            control.should_save = True
            control.should_training_stop = True
            logger.warning("preemption: stopping after step %d with a checkpoint", state.global_step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def resume_hint(config: str, overrides: list[str]) -> str:
    """The command line that resumes a preempted run: the same one with ``resume_from_checkpoint=auto``."""
    kept = [o for o in overrides if not o.startswith("trainer.resume_from_checkpoint=")]
    return shlex.join(["steadyrl", "train", config, *kept, "trainer.resume_from_checkpoint=auto"])
