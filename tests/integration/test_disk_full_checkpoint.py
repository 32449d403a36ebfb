"""A full disk while TRL writes a checkpoint, through the real CLI on the tiny model (issue 41 item 5): the run stops
with a message naming the file, the free space and the last complete checkpoint (no traceback); the staged folder
is gone and ``resume: auto`` still picks the last complete checkpoint."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

from steadyrl.trainers.checkpoints import STAGING_DIR, find_resume_checkpoint
from tests.integration.test_cli import steadyrl

pytestmark = pytest.mark.slow


class DiskFullAtCheckpoint4(TrainerCallback):
    """(``callbacks`` entry) The disk fills up while TRL writes step 4's optimizer state; 1 GiB is left."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        real_save = torch.save

        def save(obj, file, *a, **k):
            if Path(file).name == "optimizer.pt" and Path(file).parent.name == "checkpoint-4":
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
            return real_save(obj, file, *a, **k)

        torch.save = save
        shutil.disk_usage = lambda path: SimpleNamespace(total=2**40, used=2**40, free=2**30)


class SafetensorsFullAtCheckpoint4(TrainerCallback):
    """(``callbacks`` entry) The disk fills up while step 4's weights are written: safetensors raises its own
    ``SafetensorError`` (not an OSError)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import transformers.modeling_utils as modeling
        from safetensors import SafetensorError

        real_save = modeling.safe_save_file

        def save(tensors, filename, *a, **k):
            if Path(filename).parent.name == "checkpoint-4":
                raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
            return real_save(tensors, filename, *a, **k)

        modeling.safe_save_file = save
        shutil.disk_usage = lambda path: SimpleNamespace(total=2**40, used=2**40, free=2**30)


@pytest.mark.parametrize(
    ("callback", "error"),
    [
        ("DiskFullAtCheckpoint4", "OSError: [Errno 28] No space left on device: '{staged}/optimizer.pt'"),
        ("SafetensorsFullAtCheckpoint4", "SafetensorError: Error while serializing: IoError(Os { code: 28, kind: "
         "StorageFull })"),
    ],
)  # fmt: skip
def test_a_full_disk_while_trl_saves_the_optimizer_stops_the_run_cleanly(tiny_model_dir, tmp_path, callback, error):
    out = tmp_path / "run"
    proc = steadyrl(
        "train", "configs/tiny/grpo.yaml", f"model.path={tiny_model_dir}", f"trainer.output_dir={out}",
        "trainer.max_steps=6", "trainer.save_steps=2", "trainer.per_device_train_batch_size=8",
        "trainer.num_generations=4", "trainer.max_completion_length=4", "eval.enabled=false",
        f"callbacks=[tests.integration.test_disk_full_checkpoint:{callback}]",
    )  # fmt: skip
    staged = out / STAGING_DIR / "checkpoint-4"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        f"steadyrl: stopped: checkpoint-4 was not saved: {error.replace('{staged}', str(staged))} (writing {staged}; "
        f"1.0 GiB free on the disk of {out}). The partial checkpoint was removed. Last complete checkpoint: "
        f"{out / 'checkpoint-2'} (trainer.resume_from_checkpoint: auto resumes from it)."
    )
    assert "Traceback" not in proc.stderr
    assert not staged.exists() and not (out / "checkpoint-4").exists()
    assert find_resume_checkpoint(out) == out / "checkpoint-2"


class SafetensorsFullAtFinal(TrainerCallback):
    """(``callbacks`` entry) The disk fills up while the final model's weights are written."""

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        import transformers.modeling_utils as modeling
        from safetensors import SafetensorError

        def save(tensors, filename, *a, **k):
            raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

        modeling.safe_save_file = save
        shutil.disk_usage = lambda path: SimpleNamespace(total=2**40, used=2**40, free=2**30)


