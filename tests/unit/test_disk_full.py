"""A full disk at each write site (issue 41 item 5): a checkpoint save fails with a message naming the path, the free
space and the last complete checkpoint, leaves no staged folder and no effect on ``resume: auto``; a metrics row
that cannot be written is counted and warned about, and the run goes on."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import accelerate.utils
import pytest
import torch

from steadyrl.callbacks import metrics_log
from steadyrl.callbacks.metrics_log import MetricsLog
from steadyrl.trainers.checkpoints import (
    COMPLETE_MARKER,
    CheckpointSaveError,
    GuardState,
    find_resume_checkpoint,
    is_complete_checkpoint,
    save_atomically,
    save_steady_state,
)

ACC = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)
FREE = 3 * 2**29  # 1.5 GiB
REAL_WRITE_BYTES, REAL_WRITE_TEXT, REAL_TORCH_SAVE = Path.write_bytes, Path.write_text, torch.save


def _enospc(path: Path) -> OSError:
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def _write(staging_root: Path, folder: Path) -> None:
    """What SteadyGRPOTrainer hands ``save_atomically``: the Trainer's files (TRL's save), then steadyrl's state."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"weights" * 100)
    (folder / "trainer_state.json").write_text("{}")
    save_steady_state(folder, GuardState(), {"step": 0, "buffered_inputs": None}, rank=0, is_main_process=True)


@pytest.fixture
def run(tmp_path, monkeypatch) -> Path:
    """A run folder with one complete checkpoint (step 2) on a disk with 1.5 GiB free."""
    save_atomically(ACC, tmp_path, 2, None, _write)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**40, used=2**40 - FREE, free=FREE))
    return tmp_path


def _fail_path_method(monkeypatch, name: str, real, file: str) -> None:
    def fake(self, data, *args, **kwargs):
        if self.name == file:
            real(self, data[:5], *args, **kwargs)  # a few bytes reach the disk before it is full
            raise _enospc(self)
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, name, fake)


def _fail_torch_save(monkeypatch, file: str) -> None:
    def fake(obj, path, *args, **kwargs):
        if Path(path).name == file:  # torch.save reports a full disk as a RuntimeError
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")
        return REAL_TORCH_SAVE(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", fake)


SITES = {
    "trainer_files": (
        lambda mp: _fail_path_method(mp, "write_bytes", REAL_WRITE_BYTES, "model.safetensors"),
        "OSError: [Errno 28] No space left on device: '{staged}/model.safetensors'",
    ),
    "guard_state": (
        lambda mp: _fail_torch_save(mp, "steadyrl_state.pt"),
        "RuntimeError: [enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file",
    ),
    "completion_marker": (
        lambda mp: _fail_path_method(mp, "write_text", REAL_WRITE_TEXT, COMPLETE_MARKER),
        f"OSError: [Errno 28] No space left on device: '{{staged}}/{COMPLETE_MARKER}'",
    ),
}


@pytest.mark.parametrize("site", list(SITES))
def test_a_full_disk_at_each_checkpoint_write_site(run, monkeypatch, site) -> None:
    inject, error = SITES[site]
    staged = run / ".staging" / "checkpoint-4"
    with monkeypatch.context() as disk_full:
        inject(disk_full)
        with pytest.raises(CheckpointSaveError) as info:
            save_atomically(ACC, run, 4, None, _write)
    assert str(info.value) == (
        f"checkpoint-4 was not saved: {error.format(staged=staged)} (writing {staged}; 1.5 GiB free on the disk of "
        f"{run}). The partial checkpoint was removed. Last complete checkpoint: {run / 'checkpoint-2'} "
        "(trainer.resume_from_checkpoint: auto resumes from it)."
    )
    assert not staged.exists() and not (run / "checkpoint-4").exists()
    assert find_resume_checkpoint(run) == run / "checkpoint-2"  # verified: the failed save changed nothing
    save_atomically(ACC, run, 4, None, _write)  # space is back: the same step saves
    assert find_resume_checkpoint(run) == run / "checkpoint-4" and is_complete_checkpoint(run / "checkpoint-4")


def test_another_ranks_failure_stops_this_one_and_nothing_is_published(run, monkeypatch) -> None:
    rank1 = "OSError: [Errno 28] No space left on device: '/node2/steadyrl_rank1.pt'"
    calls = iter([[None, None]])  # the space check before the save passes on both ranks; rank 1's write fails
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda texts: next(calls, [texts[0], rank1]))
    staged = run / ".staging" / "checkpoint-4"
    with pytest.raises(CheckpointSaveError) as info:
        save_atomically(SimpleNamespace(**{**vars(ACC), "num_processes": 2}), run, 4, None, _write)
    assert str(info.value).startswith(f"checkpoint-4 was not saved: rank 1: {rank1} (writing {staged}; 1.5 GiB free")
    assert not staged.exists() and not (run / "checkpoint-4").exists()
    assert find_resume_checkpoint(run) == run / "checkpoint-2"


