"""The test helper that runs 2-rank workers with a deadline: a hung rank fails the test instead of blocking CI."""

from __future__ import annotations

import time

import pytest

from tests.integration.helpers import spawn_or_fail

pytestmark = pytest.mark.slow  # two spawned processes and a 15 s deadline


def _hang_on_rank_1(rank: int, seconds: float) -> None:
    if rank == 1:
        time.sleep(seconds)


def test_a_hung_rank_fails_with_its_rank_and_the_deadline():
    # rank 0 is normally done by then; on a loaded machine it may still be importing torch, and is then named too
    pattern = r"_hang_on_rank_1: rank\(s\) \[(0, )?1\] still running after 15 s"
    with pytest.raises(pytest.fail.Exception, match=pattern):
        spawn_or_fail(_hang_on_rank_1, (120.0,), timeout=15.0)
    spawn_or_fail(_hang_on_rank_1, (0.0,), timeout=300.0)  # both ranks finish: no failure (generous: a loaded box)
