"""Spawned multi-rank test workers under a deadline, with each hung rank's stack. Imports only the standard library
and torch, so that a spawned rank starts in a few seconds even on a loaded machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _traced_rank(rank: int, fn: Any, trace_dir: str, *args: Any) -> None:
    """A spawned rank: one intra-op thread (as ``accelerate launch`` sets ``OMP_NUM_THREADS=1``: two ranks that
    each spin a thread per core starve each other on a small box) and a stack dump to a file on SIGUSR1."""
    import faulthandler
    import signal

    torch.set_num_threads(1)
    trace = open(Path(trace_dir) / f"rank{rank}.txt", "w")  # open until the process exits
    faulthandler.register(signal.SIGUSR1, file=trace, all_threads=True)
    fn(rank, *args)


def spawn_or_fail(
    fn: Any, args: tuple | Callable[[int], tuple], nprocs: int = 2, timeout: float = 300.0, retries: int = 0
) -> int:
    """``torch.multiprocessing.spawn`` with a deadline: a worker that hangs fails the test with its name and every
    hung rank's Python stack, instead of blocking the whole test run.

    ``retries``: how many times a hang is run again (``args`` then a function of the attempt number, 0 first, so
    that each attempt gets fresh paths). gloo's teardown hangs now and then (pytorch/pytorch#75097); a hang that
    does not come back on the retry is that race, and is reported as a warning with the stacks. A hang that comes
    back, a deadlock in the code under test, still fails. Returns the attempt that finished.
    """
    import os
    import signal
    import tempfile
    import time
    import warnings

    import pytest
    import torch.multiprocessing as mp

    for attempt in range(retries + 1):
        attempt_args = args(attempt) if callable(args) else args
        with tempfile.TemporaryDirectory(prefix="spawn-trace-") as trace_dir:
            context = mp.start_processes(
                _traced_rank, args=(fn, trace_dir, *attempt_args), nprocs=nprocs, join=False, start_method="spawn"
            )
            deadline = time.monotonic() + timeout
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    break
            else:
                return attempt
            alive = [i for i, p in enumerate(context.processes) if p.is_alive()]
            for rank in alive:
                os.kill(context.processes[rank].pid, signal.SIGUSR1)
            time.sleep(2.0)  # let faulthandler write the stacks
            for process in context.processes:
                process.kill()
            stacks = "".join(
                f"\n--- rank {rank} ---\n{(Path(trace_dir) / f'rank{rank}.txt').read_text()[-4000:]}" for rank in alive
            )
        message = f"{getattr(fn, '__name__', fn)}: rank(s) {alive} still running after {timeout:.0f} s{stacks}"
        if attempt == retries:
            pytest.fail(message)
        warnings.warn(f"{message}\n(attempt {attempt + 1} of {retries + 1}; running it again)", stacklevel=2)
    raise AssertionError("unreachable")