def test_a_staged_folder_left_by_a_crash_is_removed_at_the_next_save(run) -> None:
    crashed = run / ".staging" / "checkpoint-3"  # a save of step 3 killed mid-write
    crashed.mkdir(parents=True)
    (crashed / "model.safetensors").write_bytes(b"half")
    save_atomically(ACC, run, 4, None, _write)
    assert not crashed.exists()
    assert sorted(p.name for p in run.iterdir()) == [".staging", "checkpoint-2", "checkpoint-4"]


def test_a_metrics_row_on_a_full_disk_is_counted_and_warned_about(run, monkeypatch, caplog) -> None:
    log = MetricsLog(run)
    log.write({"step": 1, "loss": 0.5})
    path = run / "metrics.jsonl"

    def full(file, *args, **kwargs):
        raise _enospc(file)

    with monkeypatch.context() as disk_full, caplog.at_level(logging.WARNING, logger=metrics_log.__name__):
        disk_full.setattr(metrics_log, "open", full, raising=False)
        log.write({"step": 2, "loss": 0.4})
        log.event(2, "skip", reason="spike")
    assert log.lost_rows == 2
    assert caplog.messages == [  # one warning for the streak, not one per row
        f"could not append a row to {path}: OSError: [Errno 28] No space left on device: '{path}' (1.5 GiB free "
        f"on the disk of {run}). Training goes on: the rows not written are counted (a metrics_rows_lost row follows "
        "once writing works again) and the Trainer's log_history keeps the logged ones; a disk that stays full "
        f"stops the run at the next checkpoint. Last complete checkpoint: {run / 'checkpoint-2'} "
        "(trainer.resume_from_checkpoint: auto resumes from it)."
    ]
    log.write({"step": 3, "loss": 0.3})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 0.5},
        {"step": 3, "event": "metrics_rows_lost", "rows": 2},
        {"step": 3, "loss": 0.3},
    ]
    assert log.lost_rows == 0


def test_a_save_is_not_started_when_the_disk_has_less_room_than_the_last_checkpoint_took(run, monkeypatch) -> None:
    # agreed by every rank before any writes (under DeepSpeed, a rank failing its first file while the others sat in
    # DeepSpeed's own save collectives hung them all); the last complete checkpoint stays as it is
    size = sum(f.stat().st_size for f in (run / "checkpoint-2").rglob("*") if f.is_file())
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**40, used=2**40, free=size - 1))
    with pytest.raises(CheckpointSaveError) as info:
        save_atomically(ACC, run, 4, None, _write)
    assert str(info.value) == (
        f"checkpoint-4 was not started: OSError: [Errno 28] 0.0 MiB free on the disk of {run}, and checkpoint-2 took "
        "0.0 MiB. Free space on that disk (or lower trainer.save_total_limit: the newest checkpoint is written before "
        f"the oldest is removed). Last complete checkpoint: {run / 'checkpoint-2'} (trainer.resume_from_checkpoint: "
        "auto resumes from it)."
    )
    assert not (run / ".staging" / "checkpoint-4").exists() and find_resume_checkpoint(run) == run / "checkpoint-2"
    # another rank short of space (a node-local disk) stops this one too, before it writes anything
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=2**40, used=0, free=2**40))
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda texts: [texts[0], "OSError: node 2 is full"])
    with pytest.raises(CheckpointSaveError, match=r"checkpoint-4 was not started: rank 1: OSError: node 2 is full\."):
        save_atomically(SimpleNamespace(**{**vars(ACC), "num_processes": 2}), run, 4, None, _write)
    assert not (run / ".staging" / "checkpoint-4").exists()
