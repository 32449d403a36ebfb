"""A checkpoint's recorded number of processes against the resuming launch's (issue 41, item 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadyrl.config import load_config
from steadyrl.config.loader import ConfigError
from steadyrl.trainers.build import _check_resume_world_size
from steadyrl.trainers.checkpoints import COMPLETE_MARKER, saved_num_processes

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(tmp_path: Path, marker: dict | None) -> Path:
    folder = tmp_path / "checkpoint-3"
    folder.mkdir(parents=True)
    if marker is not None:
        (folder / COMPLETE_MARKER).write_text(json.dumps(marker))
    return folder


def test_saved_num_processes_reads_the_marker(tmp_path: Path) -> None:
    assert saved_num_processes(_checkpoint(tmp_path / "a", {"global_step": 3, "num_processes": 2})) == 2
    assert saved_num_processes(_checkpoint(tmp_path / "b", {"global_step": 3})) is None  # an older marker
    assert saved_num_processes(_checkpoint(tmp_path / "c", None)) is None


@pytest.fixture
def cfg(tmp_path: Path):
    return load_config(REPO / "configs" / "tiny" / "grpo.yaml", [f"trainer.output_dir={tmp_path / 'run'}"])


def test_deepspeed_refuses_another_number_of_processes_naming_both_and_the_fix(tmp_path, cfg, monkeypatch) -> None:
    folder = _checkpoint(tmp_path, {"global_step": 3, "num_processes": 2})
    (folder / "latest").write_text("global_step3")  # DeepSpeed's pointer to its tag
    _check_resume_world_size(folder, 1, cfg)  # DDP: resumes (per-rank state dropped at load time)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    _check_resume_world_size(folder, 2, cfg)  # the same number: fine
    with pytest.raises(ConfigError) as err:
        _check_resume_world_size(folder, 1, cfg)
    message = str(err.value)
    assert "written by 2 processes and this DeepSpeed run has 1" in message
    assert "--num_processes 2" in message and '"load_universal": true' in message
    # HF Trainer checkpoints lack DeepSpeed's universal_checkpoint_info: without --inject_missing_state the conversion
    # stops ("Required universal_checkpoint_info state is missing"); DeepSpeed then reads the tag in latest_universal
    # (the recipe was run by hand: 1 -> 2 ZeRO-2 processes, resume, then a gold rollback on both ranks)
    assert (
        f"python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state --input_folder "
        f"{folder / 'global_step3'} --output_folder {folder / 'global_step3'}_universal; then echo "
        f"global_step3_universal > {folder / 'latest_universal'})" in message
    )
    # the fix it names is let through: a universal checkpoint loads on any number of processes
    universal = load_config(
        REPO / "configs" / "tiny" / "grpo.yaml",
        [f"trainer.output_dir={tmp_path / 'u'}", "trainer.deepspeed={zero_optimization: {stage: 2}, "
         "checkpoint: {load_universal: true}}"],
    )  # fmt: skip
    _check_resume_world_size(folder, 1, universal)
