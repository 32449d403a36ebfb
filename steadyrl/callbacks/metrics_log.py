"""MetricsLog: every logged row and guard event, one JSON line each, in ``<output_dir>/metrics.jsonl``.

Each row is appended (fsync'd, main process only) as it is logged, so a run that dies between checkpoints keeps
its rows: ``{"step": 12, "grad_norm": "nan", ...}``, ``{"step": 13, "event": "skip", "reason": "nonfinite"}``.
Non-finite floats are written as ``"nan"``, ``"inf"``, ``"-inf"``; a line cut short by a crash is started afresh by
the next write. A row that cannot be written (``OSError``: a full disk) is counted and warned about and the run goes
on; once writing works again, a ``{"event": "metrics_rows_lost", "rows": n}`` row marks the gap.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from steadyrl.evidence.history import METRICS_FILE

logger = logging.getLogger(__name__)


def encode_value(value: Any) -> Any:
    """A log value as strict JSON: floats stay numbers unless non-finite ("nan", "inf", "-inf")."""
    if isinstance(value, int | str) or value is None:  # bool included
        return value
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_value(v) for v in value]
    try:
        number = float(value)  # float, numpy scalar, 0-d tensor
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(number):
        return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")
    return number


class MetricsLog(TrainerCallback):
    """Append-only JSON-lines log of the Trainer's rows (``on_log``) and of guard events (``event(step, "skip",
    reason="spike")``; written on the main process only). output_dir: None takes ``args.output_dir`` at train start."""

    def __init__(self, output_dir: str | os.PathLike[str] | None = None, filename: str = METRICS_FILE) -> None:
        self.filename = filename
        self.path: Path | None = Path(output_dir) / filename if output_dir is not None else None
        self.is_main = int(os.environ.get("RANK", "0")) == 0  # refined by the Trainer's state at every call
        self.lost_rows = 0  # rows not written since the last write that worked (module docstring)

    def _sync(self, args: Any, state: Any) -> None:
        self.is_main = bool(state.is_world_process_zero)
        if self.path is None:
            self.path = Path(args.output_dir) / self.filename

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync(args, state)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
        self._sync(args, state)
        if logs:
            self.write({"step": int(state.global_step), **logs})

    def event(self, step: int, kind: str, **fields: Any) -> None:
        """Record a guard event at optimizer step ``step``: ``{"step": step, "event": kind, **fields}``."""
        self.write({"step": int(step), "event": kind, **fields})

    def write(self, row: dict[str, Any]) -> None:
        """Append one row as a JSON line and fsync it (main process only; no-op before the path is known)."""
        if not self.is_main or self.path is None:
            return
        line = json.dumps(encode_value(row), allow_nan=False) + "\n"
        if self.lost_rows:
            gap = {"step": row.get("step", 0), "event": "metrics_rows_lost", "rows": self.lost_rows}
            line = json.dumps(gap) + "\n" + line
        try:
            self._append(self.path, line)
        except OSError as exc:
            self.lost_rows += 1
            if self.lost_rows == 1:  # once per streak: a full disk would otherwise warn at every logging step
                self._warn(self.path, exc)
            return
        self.lost_rows = 0

    @staticmethod
    def _append(path: Path, line: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+b") as f:
            if f.tell() > 0:  # a torn last line (the process died mid-write) gets its own line ending
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _warn(path: Path, exc: OSError) -> None:
        from steadyrl.trainers.checkpoints import free_space, last_checkpoint_note

        run_dir = path.parent
        logger.warning(
            "could not append a row to %s: %s: %s (%s free on the disk of %s). Training goes on: the rows not "
            "written are counted (a metrics_rows_lost row follows once writing works again) and the Trainer's "
            "log_history keeps the logged ones; a disk that stays full stops the run at the next checkpoint.%s",
            path, type(exc).__name__, exc, free_space(run_dir), run_dir, last_checkpoint_note(run_dir),
        )  # fmt: skip
