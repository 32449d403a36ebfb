"""Reward functions as unreliable services: a per-reward error policy, a timeout per call, checked returns.

Every ``fn`` entry of ``rewards`` is wrapped in a ``GuardedReward`` (``steadyrl.trainers.build``). Its config keys
live on the entry itself (``RewardSection``):

- ``on_error: raise`` (default): the first exception stops the run with a ``RewardError`` naming the function, the
  error and the last complete checkpoint.
- ``on_error: retry``: up to ``retries`` more attempts, waiting ``backoff`` seconds before the first and doubling
  the wait each time; when every attempt fails the run stops as with ``raise``.
- ``on_error: skip``: the same retries; when every attempt fails the call's completions are scored ``None``
  (TRL turns them into NaN: unscorable, which GEPO's advantages and GRADE's scaler leave out) and the run goes on.
  ``max_consecutive_errors`` skipped calls in a row stop it.
- ``timeout``: seconds one attempt may take; a late attempt counts as a failure. Python cannot stop a thread, so the
  late call is abandoned in a daemon thread and its answer is dropped.

A return that is not one number (or ``None``) per completion is always an error, whatever ``on_error`` says: the
same inputs would give the same wrong answer on a retry. The message names the function, the type and an example.

Metrics, through TRL's ``log_metric`` (averaged over ranks and the logging interval), with ``retry`` or ``skip``:
``rewards/<name>/errors`` failed attempts per call (retries that then succeeded included) and
``rewards/<name>/skipped`` (1 for a call scored unscorable). Reward *models* (``model`` entries) run in-process and
are not wrapped. Left out: the consecutive-failure count is not checkpointed (a resumed run starts it at 0), and an
``async`` reward function is not awaited.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from steadyrl.metrics import reward_errors, reward_skipped

if TYPE_CHECKING:
    from steadyrl.config.sections import RewardSection

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function failed in a way the run cannot go on from (its policy gave up, or it broke its contract)."""


class RewardTimeout(TimeoutError):
    """One attempt at a reward call took longer than the entry's ``timeout``."""


def _example(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_score(value: Any) -> bool:
    if value is None or (isinstance(value, numbers.Real)):
        return True
    return getattr(value, "ndim", None) == 0 and hasattr(value, "item")  # a 0-d tensor or numpy array


def check_scores(name: str, out: Any, expected: int | None) -> list[Any]:
    """``out`` as a list of one number (or None) per completion, or a RewardError naming the function, the type and
    an example value."""
    if hasattr(out, "tolist") and not isinstance(out, (str, bytes)):  # a tensor or numpy array
        out = out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardError(
            f"reward {name!r} returned {type(out).__name__} ({_example(out)}); a reward function returns a list "
            "with one float (or None for unscorable) per completion"
        )
    if expected is not None and len(out) != expected:
        raise RewardError(
            f"reward {name!r} returned {len(out)} values for {expected} completions (first value: "
            f"{_example(out[0]) if len(out) else 'none'}); it must return exactly one per completion"
        )
    for i, value in enumerate(out):
        if not _is_score(value):
            raise RewardError(
                f"reward {name!r} returned a list containing {type(value).__name__} (e.g. {_example(value)} at index "
                f"{i}); each entry must be a float, an int or None (unscorable)"
            )
    return list(out)


def call_with_timeout(fn: Callable[..., Any], timeout: float | None, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)``; with a ``timeout`` it runs in a daemon thread and a late answer raises RewardTimeout."""
    if timeout is None:
        return fn(*args, **kwargs)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=target, name="steadyrl-reward-call", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise RewardTimeout(f"no answer within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def last_checkpoint_note(output_dir: str | Path | None) -> str:
    """The sentence that tells the user where the run can resume from."""
    if output_dir is None:
        return ""
    from steadyrl.trainers.checkpoints import find_resume_checkpoint

    found = find_resume_checkpoint(output_dir, verify=False)
    if found is None:
        return f" No complete checkpoint in {output_dir} yet."
    return f" Last complete checkpoint: {found} (trainer.resume_from_checkpoint: auto resumes from it)."


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class GuardedReward:
    """A reward callable with the entry's error policy, timeout and return checks (module docstring).

    ``sleep`` is the wait between attempts (tests pass a recorder); ``output_dir`` is where the stop message looks
    for the last complete checkpoint.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any],
        policy: RewardSection,
        output_dir: str | Path | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.__name__ = self.__qualname__ = name
        self.__wrapped__ = fn  # inspect.signature follows it: check_reward_columns sees the user's parameters
        self.fn, self.policy, self.output_dir, self.sleep = fn, policy, output_dir, sleep
        self.consecutive_skips = 0

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        p, name = self.policy, self.__name__
        completions = kwargs.get("completions", args[1] if len(args) > 1 else None)
        expected = len(completions) if completions is not None else None
        attempts = 1 if p.on_error == "raise" else 1 + p.retries
        errors, last = 0, None
        for attempt in range(attempts):
            if attempt:
                self.sleep(p.backoff * 2 ** (attempt - 1))
            try:
                out = call_with_timeout(self.fn, p.timeout, args, kwargs)
            except Exception as exc:  # a reward service can fail in any way; the policy decides
                errors, last = errors + 1, exc
                logger.warning("reward %r failed (attempt %d of %d): %s", name, attempt + 1, attempts, _error_text(exc))
                continue
            scores = check_scores(name, out, expected)
            self.consecutive_skips = 0
            self._log(kwargs, errors, skipped=0)
            return scores
        assert last is not None
        note = last_checkpoint_note(self.output_dir)
        if p.on_error == "raise":
            raise RewardError(
                f"reward {name!r} failed: {_error_text(last)} (on_error: raise; on_error: retry or skip in its "
                f"rewards entry rides out a flaky service).{note}"
            ) from last
        if p.on_error == "retry":
            raise RewardError(
                f"reward {name!r} failed {attempts} attempts in a row (on_error: retry, retries: {p.retries}); "
                f"last error: {_error_text(last)}.{note}"
            ) from last
        self.consecutive_skips += 1
        if self.consecutive_skips >= p.max_consecutive_errors:
            raise RewardError(
                f"reward {name!r} failed {self.consecutive_skips} calls in a row (on_error: skip, "
                f"max_consecutive_errors: {p.max_consecutive_errors}); last error: {_error_text(last)}.{note}"
            ) from last
        logger.warning(
            "reward %r: %d completions scored unscorable after %d failed attempts (%d call(s) in a row; the run "
            "stops at %d)",
            name, expected or 0, attempts, self.consecutive_skips, p.max_consecutive_errors,
        )  # fmt: skip
        self._log(kwargs, errors, skipped=1)
        return [None] * (expected or 0)

    def _log(self, kwargs: dict[str, Any], errors: int, skipped: int) -> None:
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and self.policy.on_error != "raise":
            log_metric(reward_errors(self.__name__), float(errors))
            log_metric(reward_skipped(self.__name__), float(skipped))
