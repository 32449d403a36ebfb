"""metrics.jsonl written by MetricsLog and read back by load_history; the trainer_state.json fallback; errors."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from steadyrl.callbacks.metrics_log import MetricsLog
from steadyrl.evidence.history import HistoryNotFoundError, load_history


def state(step: int, main: bool = True) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, is_world_process_zero=main)


def log(cb: MetricsLog, step: int, **logs) -> None:
    cb.on_log(SimpleNamespace(output_dir="unused"), state(step), None, logs=logs)


def test_round_trip_with_nonfinite_values_and_events(tmp_path):
    cb = MetricsLog(tmp_path)
    log(cb, 1, loss=0.5, grad_norm=1.25, reward=np.float32(0.25), num_tokens=12)
    log(cb, 2, loss=float("nan"), grad_norm=float("inf"), reward=float("-inf"), num_tokens=24)
    cb.event(2, "skip", reason="nonfinite", grad_norm=float("inf"))
    log(cb, 3, loss=0.25, grad_norm=2.0, **{"gepo/skipped_steps": 1})
    cb.event(3, "rollback", cause="nonfinite loss")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 5
    for line in lines:  # strict JSON: no bare NaN/Infinity tokens
        json.loads(line, parse_constant=lambda token: pytest.fail(f"non-standard JSON token {token}"))
    assert json.loads(lines[1])["grad_norm"] == "inf" and json.loads(lines[1])["reward"] == "-inf"

    history = load_history(tmp_path)
    assert history.source == tmp_path / "metrics.jsonl" and history.bad_lines == 0
    assert history.metrics == {"loss", "grad_norm", "reward", "num_tokens", "gepo/skipped_steps"}
    steps, loss = history.series("loss")
    assert steps.tolist() == [1, 2, 3] and steps.dtype == np.int64
    assert loss[0] == 0.5 and math.isnan(loss[1]) and loss[2] == 0.25
    _, grad = history.series("grad_norm")
    _, reward = history.series("reward")
    assert grad[1] == math.inf and reward[1] == -math.inf and reward[0] == 0.25
    assert history.events == [
        {"step": 2, "event": "skip", "reason": "nonfinite", "grad_norm": "inf"},
        {"step": 3, "event": "rollback", "cause": "nonfinite loss"},
    ]
    assert history.skipped_steps.tolist() == [2, 3]  # the event at 2, the counter going up at 3
    assert history.count("gepo/skipped_steps", "skip") == 1
    assert history.rollback_steps.tolist() == [3]
    assert not history.finished and history.status() == "no final row: still running or died at step 3"


def test_truncated_last_line_is_skipped_and_the_next_write_starts_a_new_line(tmp_path):
    cb = MetricsLog(tmp_path)
    log(cb, 1, loss=1.0)
    log(cb, 2, loss=2.0)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 0.')  # the process died mid-write
    history = load_history(tmp_path)
    assert history.bad_lines == 1 and history.series("loss")[1].tolist() == [1.0, 2.0]
    assert history.last_step == 2

    log(cb, 3, loss=3.0)  # a resumed run appends to the same file
    history = load_history(tmp_path)
    assert history.bad_lines == 1 and history.series("loss")[1].tolist() == [1.0, 2.0, 3.0]


def test_only_the_main_process_writes(tmp_path):
    cb = MetricsLog()  # folder from args.output_dir
    cb.on_log(SimpleNamespace(output_dir=str(tmp_path)), state(1, main=False), None, logs={"loss": 1.0})
    cb.event(1, "skip", reason="spike")
    assert not (tmp_path / "metrics.jsonl").exists()
    cb.on_log(SimpleNamespace(output_dir=str(tmp_path)), state(2), None, logs={"loss": 2.0})
    assert load_history(tmp_path).series("loss")[0].tolist() == [2]


def test_resumed_run_replaces_the_rows_it_logs_again(tmp_path):
    cb = MetricsLog(tmp_path)
    for step in (1, 2, 3, 4, 5):
        log(cb, step, loss=float(step))
    for step in (4, 5, 6):  # resumed from checkpoint-3
        log(cb, step, loss=10.0 * step)
    log(cb, 6, train_runtime=12.5, train_loss=0.1, epoch=1.0)
    history = load_history(tmp_path)
    steps, loss = history.series("loss")
    assert steps.tolist() == [1, 2, 3, 4, 5, 6] and loss.tolist() == [1, 2, 3, 40, 50, 60]
    assert history.finished and history.final_row["train_runtime"] == 12.5
    assert history.status() == "finished at step 6"


def write_state(folder, log_history, global_step):
    folder.mkdir(parents=True, exist_ok=True)
    # json.dumps writes float("nan") as a bare NaN, exactly as transformers' TrainerState.save_to_json does
    text = json.dumps({"global_step": global_step, "log_history": log_history})
    (folder / "trainer_state.json").write_text(text)


def test_fallback_to_the_newest_checkpoint_trainer_state(tmp_path):
    write_state(tmp_path / "checkpoint-2", [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}], 2)
    rows = [{"step": s, "loss": float(s)} for s in range(1, 10)] + [{"step": 10, "loss": float("nan")}]
    write_state(tmp_path / "checkpoint-10", rows, 10)  # newer, though "checkpoint-10" < "checkpoint-2" as text
    history = load_history(tmp_path)
    assert history.source == tmp_path / "checkpoint-10" / "trainer_state.json"
    steps, loss = history.series("loss")
    assert steps.tolist() == list(range(1, 11)) and math.isnan(loss[-1]) and history.events == []

    final = [*rows, {"step": 10, "train_runtime": 3.0, "train_loss": 0.5}]
    write_state(tmp_path, final, 10)  # Trainer.save_state at the end: as far along, and has the final row
    history = load_history(tmp_path)
    assert history.source == tmp_path / "trainer_state.json" and history.finished

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n')
    assert load_history(tmp_path).series("loss")[1].tolist() == [7.0]  # metrics.jsonl wins


def test_nothing_found_names_every_path_looked_at(tmp_path):
    (tmp_path / "checkpoint-5").mkdir()  # a checkpoint folder without trainer_state.json
    with pytest.raises(HistoryNotFoundError) as info:
        load_history(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "metrics.jsonl") in message
    assert str(tmp_path / "checkpoint-*" / "trainer_state.json") in message
    assert str(tmp_path / "trainer_state.json") in message
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(HistoryNotFoundError, match="no training logs"):
        load_history(tmp_path / "does-not-exist")
