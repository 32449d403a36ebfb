"""Checkpoint integrity (steadyrl.trainers.integrity): the marker's size + hash of every file, the fallback of
``resume_from_checkpoint: auto`` past a damaged checkpoint, the refusal of a damaged explicit path."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from steadyrl.config import ConfigError
from steadyrl.trainers.build import _resume_path
from steadyrl.trainers.checkpoints import (
    COMPLETE_MARKER,
    find_resume_checkpoint,
    publish_checkpoint,
    verify_checkpoint,
)
from steadyrl.trainers.integrity import manifest

WEIGHTS = b"\x00\x01weights" * 1000  # 9,000 bytes


def _checkpoint(run: Path, step: int) -> Path:
    """A published checkpoint-<step> with a model file, a nested file and trainer_state.json."""
    staged = run / ".staging" / f"checkpoint-{step}"
    (staged / "sub").mkdir(parents=True)
    (staged / "model.safetensors").write_bytes(WEIGHTS)
    (staged / "sub" / "rng.pth").write_bytes(b"rng")
    (staged / "trainer_state.json").write_text("{}")
    publish_checkpoint(staged, run / f"checkpoint-{step}", step, num_processes=1)
    return run / f"checkpoint-{step}"


def test_marker_records_size_and_sha256_of_every_file(tmp_path) -> None:
    folder = _checkpoint(tmp_path, 2)
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    assert marker["global_step"] == 2 and marker["num_processes"] == 1
    assert marker["files"] == {
        "model.safetensors": {"size": 9000, "sha256": hashlib.sha256(WEIGHTS).hexdigest()},
        "sub/rng.pth": {"size": 3, "sha256": hashlib.sha256(b"rng").hexdigest()},
        "trainer_state.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
    }
    assert manifest(folder, exclude=frozenset({COMPLETE_MARKER})) == marker["files"]
    assert verify_checkpoint(folder) is None


def test_truncated_file_auto_falls_back_with_a_warning_naming_it(tmp_path, caplog) -> None:
    older, newest = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    (newest / "model.safetensors").write_bytes(WEIGHTS[:4096])
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint(tmp_path) == older
    problem = (
        f"{newest / 'model.safetensors'} has 4096 bytes, the completion marker recorded 9000 (truncated or overwritten)"
    )
    assert verify_checkpoint(newest) == problem
    assert f"checkpoint {newest} is damaged, falling back to an older one: {problem}" in caplog.text


def test_bit_flip_is_found_by_the_hash(tmp_path) -> None:
    older, newest = _checkpoint(tmp_path, 2), _checkpoint(tmp_path, 4)
    flipped = bytearray(WEIGHTS)
    flipped[5000] ^= 0x01
    (newest / "model.safetensors").write_bytes(bytes(flipped))
    assert verify_checkpoint(newest) == (
        f"{newest / 'model.safetensors'} does not match the sha256 hash in the completion marker (its bytes changed)"
    )
    assert find_resume_checkpoint(tmp_path) == older


def test_missing_file_and_unreadable_marker(tmp_path) -> None:
    folder = _checkpoint(tmp_path, 2)
    (folder / "sub" / "rng.pth").unlink()
    assert verify_checkpoint(folder) == f"{folder / 'sub' / 'rng.pth'} is missing"
    (folder / COMPLETE_MARKER).write_text('{"global_step": 2, "fi')
    assert verify_checkpoint(folder).startswith(f"{folder / COMPLETE_MARKER} cannot be read: ")


def test_explicit_damaged_path_is_an_error_naming_the_file(tmp_path) -> None:
    newest = _checkpoint(tmp_path, 4)
    (newest / "model.safetensors").write_bytes(b"")
    cfg = SimpleNamespace(trainer={"output_dir": str(tmp_path), "resume_from_checkpoint": str(newest)})
    with pytest.raises(ConfigError) as info:
        _resume_path(cfg)
    assert str(info.value) == (
        f"trainer.resume_from_checkpoint: {newest} is damaged: {newest / 'model.safetensors'} has 0 bytes, the "
        "completion marker recorded 9000 (truncated or overwritten). Resume from an older checkpoint, or with auto "
        "(the newest one that verifies)"
    )
    cfg.trainer["resume_from_checkpoint"] = "auto"
    with pytest.raises(ConfigError, match=r"every complete checkpoint in .* is damaged \(.*model.safetensors has 0"):
        _resume_path(cfg)  # the only checkpoint is damaged: refuse rather than silently start afresh


def test_marker_without_a_file_list_is_trusted(tmp_path) -> None:
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "trainer_state.json").write_text("{}")
    (folder / COMPLETE_MARKER).write_text(json.dumps({"global_step": 3}))  # written before this check existed
    assert verify_checkpoint(folder) is None
    assert find_resume_checkpoint(tmp_path) == folder