def test_a_full_disk_while_the_final_model_is_written_stops_the_run_cleanly(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    proc = steadyrl(
        "train", "configs/tiny/grpo.yaml", f"model.path={tiny_model_dir}", f"trainer.output_dir={out}",
        "trainer.max_steps=2", "trainer.save_steps=2", "trainer.per_device_train_batch_size=8",
        "trainer.num_generations=4", "trainer.max_completion_length=4", "eval.enabled=false",
        "callbacks=[tests.integration.test_disk_full_checkpoint:SafetensorsFullAtFinal]",
    )  # fmt: skip
    staged = out / STAGING_DIR / "final"
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.rstrip().splitlines()[-1] == (
        "steadyrl: stopped: final was not saved: SafetensorError: Error while serializing: IoError(Os { code: 28, "
        f"kind: StorageFull }}) (writing {staged}; 1.0 GiB free on the disk of {out}). The partial checkpoint was "
        f"removed. Last complete checkpoint: {out / 'checkpoint-2'} (trainer.resume_from_checkpoint: auto resumes "
        "from it)."
    )
    assert "Traceback" not in proc.stderr and not staged.exists() and not (out / "final").exists()


class DiskFullOnRank0ModelWrite(TrainerCallback):
    """(``callbacks`` entry) The main process's disk fills up while it writes step 4's weights, and stays full; the
    other rank's writes succeed. Under DeepSpeed the other rank would go on into DeepSpeed's own ``save_checkpoint``
    and wait there for the main process, whose own writes fail."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        shutil.disk_usage = lambda path: SimpleNamespace(total=2**40, used=2**40, free=2**30)  # one disk
        if args.process_index != 0:
            return
        import transformers.modeling_utils as modeling

        real_save = modeling.safe_save_file

        def save(tensors, filename, *a, **k):
            if Path(filename).parent.name == "checkpoint-4":
                raise OSError(errno.ENOSPC, "No space left on device", str(filename))
            return real_save(tensors, filename, *a, **k)

        modeling.safe_save_file = save
        real_torch_save = torch.save

        def torch_save(obj, file, *a, **k):  # the disk stays full: DeepSpeed's own writes would fail too
            if "checkpoint-4" in str(file):
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
            return real_torch_save(obj, file, *a, **k)

        torch.save = torch_save


class DiskFullInRank1DeepSpeedSave(TrainerCallback):
    """(``callbacks`` entry) The second rank's disk fills up inside DeepSpeed's own ``save_checkpoint``, on its
    optimizer partition of step 4; the main process's writes succeed, and it goes on to DeepSpeed's closing barrier."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        shutil.disk_usage = lambda path: SimpleNamespace(total=2**40, used=2**40, free=2**30)
        if args.process_index != 1:
            return
        real_torch_save = torch.save

        def torch_save(obj, file, *a, **k):
            if "checkpoint-4" in str(file):
                raise OSError(errno.ENOSPC, "No space left on device", str(file))
            return real_torch_save(obj, file, *a, **k)

        torch.save = torch_save


@pytest.mark.parametrize(
    ("callback", "cause"),
    [
        ("DiskFullOnRank0ModelWrite", "rank 0: OSError: [Errno 28] No space left on device: "
         "'{staged}/model.safetensors'"),
        ("DiskFullInRank1DeepSpeedSave", "rank 1: OSError: [Errno 28] No space left on device: "
         "'{staged}/global_step4/zero_pp_rank_1_mp_rank_00_optim_states.pt'"),
    ],
    ids=["rank0_model_write", "rank1_inside_deepspeed_save"],
)  # fmt: skip
def test_a_full_disk_on_one_rank_under_zero2_stops_every_rank_without_a_hang(tiny_model_dir, tmp_path, callback, cause):
    """Rank 0's model write (before DeepSpeed's save) and rank 1's optimizer partition (inside it, while rank 0
    waits in DeepSpeed's closing barrier): both ranks stop with the failing rank's cause, nothing published."""
    pytest.importorskip("deepspeed")
    from tests.integration.test_launch import launch

    out = tmp_path / "run"
    _, proc = launch(
        "zero2.yaml", tiny_model_dir, out, "trainer.max_steps=6", "trainer.save_steps=2", "eval.enabled=false",
        f"callbacks=[tests.integration.test_disk_full_checkpoint:{callback}]", check=False, timeout=300,
    )  # fmt: skip
    staged = out / STAGING_DIR / "checkpoint-4"
    assert proc.returncode != 0, proc.stderr[-3000:]
    expected = (
        f"steadyrl: stopped: checkpoint-4 was not saved: {cause.format(staged=staged)} (writing {staged}; 1.0 GiB "
        f"free on the disk of {out}). The partial checkpoint was removed. Last complete checkpoint: "
        f"{out / 'checkpoint-2'} (trainer.resume_from_checkpoint: auto resumes from it)."
    )
    assert proc.stderr.count(expected) == 2, proc.stderr[-4000:]  # both ranks stop with the failing rank's cause
    # the one traceback is torchrun's own, reporting the workers' exit code 1; none from a worker
    assert proc.stderr.count("Traceback (most recent call last)") == 1 and "raise ChildFailedError(" in proc.stderr
    assert "PeerSaveError" not in proc.stderr and "CheckpointSaveError" not in proc.stderr
    assert not staged.exists() and not (out / "checkpoint-4").exists()
    assert find_resume_checkpoint(out) == out / "checkpoint-2"
    # DeepSpeed's pointer to its tag, written after its closing barrier
    assert (out / "checkpoint-2" / "latest").read_text() == "global_step2"
