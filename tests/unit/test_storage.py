"""The storage plan's arithmetic (steadyrl/storage.py) on hand-computed cases, and when it refuses or warns."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from steadyrl import storage
from steadyrl.storage import ModelSize, StorageError, StoragePlan, check, plan


def _plan(size: ModelSize, **kw) -> StoragePlan:
    args = dict(ranks=8, zero=True, save_total_limit=3, saves=0, error_feedback=False, disk_snapshots=True,
                best_gold=True, output_dir="/nonexistent-output")  # fmt: skip
    return plan(size, **{**args, **kw})


def test_full_fine_tuning_under_zero_by_hand():
    # P = P_t = 1000 bf16 weights on 8 ZeRO ranks: weights 2,000; Adam 2 x 1000 x 4 + fp32 master 4,000 = 12,000;
    # DeepSpeed's model states 2,000 -> checkpoint 16,000, 3 kept; snapshots: the weights once on the first rank
    # + each rank its 12,000 / 8 of the state = 14,000; best-gold 14,000; steady 48,000 + 14,000 + 14,000; peak + the
    # largest (16,000)
    p = _plan(ModelSize(1000, 1000, 2, False))
    assert (p.checkpoint, p.checkpoints_kept, p.snapshots, p.best_gold) == (16_000, 3, 14_000, 14_000)
    assert (p.steady, p.peak) == (76_000, 92_000)
    # DDP: no master copy, moments in the weights' dtype (bf16); the first rank snapshots the replicas' state once
    ddp = _plan(ModelSize(1000, 1000, 2, False), zero=False, ranks=2, error_feedback=True)
    assert (ddp.checkpoint, ddp.snapshots, ddp.best_gold) == (2000 + 4000 + 8000, 2000 + 4000, 6000)


def test_lora_counts_the_fp32_adapter_and_a_known_number_of_saves():
    # 10 trainable of 1000: adapter 40 bytes, Adam 80; 5 saves of which save_total_limit 3 stay; 2 saves, 2 stay;
    # no limit: every save stays
    lora = ModelSize(1000, 10, 2, True)
    assert _plan(lora, zero=False, saves=5).checkpoint == 120
    assert [_plan(lora, saves=s, save_total_limit=lim).checkpoints_kept for s, lim in ((5, 3), (2, 3), (7, None))] == [
        3, 2, 7,
    ]  # fmt: skip
    assert _plan(lora, zero=True).checkpoint == 40 + 80 + 40 + 40  # + master 40 + DeepSpeed's adapter states 40


def test_refuses_past_the_free_space_warns_near_it_and_counts_what_a_resume_replaces():
    p = StoragePlan(checkpoint=100_000, checkpoints_kept=2, snapshots=0, best_gold=50_000, free=300_000, ranks=1)
    assert p.peak == 350_000
    with pytest.raises(StorageError, match=r"up to 350.0 kB .* which has 300.0 kB free .*save_total_limit"):
        check(p, "out")
    resumed = StoragePlan(
        100_000, 2, 0, 50_000, free=300_000, ranks=1, existing=100_000
    )  # an earlier run's checkpoint goes
    assert check(resumed, "out") is not None and "will write up to 350.0 kB" in check(resumed, "out")
    assert check(StoragePlan(100_000, 2, 0, 50_000, free=1_000_000, ranks=1), "out") is None
    assert check(StoragePlan(100_000, 2, 0, 50_000, free=None, ranks=1), "out") is None  # unknown: nothing said
    assert storage.human(2.5e9) == "2.5 GB" and storage.human(None) == "?"


def test_a_report_that_cannot_be_written_is_a_warning_with_its_content_and_the_old_file_stays_whole(
    tmp_path, monkeypatch, caplog
):
    path = tmp_path / "eval_results.json"
    assert storage.write_report(path, '{"accuracy": 0.5}') and path.read_text() == '{"accuracy": 0.5}'
    real = Path.write_text

    def full_disk(self, *args, **kwargs):
        real(self, '{"accu')  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    monkeypatch.setattr(storage, "free_bytes", lambda path: 0)
    with caplog.at_level(logging.WARNING, logger="steadyrl"):
        assert storage.write_report(path, '{"accuracy": 0.75}') is False
    assert path.read_text() == '{"accuracy": 0.5}' and [p.name for p in tmp_path.iterdir()] == ["eval_results.json"]
    assert caplog.messages == [
        f"could not write {path} ([Errno 28] No space left on device: '{tmp_path / '.eval_results.json.tmp'}'; 0.0 kB "
        'free on that disk); the run, its model and its checkpoints are unaffected; its content:\n{"accuracy": 0.75}'
    ]
