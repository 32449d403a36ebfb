"""Progress: one status line per logged step on the terminal, quiet when stderr is not a terminal (as tqdm is).

    step 40/200 (20%) | 1.9 s/step | ETA 5m04s | reward 0.62 | eval acc 0.71 | skipped 1 | rollbacks 0 | filtered 2%
    | no signal 36%

``filtered``: rows a quality filter dropped (z-score, length, parrot, repetition); ``no signal``: rows of groups whose
rewards are all equal (their advantage is 0 in plain GRPO too), counted apart so they do not read as rows dropped.

A skip, rollback or repair since the previous line is flagged (``SKIPPED``, ``ROLLED BACK``, ``REPAIRED``). Main
process only; logs still go to files. ``STEADYRL_PROGRESS=1`` forces it on (a pty-less scheduler log), ``0`` off.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, TextIO

from transformers import TrainerCallback

from steadyrl import metrics as M

# cumulative counters: TRL averages them over the logging interval, so the interval's last count is the mean
# rounded up (0.9 when the skip came at step 12 of steps 11-20)
COUNTS = (M.GEPO_SKIPPED_STEPS, M.OPEFO_ROLLBACKS, M.OPEFO_REPAIRS)
SHOWN = [(M.REWARD, "reward", "{:.3g}"), (M.EVAL_ACCURACY, "eval acc", "{:.3f}")]  # (metric, label, format)
SHOWN += [(key, label, "{:.0f}") for key, label in zip(COUNTS, ("skipped", "rollbacks", "repairs"), strict=True)]
DROPS = tuple(M.quatro_filtered(r) for r in ("zscore", "length", "parrot", "repetition"))  # interventions
NO_SIGNAL = M.quatro_filtered("zero_variance")


def progress_wanted(stream: TextIO | None = None) -> bool:
    """On when the stream is a terminal, unless ``STEADYRL_PROGRESS`` says otherwise (1 = on, 0 = off)."""
    forced = os.environ.get("STEADYRL_PROGRESS")
    if forced is not None:
        return forced.strip().lower() not in ("0", "false", "no", "off", "")
    stream = stream or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


def _duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def status_line(step: int, max_steps: int, seconds_per_step: float | None, latest: dict[str, float]) -> str:
    """The status text for ``step`` (pure: ``latest`` holds the last known value of each metric)."""
    parts = [f"step {step}/{max_steps} ({100 * step / max_steps:.0f}%)" if max_steps > 0 else f"step {step}"]
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.1f} s/step")
        if max_steps > step:
            parts.append(f"ETA {_duration(seconds_per_step * (max_steps - step))}")
    for key, label, fmt in SHOWN:
        if key in latest:
            value = math.ceil(latest[key]) if key in COUNTS else latest[key]
            parts.append(f"{label} {fmt.format(value)}")
    rows = latest.get(M.QUATRO_ROWS)
    if rows:
        parts.append(f"filtered {sum(latest.get(k, 0.0) for k in DROPS) / rows:.0%}")
        parts.append(f"no signal {latest.get(NO_SIGNAL, 0.0) / rows:.0%}")
    return " | ".join(parts)


def terminal_callbacks() -> list[TrainerCallback]:
    """``[ProgressLine()]`` on the main process when ``progress_wanted()``, else ``[]`` (for any Trainer)."""
    from accelerate import PartialState

    return [ProgressLine()] if progress_wanted() and PartialState().is_main_process else []


class ProgressLine(TrainerCallback):
    """Writes ``status_line`` to ``stream`` (stderr) at every log of the main process."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.latest: dict[str, float] = {}
        self._start = time.monotonic()
        self._start_step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._start = time.monotonic()
        self._start_step = state.global_step  # a resumed run: speed counts from here

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        before = dict(self.latest)
        for key, value in logs.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.latest[key] = float(value)
        done = state.global_step - self._start_step  # a resumed run times the steps this process ran
        per_step = (time.monotonic() - self._start) / done if done > 0 else None
        line = status_line(state.global_step, state.max_steps, per_step, self.latest)
        for key, flag in zip(COUNTS, ("SKIPPED", "ROLLED BACK", "REPAIRED"), strict=True):
            if math.ceil(self.latest.get(key, 0)) > math.ceil(before.get(key, 0)):
                line += f" | {flag}"
        print(line, file=self.stream, flush=True)
