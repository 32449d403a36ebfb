"""``async def`` rewards (an LLM judge, a remote verifier; issue 57 item 4): awaited by TRL on its event loop with the
same error policy as a plain reward, a timeout that cancels the awaited call, and run to completion outside TRL."""

from __future__ import annotations

import asyncio
import time

import pytest
from trl.trainer.utils import is_async_callable

from steadyrl.config.schema import RewardSection
from steadyrl.rewards import bind_reward
from steadyrl.rewards.guarded import AsyncGuardedReward, GuardedReward, RewardError, call_reward, guarded_reward

COMPLETIONS = ["a", "bb", "ccc", "dddd"]


async def judge(completions, **_):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def _guard(fn, **policy) -> tuple[GuardedReward, list[float]]:
    sleeps: list[float] = []

    async def pause(seconds: float) -> None:
        sleeps.append(seconds)

    guard = guarded_reward("judge", bind_reward("judge", fn, {}), RewardSection(fn="x:y", **policy))
    guard.sleep = pause
    return guard, sleeps


def test_an_async_reward_stays_async_so_trl_awaits_it():
    guard, _ = _guard(judge)
    assert isinstance(guard, AsyncGuardedReward) and is_async_callable(guard)
    assert is_async_callable(bind_reward("judge", judge, {"x": 1}))
    assert asyncio.run(guard(prompts=["p"] * 4, completions=COMPLETIONS)) == [1.0, 2.0, 3.0, 4.0]
    # a plain reward keeps the plain wrapper (TRL calls it in its own thread)
    plain = guarded_reward("n", bind_reward("n", lambda completions, **_: [0.0] * 4, {}), RewardSection(fn="x:y"))
    assert type(plain) is GuardedReward and not is_async_callable(plain)


def test_an_async_reward_past_its_timeout_is_cancelled_and_named(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    seen: list[str] = []

    async def never_answers(completions, **_):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        return [1.0] * len(completions)

    guard, _ = _guard(never_answers, timeout=0.2)
    start = time.perf_counter()
    with pytest.raises(RewardError) as info:
        asyncio.run(guard(completions=COMPLETIONS))
    assert time.perf_counter() - start < 1.5 and seen == ["cancelled"]
    assert str(info.value) == (
        "reward 'judge' failed: RewardTimeout: no answer within 0.2 s (reward 'judge' on rank 2; the call was "
        "cancelled) (on_error: raise; on_error: retry or skip in its rewards entry rides out a flaky service)."
    )


def test_the_error_policy_is_the_plain_rewards():
    calls = {"n": 0}

    async def flaky(completions, **_):
        calls["n"] += 1
        if calls["n"] in (1, 3, 4):
            raise ConnectionError(f"judge dropped call {calls['n']}")
        return [0.5] * len(completions)

    guard, sleeps = _guard(flaky, on_error="retry", retries=2, backoff=0.5)
    assert asyncio.run(guard(completions=COMPLETIONS)) == [0.5] * 4  # call 1 failed, call 2 answered
    assert sleeps == [0.5]
    guard, sleeps = _guard(flaky, on_error="skip", retries=1, backoff=1.0, max_consecutive_errors=2)
    assert asyncio.run(guard(completions=COMPLETIONS)) == [None] * 4  # calls 3 and 4 failed: unscorable
    assert sleeps == [1.0] and guard.consecutive_skips == 1

    async def wrong_shape(completions, **_):
        return 0.5

    guard, _ = _guard(wrong_shape, on_error="skip")
    with pytest.raises(RewardError, match="reward 'judge' returned float"):  # a broken contract is never skipped
        asyncio.run(guard(completions=COMPLETIONS))


def test_call_reward_runs_an_async_reward_to_its_end_outside_trl():
    assert call_reward(judge, completions=["ab"]) == [2.0]
    assert call_reward(lambda completions: [7.0], completions=["ab"]) == [7.0]
