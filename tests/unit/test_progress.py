"""The terminal status line: its text, when it appears, and the guard events it flags."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from steadyrl.callbacks.progress import ProgressLine, progress_wanted, status_line


def test_status_line_text() -> None:
    latest = {"reward": 0.6234, "eval/accuracy": 0.71, "gepo/skipped_steps": 1.0, "opefo/rollbacks": 0.0,
              "quatro/filtered_share": 0.375, "quatro/rows": 128.0, "quatro/filtered/parrot": 2.0,
              "quatro/filtered/length": 1.0, "quatro/filtered/zero_variance": 45.0}  # fmt: skip
    assert status_line(40, 200, 1.9, latest) == (
        "step 40/200 (20%) | 1.9 s/step | ETA 5m04s | reward 0.623 | eval acc 0.710 | skipped 1 | rollbacks 0 "
        "| filtered 2% | no signal 35%"  # 3 of 128 rows dropped by filters; 45 in groups with equal rewards
    )
    assert status_line(3, 0, None, {}) == "step 3"
    assert status_line(200, 200, 0.5, {"reward": 1.0}) == "step 200/200 (100%) | 0.5 s/step | reward 1"
    assert "ETA 1h23m" in status_line(1, 5001, 1.0, {})


class _TTY(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_on_only_for_a_terminal_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEADYRL_PROGRESS", raising=False)
    assert progress_wanted(_TTY(True)) and not progress_wanted(_TTY(False))
    monkeypatch.setenv("STEADYRL_PROGRESS", "1")
    assert progress_wanted(_TTY(False))
    monkeypatch.setenv("STEADYRL_PROGRESS", "0")
    assert not progress_wanted(_TTY(True))


def test_flags_new_skips_and_rollbacks_and_keeps_the_last_eval() -> None:
    out = io.StringIO()
    cb = ProgressLine(out)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0, max_steps=4)
    cb.on_train_begin(None, state, None)
    rows = [
        {"reward": 0.1, "eval/accuracy": 0.5, "gepo/skipped_steps": 0.0},
        {"reward": 0.2, "gepo/skipped_steps": 1.0},
        {"reward": 0.3, "gepo/skipped_steps": 1.0, "opefo/rollbacks": 1.0},
    ]
    for step, logs in enumerate(rows, start=1):
        state.global_step = step
        cb.on_log(None, state, None, logs=logs)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "SKIPPED" not in lines[0] and lines[1].endswith("| SKIPPED") and lines[2].endswith("| ROLLED BACK")
    assert all("eval acc 0.500" in line for line in lines)  # the last known eval stays on the line
    assert lines[2].startswith("step 3/4 (75%) | ") and "reward 0.3" in lines[2]
    cb.on_log(None, SimpleNamespace(is_world_process_zero=False, global_step=4, max_steps=4), None, logs={"a": 1})
    assert len(out.getvalue().splitlines()) == 3  # other ranks stay quiet


def test_a_skip_inside_a_logging_interval_is_flagged_once_with_its_count() -> None:
    """TRL averages the cumulative count over logging_steps=10: a skip at step 12 logs 0.9 at step 20, then 1.0 at
    step 30. The line says "skipped 1 | SKIPPED" at 20 and "skipped 1" without the flag at 30."""
    out = io.StringIO()
    cb = ProgressLine(out)
    state = SimpleNamespace(is_world_process_zero=True, global_step=0, max_steps=30)
    cb.on_train_begin(None, state, None)
    for step, mean in ((10, 0.0), (20, 0.9), (30, 1.0)):
        state.global_step = step
        cb.on_log(None, state, None, logs={"gepo/skipped_steps": mean, "opefo/rollbacks": 0.0})
    lines = out.getvalue().splitlines()
    assert ["SKIPPED" in line for line in lines] == [False, True, False]
    assert "skipped 1 |" in lines[1] and "skipped 1 |" in lines[2] and "skipped 0 |" in lines[0]
