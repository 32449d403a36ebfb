"""Read a run's logged metrics back: ``load_history(run_dir) -> History``.

Sources, first found wins:
1. ``RUN_DIR/metrics.jsonl`` (``steadyrl.callbacks.metrics_log.MetricsLog``): every row up to the last one,
   even when the run died between checkpoints; a truncated or garbled line is skipped and counted.
2. ``RUN_DIR/checkpoint-N/trainer_state.json`` with the largest N (the Trainer's ``log_history``), or
   ``RUN_DIR/trainer_state.json`` when that one is at least as far along (``Trainer.save_state`` at the end).

A resumed run logs the steps after its checkpoint a second time; when a row's step goes back below an earlier
row's, the earlier rows from that step on are dropped (the resumed run's rows replace them). Events are kept.
``trainer_state.json`` holds no events: skips and rollbacks then come from the ``gepo/skipped_steps`` and
``opefo/rollbacks`` counters alone.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from steadyrl.metrics import EVENT_ROLLBACK, EVENT_SKIP, GEPO_SKIPPED_STEPS, OPEFO_ROLLBACKS

METRICS_FILE = "metrics.jsonl"  # written by steadyrl.callbacks.metrics_log.MetricsLog
STATE_FILE = "trainer_state.json"
FINAL_ROW_KEY = "train_runtime"  # only the Trainer's end-of-training summary row has it
_NONFINITE = {
    "nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "-inf": -math.inf,
    "infinity": math.inf,
    "-infinity": -math.inf,
}
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class HistoryNotFoundError(FileNotFoundError):
    """No metrics.jsonl or trainer_state.json in a run folder."""


def to_float(value: Any) -> float | None:
    """A logged value as a float (bools as 0/1, "nan"/"inf"/"-inf" strings as non-finite), else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return _NONFINITE.get(value.strip().lower())
    return None


