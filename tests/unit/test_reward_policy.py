"""Reward functions as unreliable services (steadyrl.rewards.guarded): raise, retry, skip, timeout, checked returns."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from steadyrl.config import ConfigError
from steadyrl.config.loader import load_config_tree
from steadyrl.config.schema import RewardSection, RunConfig
from steadyrl.rewards import required_columns
from steadyrl.rewards.guarded import GuardedReward, RewardError, check_scores

COMPLETIONS = ["a", "bb", "ccc", "dddd"]


class Flaky:
    """Raises ConnectionError on the first ``failures`` calls, then scores len(completion)."""

    def __init__(self, failures: int) -> None:
        self.failures, self.calls = failures, 0

    def __call__(self, completions, **_):
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError(f"reward server refused call {self.calls}")
        return [float(len(c)) for c in completions]


class Recorder:
    def __init__(self) -> None:
        self.metrics: list[tuple[str, float]] = []
        self.sleeps: list[float] = []

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.append((name, value))


def _guard(fn, out_dir=None, **policy) -> tuple[GuardedReward, Recorder]:
    rec = Recorder()
    return GuardedReward("remote", fn, RewardSection(fn="x:y", **policy), out_dir, sleep=rec.sleeps.append), rec


def _complete_checkpoint(run: Path, step: int) -> Path:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    (folder / "steadyrl_complete.json").write_text(json.dumps({"global_step": step}))
    return folder


def test_raise_names_the_function_the_error_and_the_checkpoint(tmp_path) -> None:
    ckpt = _complete_checkpoint(tmp_path, 4)
    guard, rec = _guard(Flaky(1), tmp_path)
    with pytest.raises(RewardError) as info:
        guard(completions=COMPLETIONS, log_metric=rec.log_metric)
    assert str(info.value) == (
        "reward 'remote' failed: ConnectionError: reward server refused call 1 (on_error: raise; on_error: retry or "
        f"skip in its rewards entry rides out a flaky service). Last complete checkpoint: {ckpt} "
        "(trainer.resume_from_checkpoint: auto resumes from it)."
    )
    assert isinstance(info.value.__cause__, ConnectionError)
    assert rec.sleeps == [] and rec.metrics == []  # raise: no retry, no metric (the run stops)


def test_retry_that_recovers_waits_with_doubling_backoff_and_counts_the_errors() -> None:
    fn = Flaky(2)
    guard, rec = _guard(fn, on_error="retry", retries=3, backoff=0.5)
    assert guard(completions=COMPLETIONS, log_metric=rec.log_metric) == [1.0, 2.0, 3.0, 4.0]
    assert fn.calls == 3 and rec.sleeps == [0.5, 1.0]
    assert rec.metrics == [("rewards/remote/errors", 2.0), ("rewards/remote/skipped", 0.0)]


def test_retry_that_never_recovers_stops_the_run(tmp_path) -> None:
    guard, rec = _guard(Flaky(10), tmp_path, on_error="retry", retries=2, backoff=0.0)
    with pytest.raises(RewardError) as info:
        guard(completions=COMPLETIONS)
    assert str(info.value) == (
        "reward 'remote' failed 3 attempts in a row (on_error: retry, retries: 2); last error: ConnectionError: "
        f"reward server refused call 3. No complete checkpoint in {tmp_path} yet."
    )
    assert rec.sleeps == [0.0, 0.0]


def test_skip_scores_unscorable_counts_and_stops_after_k_in_a_row(tmp_path) -> None:
    ckpt = _complete_checkpoint(tmp_path, 2)
    guard, rec = _guard(Flaky(100), tmp_path, on_error="skip", retries=1, backoff=0.0, max_consecutive_errors=3)
    for _ in range(2):
        assert guard(completions=COMPLETIONS, log_metric=rec.log_metric) == [None] * 4
    assert guard.consecutive_skips == 2
    assert rec.metrics == [("rewards/remote/errors", 2.0), ("rewards/remote/skipped", 1.0)] * 2
    with pytest.raises(RewardError) as info:
        guard(completions=COMPLETIONS, log_metric=rec.log_metric)
    assert str(info.value) == (
        "reward 'remote' failed 3 calls in a row (on_error: skip, max_consecutive_errors: 3); last error: "
        f"ConnectionError: reward server refused call 6. Last complete checkpoint: {ckpt} "
        "(trainer.resume_from_checkpoint: auto resumes from it)."
    )


def test_a_success_resets_the_skip_streak() -> None:
    fn = Flaky(2)  # calls 1, 2 fail (one skipped call with retries=1), call 3 succeeds
    guard, _ = _guard(fn, on_error="skip", retries=1, backoff=0.0, max_consecutive_errors=2)
    assert guard(completions=COMPLETIONS) == [None] * 4 and guard.consecutive_skips == 1
    assert guard(completions=COMPLETIONS) == [1.0, 2.0, 3.0, 4.0] and guard.consecutive_skips == 0


def test_timeout_counts_a_slow_call_as_failed() -> None:
    calls = []

    def slow_then_fast(completions, **_):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(2.0)
        return [0.5] * len(completions)

    guard, rec = _guard(slow_then_fast, on_error="retry", retries=1, backoff=0.0, timeout=0.2)
    start = time.perf_counter()
    assert guard(completions=COMPLETIONS, log_metric=rec.log_metric) == [0.5] * 4
    assert time.perf_counter() - start < 1.5  # the slow attempt was abandoned, not awaited
    assert rec.metrics[0] == ("rewards/remote/errors", 1.0)


def test_timeout_error_text_under_raise() -> None:
    guard, _ = _guard(lambda completions, **_: time.sleep(1.0), timeout=0.05)
    with pytest.raises(RewardError, match=r"^reward 'remote' failed: RewardTimeout: no answer within 0.05 s \("):
        guard(completions=COMPLETIONS)


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (
            ["1.0", "2.0", "0", "1"],
            "reward 'remote' returned a list containing str (e.g. '1.0' at index 0); each entry must be a float, "
            "an int or None (unscorable)",
        ),
        (
            [1.0, 2.0, 3.0],
            "reward 'remote' returned 3 values for 4 completions (first value: 1.0); it must return exactly one per "
            "completion",
        ),
        (
            0.5,
            "reward 'remote' returned float (0.5); a reward function returns a list with one float (or None for "
            "unscorable) per completion",
        ),
        (
            "1.0",
            "reward 'remote' returned str ('1.0'); a reward function returns a list with one float (or None for "
            "unscorable) per completion",
        ),
    ],
)
def test_a_wrong_return_is_an_error_whatever_the_policy(out, message) -> None:
    guard, rec = _guard(lambda completions, **_: out, on_error="skip", backoff=0.0)
    with pytest.raises(RewardError) as info:
        guard(completions=COMPLETIONS)
    assert str(info.value) == message
    assert rec.sleeps == []  # not retried: the same inputs give the same wrong answer


def test_numbers_none_numpy_and_tensors_pass() -> None:
    assert check_scores("r", [1, 0.5, None, np.float32(2.0)], 4) == [1, 0.5, None, np.float32(2.0)]
    assert check_scores("r", torch.tensor([1.0, 2.0]), 2) == [1.0, 2.0]
    assert check_scores("r", [torch.tensor(3.0)], 1) == [torch.tensor(3.0)]


def test_guard_keeps_the_name_and_the_signature_of_the_function() -> None:
    def needs_answer(completions, answer, **_):
        return [1.0] * len(completions)

    guard, _ = _guard(needs_answer)
    assert guard.__name__ == "remote"
    assert required_columns(guard) == {"answer"}


def _config(tmp_path: Path, rewards: str, overrides: list[str] | None = None) -> RunConfig:
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {{path: m}}\ndata: {{path: d}}\ntrainer: {{output_dir: o}}\nrewards:\n{rewards}")
    return RunConfig.from_tree(*load_config_tree(path, overrides))


def test_policy_keys_are_validated_with_their_origin(tmp_path) -> None:
    cfg = _config(tmp_path, "  - {fn: exact_match, on_error: skip, retries: 1, backoff: 0.1, timeout: 5}\n")
    entry = cfg.rewards[0]
    assert (entry.on_error, entry.retries, entry.backoff, entry.timeout) == ("skip", 1, 0.1, 5)
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, "  - {fn: exact_match, on_error: ignore}\n")
    assert str(info.value) == (
        f"rewards[0].on_error (set in {tmp_path / 'run.yaml'}): must be one of ['raise', 'retry', 'skip'], got 'ignore'"
    )
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.on_error \(set in .*\): applies to `fn` rewards only"):
        _config(tmp_path, "  - {model: some/rm, on_error: retry}\n")
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.timeout \(set in .*\): must be > 0 \(or null\), got 0$"):
        _config(tmp_path, "  - {fn: exact_match, timeout: 0}\n")
