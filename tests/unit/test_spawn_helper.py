"""The test helper that runs 2-rank workers with a deadline: a hung rank fails the test instead of blocking CI,
with its stack; a hang that does not come back on a retry is warned about, one that does fails."""

from __future__ import annotations

import time

import pytest
import torch

from tests.integration.spawn import spawn_or_fail

pytestmark = pytest.mark.slow  # spawned processes and 8-12 s deadlines


def _hang_on_rank_1(rank: int, seconds: float) -> None:
    if rank == 1:
        time.sleep(seconds)


def _threads_then_hang_on_first_attempt(rank: int, out: str, attempt: int) -> None:
    torch.save(torch.get_num_threads(), f"{out}/threads{rank}-{attempt}.pt")
    if attempt == 0 and rank == 1:
        time.sleep(60.0)


def test_a_hung_rank_fails_with_its_rank_its_stack_and_the_deadline():
    # rank 0 is normally done by then; on a loaded machine it may still be importing torch, and is then named too
    pattern = r"_hang_on_rank_1: rank\(s\) \[(0, )?1\] still running after 8 s"
    # a hang that comes back on the retry fails; the first one was a warning
    with pytest.raises(pytest.fail.Exception, match=pattern) as failure:
        with pytest.warns(UserWarning, match=pattern + r"[\s\S]*attempt 1 of 2; running it again"):
            spawn_or_fail(_hang_on_rank_1, (60.0,), timeout=8.0, retries=1)
    # the hung rank's Python stack is in the message: where it hung, not only that it did
    assert "--- rank 1 ---" in str(failure.value) and "in _hang_on_rank_1" in str(failure.value)


def test_a_hang_gone_on_the_retry_is_a_warning_and_each_rank_runs_one_thread(tmp_path):
    with pytest.warns(UserWarning, match=r"still running after 12 s[\s\S]*attempt 1 of 2; running it again"):
        done = spawn_or_fail(
            _threads_then_hang_on_first_attempt, lambda attempt: (str(tmp_path), attempt), timeout=12.0, retries=1
        )
    assert done == 1
    assert [torch.load(tmp_path / f"threads{r}-1.pt") for r in range(2)] == [1, 1]
