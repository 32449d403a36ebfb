"""Reward calls that hang (steadyrl.rewards.guarded, issue 41 item 4): a finite default timeout, a late call stopped
(not left running in the background) with an error naming the reward and the rank, math-verify working under it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from steadyrl.config.schema import RewardSection
from steadyrl.rewards import bind_reward
from steadyrl.rewards.guarded import GuardedReward, RewardError
from steadyrl.tasks.word_problems import math_answer

COMPLETIONS = ["a", "bb", "ccc", "dddd"]


@pytest.fixture
def release() -> Iterator[threading.Event]:
    """What a hung reward waits on. Released after 5 s so that a broken guard fails the test instead of hanging it."""
    event = threading.Event()
    safety = threading.Timer(5.0, event.set)
    safety.start()
    yield event
    safety.cancel()
    safety.join()
    event.set()


def _guard(fn, **policy) -> GuardedReward:
    return GuardedReward("remote", fn, RewardSection(fn="x:y", **policy), sleep=lambda _: None)


def test_a_reward_that_never_answers_is_stopped_within_its_timeout(monkeypatch, release) -> None:
    monkeypatch.setenv("RANK", "3")
    handler_before = signal.getsignal(signal.SIGURG)

    def hangs(completions, **_):
        try:
            release.wait()  # a reward server that never answers
        except Exception:  # a reward's own catch-all must not swallow the deadline
            return [0.0] * len(completions)
        return [1.0] * len(completions)

    start = time.perf_counter()
    with pytest.raises(RewardError) as info:
        _guard(hangs, timeout=0.2)(completions=COMPLETIONS)
    assert time.perf_counter() - start < 1.5
    assert str(info.value) == (
        "reward 'remote' failed: RewardTimeout: no answer within 0.2 s (reward 'remote' on rank 3; the call was "
        "stopped) (on_error: raise; on_error: retry or skip in its rewards entry rides out a flaky service)."
    )
    assert not release.is_set()  # stopped by the guard, not by the test's safety release
    assert signal.getsignal(signal.SIGURG) == handler_before


def test_a_stopped_call_leaves_nothing_running() -> None:
    finished: list[bool] = []

    def slow(completions, **_):
        for _ in range(20):  # one second of work, then a side effect the run must never see
            time.sleep(0.05)
        finished.append(True)
        return [1.0] * len(completions)

    threads_before = set(threading.enumerate())
    with pytest.raises(RewardError) as info:
        _guard(slow, timeout=0.1)(completions=COMPLETIONS)
    assert set(threading.enumerate()) <= threads_before  # no abandoned call, no watchdog
    time.sleep(1.3)
    assert finished == []
    assert "RewardTimeout: no answer within 0.1 s (reward 'remote' on rank 0; the call was stopped)" in str(info.value)


def test_a_timeout_off_the_main_thread_stops_the_call_too(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    finished: list[bool] = []
    outcome: dict[str, BaseException] = {}

    def slow(completions, **_):
        for _ in range(20):
            time.sleep(0.05)
        finished.append(True)
        return [1.0] * len(completions)

    def caller() -> None:
        try:
            _guard(slow, timeout=0.1)(completions=COMPLETIONS)
        except RewardError as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=caller)
    start = time.perf_counter()
    worker.start()
    worker.join(5.0)
    assert time.perf_counter() - start < 0.8
    time.sleep(1.2)
    assert finished == []
    assert "RewardTimeout: no answer within 0.1 s (reward 'remote' on rank 1; the call was stopped)" in str(
        outcome["error"]
    )


def test_rewards_have_a_finite_default_timeout() -> None:
    assert RewardSection(fn="x:y").timeout == 60.0
    assert RewardSection(fn="x:y", timeout=None).timeout is None  # explicit: wait forever
    assert RewardSection(model="some/rm").timeout == 60.0  # the default is no error on a reward model entry


def test_math_answer_scores_under_a_timeout() -> None:
    policy = RewardSection(fn="math_answer", timeout=5.0)  # math-verify keeps its own SIGALRM timeouts inside
    guard = GuardedReward("math_answer", bind_reward("math_answer", math_answer, {}), policy)
    completions = [
        "The answer is 29.",
        "\\boxed{12}",
        "7 + 3 = 10",
        "no idea",
        [{"role": "assistant", "content": "So Sam has 41 marbles."}],
    ]
    # right, wrong (12 != 13), right (last number 10), no number, right (chat message)
    assert guard(completions=completions, answer=["29", "13", "10", "4", "41"]) == [1.0, 0.0, 1.0, 0.0, 1.0]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_stopped_call_takes_the_processes_it_started_with_it(tmp_path) -> None:
    # a sandboxed executor: the reward runs a child that starts a grandchild, then waits on the child. Stopped, the
    # call's subprocess.run kills the child and the grandchild is orphaned, still running: it must go as well
    import subprocess
    import sys

    pid_file = tmp_path / "grandchild.pid"
    child = (
        "import subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(g.pid)); time.sleep(60)"
    )

    def sandboxed(completions, **_):
        subprocess.run([sys.executable, "-c", child], check=True)
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="RewardTimeout: no answer within 1 s"):
        _guard(sandboxed, timeout=1.0)(completions=COMPLETIONS)
    grandchild = int(pid_file.read_text())
    assert not _alive(grandchild)


def test_a_stopped_call_leaves_no_sigalrm_armed() -> None:
    # math-verify arms SIGALRM per expression; a deadline landing inside must not leave the alarm to fire later
    def arms_an_alarm(completions, **_):
        signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError("late alarm")))
        signal.alarm(2)
        time.sleep(10)
        return [1.0] * len(completions)

    handler = signal.getsignal(signal.SIGALRM)
    try:
        with pytest.raises(RewardError, match="RewardTimeout"):
            _guard(arms_an_alarm, timeout=0.2)(completions=COMPLETIONS)
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert signal.getsignal(signal.SIGALRM) == handler
    finally:  # a broken guard fails this test, not a later one when the alarm fires
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