@dataclass
class History:
    """A run's logged rows and events.

    rows: metric rows in log order, each with an int ``step`` (events excluded).
    events: ``{"step": ..., "event": kind, ...}`` rows from MetricsLog.event, in log order.
    source: the file read; bad_lines: lines of metrics.jsonl that did not parse (a torn last line is one).
    """

    rows: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    source: Path | None = None
    bad_lines: int = 0

    @cached_property
    def metrics(self) -> set[str]:
        """Names with at least one numeric value (``step`` itself excluded)."""
        return {k for row in self.rows for k, v in row.items() if k != "step" and to_float(v) is not None}

    def has(self, name: str) -> bool:
        return name in self.metrics

    def matching(self, prefix: str) -> list[str]:
        """Sorted metric names that start with ``prefix`` (e.g. ``"quatro/filtered/"``)."""
        return sorted(m for m in self.metrics if m.startswith(prefix))

    def series(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps int64, values float64) of one metric, sorted by step; NaN/inf kept, missing rows left out.

        Two rows at one step (a step's metrics and the end-of-training summary both carry ``epoch``): the later
        row's value wins.
        """
        by_step: dict[int, float] = {}
        for row in self.rows:
            value = to_float(row.get(name))
            if value is not None:
                by_step[row["step"]] = value
        steps = np.array(sorted(by_step), dtype=np.int64)
        return steps, np.array([by_step[s] for s in steps], dtype=np.float64)

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def steps(self) -> np.ndarray:
        """Every step that has a metric row, sorted."""
        return np.array(sorted({row["step"] for row in self.rows}), dtype=np.int64)

    @property
    def last_step(self) -> int:
        """The last logged step (events included); 0 for an empty history."""
        return max((int(r["step"]) for r in [*self.rows, *self.events]), default=0)

    @property
    def final_row(self) -> dict[str, Any] | None:
        """The Trainer's end-of-training summary (``train_runtime``, ``train_loss``), absent if it never ended.

        A summary followed by rows at later steps (the run was resumed to train further) does not count.
        """
        for i in range(len(self.rows) - 1, -1, -1):
            if FINAL_ROW_KEY in self.rows[i]:
                later = any(r["step"] > self.rows[i]["step"] for r in self.rows[i + 1 :])
                return None if later else self.rows[i]
        return None

    @property
    def finished(self) -> bool:
        return self.final_row is not None

    def status(self) -> str:
        """``finished at step N`` or ``no final row: still running or died at step N``."""
        if self.finished:
            return f"finished at step {self.last_step}"
        return f"no final row: still running or died at step {self.last_step}"

    def marked_steps(self, counter: str, event_kind: str) -> np.ndarray:
        """Steps where a cumulative ``counter`` went up, or an ``event_kind`` event was logged (sorted, unique).

        With ``logging_steps > 1`` a logged counter is averaged over the interval, so an increase marks the
        logged step that ends the interval, not the exact step.
        """
        steps, values = self.series(counter)
        finite = np.isfinite(values)
        steps, values = steps[finite], values[finite]
        marked = set(steps[1:][np.diff(values) > 0].tolist())
        if len(values) and values[0] > 0:
            marked.add(int(steps[0]))
        marked |= {int(e["step"]) for e in self.events_of(event_kind)}
        return np.array(sorted(marked), dtype=np.int64)

    def count(self, counter: str, event_kind: str) -> int:
        """How many times it happened: the counter's last finite value, or the number of events if larger."""
        _, values = self.series(counter)
        values = values[np.isfinite(values)]
        from_counter = round(float(values[-1])) if len(values) else 0
        return max(from_counter, len(self.events_of(event_kind)))

    @property
    def skipped_steps(self) -> np.ndarray:
        return self.marked_steps(GEPO_SKIPPED_STEPS, EVENT_SKIP)

    @property
    def rollback_steps(self) -> np.ndarray:
        return self.marked_steps(OPEFO_ROLLBACKS, EVENT_ROLLBACK)


def _drop_superseded(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of a resumed run: a row whose step is below an earlier row's replaces the earlier rows from there."""
    kept: list[dict[str, Any]] = []
    for row in rows:
        if kept and row["step"] < kept[-1]["step"]:
            kept = [r for r in kept if r["step"] < row["step"]]
        kept.append(row)
    return kept


def _split(raw: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, events = [], []
    for i, row in enumerate(raw):
        if not isinstance(row, dict):
            continue
        step = to_float(row.get("step"))
        row = {**row, "step": int(step) if step is not None and math.isfinite(step) else i}
        (events if "event" in row else rows).append(row)
    return _drop_superseded(rows), events


def read_metrics_jsonl(path: str | os.PathLike[str]) -> History:
    """Parse a metrics.jsonl; lines that do not parse (a truncated last line) are counted in ``bad_lines``."""
    raw, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                raw.append(json.loads(line))  # json also accepts bare NaN/Infinity from other writers
            except json.JSONDecodeError:
                bad += 1
    rows, events = _split(raw)
    return History(rows=rows, events=events, source=Path(path), bad_lines=bad)


def read_trainer_state(path: str | os.PathLike[str]) -> History:
    """The ``log_history`` of a Trainer's trainer_state.json (written with bare NaN/Infinity)."""
    state = json.loads(Path(path).read_text(encoding="utf-8"))
    rows, events = _split(state.get("log_history", []))
    return History(rows=rows, events=events, source=Path(path))


def _global_step(path: Path) -> int:
    try:
        return int(json.loads(path.read_text(encoding="utf-8")).get("global_step", -1))
    except (OSError, ValueError, TypeError):
        return -1


def find_log_file(run_dir: str | os.PathLike[str]) -> tuple[Path | None, list[Path]]:
    """(the file load_history would read or None, every path looked at)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        return run_dir, [run_dir]
    jsonl = run_dir / METRICS_FILE
    looked = [jsonl]
    if jsonl.is_file():
        return jsonl, looked
    checkpoints = sorted(
        (int(m.group(1)), p / STATE_FILE)
        for p in (run_dir.iterdir() if run_dir.is_dir() else [])
        if (m := _CHECKPOINT.match(p.name)) and p.is_dir()
    )
    looked.append(run_dir / "checkpoint-*" / STATE_FILE)
    newest = next((path for _, path in reversed(checkpoints) if path.is_file()), None)
    root = run_dir / STATE_FILE
    looked.append(root)
    if root.is_file() and (newest is None or _global_step(root) >= _global_step(newest)):
        return root, looked
    return newest, looked


def load_history(run_dir: str | os.PathLike[str]) -> History:
    """The logged history of a run folder (``trainer.output_dir``), or of one metrics.jsonl/trainer_state.json.

    Raises HistoryNotFoundError naming every path looked at when there is nothing to read.
    """
    path, looked = find_log_file(run_dir)
    if path is None:
        raise HistoryNotFoundError(
            f"no training logs in {run_dir}: looked for "
            + ", ".join(str(p) for p in looked)
            + ". Is it the run's trainer.output_dir? metrics.jsonl needs the MetricsLog callback; "
            "trainer_state.json appears with the first checkpoint"
        )
    if path.suffix == ".jsonl":
        return read_metrics_jsonl(path)
    return read_trainer_state(path)
