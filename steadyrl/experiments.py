"""Runs of ``steadyrl train`` as child processes (``steadyrl preflight``, the bench scripts), and their folders.

``launch`` runs one command in its own process group (a timeout kills the whole group) and writes ``OUT/log.txt``,
``OUT/command.txt`` and ``OUT/run.json``; ``read_run`` reads a folder back without running anything; ``run_jobs`` runs
``Job``s ``workers`` at a time. Left out: retries and resuming a half-finished run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the folder that holds the steadyrl package
RUN_RECORD = "run.json"  # {"returncode", "wall_s", "timed_out"}: written by ``launch``, read by ``read_run``
Key = tuple[str, str, int]  # (variant, scenario, seed)


def train_command(config: str | Path, *overrides: str) -> list[str]:
    """``python -m steadyrl train CONFIG OVERRIDE...`` with this interpreter."""
    return [sys.executable, "-m", "steadyrl", "train", str(config), *overrides]


def run_env(extra: Mapping[str, str] | None = None, paths: Sequence[str | Path] = ()) -> dict[str, str]:
    """This environment with ``OMP_NUM_THREADS=1``, ``PYTHONPATH`` = ``REPO`` (+ ``paths``), then ``extra``."""
    path = os.pathsep.join([str(REPO), *map(str, paths)])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra or {})}


@dataclass(frozen=True)
class Job:
    """One run: its place in the matrix, its folder, its command line and the environment it adds."""

    variant: str
    scenario: str
    seed: int
    out: Path
    cmd: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> Key:
        return (self.variant, self.scenario, self.seed)


@dataclass
class Outcome:
    """What a run folder says. ``status``: ok (exit 0), died (non-zero exit or timeout), not_run."""

    status: str
    returncode: int | None = None  # -1 after a timeout
    wall_s: float = math.nan
    timed_out: bool = False
    last_step: int = 0
    history: Any = None  # steadyrl.evidence.history.History, None without metrics.jsonl
    eval: dict[str, Any] | None = None  # eval_results.json
    log: str = field(default="", repr=False)  # the child's output, when this invocation ran it


def launch(cmd: Sequence[str], out: Path, *, env: Mapping[str, str] | None = None, timeout: float | None = None,
           cwd: str | Path | None = REPO, log_name: str = "log.txt", label: str | None = None, fresh: bool = True,
           ) -> Outcome:  # fmt: skip
    """Run ``cmd`` into ``out`` (``fresh``: emptied first, as metrics.jsonl and faults.jsonl append). Its output goes
    to ``out/log_name`` and, when progress is wanted, its ``step N`` lines to stderr; past ``timeout`` seconds its
    process group is killed (returncode -1). Writes ``out/command.txt`` and ``out/run.json``."""
    from steadyrl.callbacks.progress import progress_wanted

    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    child_env = dict(os.environ if env is None else env)
    show = progress_wanted(sys.stderr)
    if show:
        child_env["STEADYRL_PROGRESS"] = "1"
    start = time.time()
    proc = subprocess.Popen(list(cmd), cwd=cwd, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    chunks: list[str] = []

    def read() -> None:
        with open(out / log_name, "w", buffering=1) as sink:  # line-buffered: the log follows the run
            for line in proc.stdout:  # type: ignore[union-attr]
                chunks.append(line)
                sink.write(line)
                if show and line.startswith("step "):
                    print(f"   {label or out.name}: {line.rstrip()}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out, code = True, -1
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the trainer and anything it started
        proc.wait()
    reader.join(timeout=30)
    wall_s, log = time.time() - start, "".join(chunks)
    if timed_out:
        (out / log_name).write_text(f"timeout after {timeout} s\n{log}")
    shown = {"OMP_NUM_THREADS": child_env.get("OMP_NUM_THREADS", "unset")}  # and what the job adds
    hidden = ("PYTHONPATH", "STEADYRL_PROGRESS")
    shown.update((k, v) for k, v in child_env.items() if os.environ.get(k) != v and k not in hidden)
    (out / "command.txt").write_text(shlex.join([*(f"{k}={v}" for k, v in shown.items()), *cmd]) + "\n")
    (out / RUN_RECORD).write_text(json.dumps({"returncode": code, "wall_s": wall_s, "timed_out": timed_out}))
    return read_run(out, log=log)


def read_run(out: Path, log: str = "") -> Outcome:
    """A run's outcome from its folder alone; ``not_run`` when it has no ``run.json``."""
    from steadyrl.evidence.history import HistoryNotFoundError, load_history

    if not (out / RUN_RECORD).is_file():
        return Outcome(status="not_run")
    meta = json.loads((out / RUN_RECORD).read_text())
    code = int(meta["returncode"])
    try:
        history = load_history(out)
    except HistoryNotFoundError:
        history = None
    eval_file = out / "eval_results.json"
    return Outcome("ok" if code == 0 else "died", code, float(meta["wall_s"]), bool(meta.get("timed_out", False)),
                   history.last_step if history is not None else 0, history,
                   json.loads(eval_file.read_text()) if code == 0 and eval_file.is_file() else None, log)  # fmt: skip


def run_jobs(jobs: Iterable[Job], summarise: Callable[[Job, Outcome], Any] = lambda job, outcome: outcome, *,
             timeout: float | None = None, workers: int = 1, collect_only: bool = False, reuse: bool = False,
             paths: Sequence[str | Path] = (), log_name: str = "log.txt",
             after: Callable[[Job, Any], None] | None = None) -> dict[Key, Any]:  # fmt: skip
    """``{job.key: summarise(job, outcome)}`` in the order of ``jobs``, run ``workers`` at a time (``run_env``).
    ``collect_only``: run nothing, read each folder (a job never run is left out); ``reuse``: read a folder that
    has ``run.json``, run the others. ``after(job, result)`` is called as each result comes."""

    def one(job: Job) -> tuple[Key, Any] | None:
        if collect_only or (reuse and (job.out / RUN_RECORD).is_file()):
            outcome = read_run(job.out)
            if outcome.status == "not_run":
                return None
        else:
            outcome = launch(job.cmd, job.out, env=run_env(dict(job.env), paths), timeout=timeout, log_name=log_name)
        result = summarise(job, outcome)
        if after is not None:
            after(job, result)
        return job.key, result

    jobs = list(jobs)
    if workers <= 1:
        done = [one(job) for job in jobs]
    else:
        with ThreadPoolExecutor(workers) as pool:
            done = list(pool.map(one, jobs))
    return dict(item for item in done if item is not None)
