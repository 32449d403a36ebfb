"""Read a run's logged metrics back: ``load_history(run_dir) -> History``.

Sources, first found wins: ``RUN_DIR/metrics.jsonl`` (garbled lines skipped and counted), else the ``log_history``
of the furthest ``trainer_state.json`` (no events: skips and rollbacks then come from the counters). A row whose step
goes back (a resumed run) replaces the earlier rows from that step on.
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
_NONFINITE = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "infinity": math.inf}
_NONFINITE["-infinity"] = -math.inf
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class HistoryNotFoundError(FileNotFoundError):
    """No metrics.jsonl or trainer_state.json in a run folder."""


def to_float(value: Any) -> float | None:
    """A logged value as a float (bools as 0/1, "nan"/"inf"/"-inf" strings as non-finite), else None."""
    if isinstance(value, int | float):  # bool included
        return float(value)
    if isinstance(value, str):
        return _NONFINITE.get(value.strip().lower())
    return None


@dataclass
class History:
    """A run's logged rows (each with an int ``step``) and events (``{"step", "event": kind, ...}``), in log order;
    the file read, and the lines of metrics.jsonl that did not parse (a torn last line is one)."""

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
        """(steps int64, values float64) of one metric, sorted by step; NaN/inf kept, missing rows left out. Of two
        rows at one step (a step's metrics and the end-of-training summary both carry ``epoch``) the later wins."""
        by_step: dict[int, float] = {}
        for row in self.rows:
            value = to_float(row.get(name))
            if value is not None:
                by_step[row["step"]] = value
        steps = np.array(sorted(by_step), dtype=np.int64)
        return steps, np.array([by_step[s] for s in steps], dtype=np.float64)

    def finite(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """``series`` without the non-finite values."""
        steps, values = self.series(name)
        return steps[np.isfinite(values)], values[np.isfinite(values)]

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
        """The Trainer's end-of-training summary; None if it never ended or later rows follow it (a resumed run)."""
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
        return ("finished" if self.finished else "no final row: still running or died") + f" at step {self.last_step}"

    def marked_steps(self, counter: str, event_kind: str) -> np.ndarray:
        """Sorted steps where a cumulative ``counter`` went up, or an ``event_kind`` event was logged."""
        steps, values = self.finite(counter)
        marked = set(steps[1:][np.diff(values) > 0].tolist())
        if len(values) and values[0] > 0:
            marked.add(int(steps[0]))
        marked |= {int(e["step"]) for e in self.events_of(event_kind)}
        return np.array(sorted(marked), dtype=np.int64)

    def count(self, counter: str, event_kind: str) -> int:
        """How many times it happened: the counter's last finite value, or the number of events if larger."""
        _, values = self.finite(counter)
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


def history_of(log_history: Iterable[dict[str, Any]]) -> History:
    """A History of a Trainer's ``state.log_history`` (or any list of logged rows and events)."""
    rows, events = _split(log_history)
    return History(rows=rows, events=events)


def _global_step(path: Path) -> int:
    try:
        return int(json.loads(path.read_text(encoding="utf-8")).get("global_step", -1))
    except (OSError, ValueError, TypeError):
        return -1


def _log_file(run_dir: Path) -> Path | None:
    if run_dir.is_file():
        return run_dir
    if (run_dir / METRICS_FILE).is_file():
        return run_dir / METRICS_FILE
    checkpoints = sorted(
        (int(m.group(1)), p / STATE_FILE)
        for p in (run_dir.iterdir() if run_dir.is_dir() else [])
        if (m := _CHECKPOINT.match(p.name)) and p.is_dir()
    )
    newest = next((path for _, path in reversed(checkpoints) if path.is_file()), None)
    root = run_dir / STATE_FILE
    if root.is_file() and (newest is None or _global_step(root) >= _global_step(newest)):
        return root
    return newest


def load_history(run_dir: str | os.PathLike[str]) -> History:
    """The logged history of a run folder (``trainer.output_dir``), or of one metrics.jsonl/trainer_state.json.
    Raises HistoryNotFoundError naming every path looked at when there is nothing to read."""
    if (path := _log_file(Path(run_dir))) is None:
        looked_for = f"{Path(run_dir) / METRICS_FILE}, {Path(run_dir) / 'checkpoint-*' / STATE_FILE}, "
        looked_for += str(Path(run_dir) / STATE_FILE)
        raise HistoryNotFoundError(
            f"no training logs in {run_dir}: looked for {looked_for}. Is it the run's trainer.output_dir? "
            "metrics.jsonl needs the MetricsLog callback; trainer_state.json appears with the first checkpoint"
        )
    if path.suffix != ".jsonl":  # the Trainer writes bare NaN/Infinity, which json reads
        rows, events = _split(json.loads(path.read_text(encoding="utf-8")).get("log_history", []))
        return History(rows=rows, events=events, source=path)
    raw, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in filter(str.strip, f):
            try:
                raw.append(json.loads(line))  # json also accepts bare NaN/Infinity from other writers
            except json.JSONDecodeError:
                bad += 1
    rows, events = _split(raw)
    return History(rows=rows, events=events, source=path, bad_lines=bad)
