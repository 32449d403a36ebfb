"""Reward functions as unreliable services: a per-reward error policy, a timeout per call, checked returns.

Every ``fn`` entry of ``rewards`` is wrapped in a ``GuardedReward`` (keys on the entry, ``RewardSection``): ``on_error:
raise`` (default) stops the run at the first exception with a ``RewardError`` naming the function, the error and the
last complete checkpoint; ``retry`` makes up to ``retries`` more attempts (``backoff`` seconds before the first,
doubling), then raises; ``skip`` does the same, then scores the call's completions ``None`` and goes on, until
``max_consecutive_errors`` skipped calls in a row. ``timeout`` (60 s; ``null``: none) stops a late attempt with a
``RewardTimeout``. A wrong-shaped return is always an error. How a late call stops: docs/DESIGN.md, "Reward calls".
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import inspect
import logging
import numbers
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from steadyrl.metrics import reward_errors, reward_skipped

if TYPE_CHECKING:
    from steadyrl.config.sections import RewardSection

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward function failed in a way the run cannot go on from (its policy gave up, or it broke its contract)."""


class RewardTimeout(TimeoutError):
    """One attempt at a reward call took longer than the entry's ``timeout``; the attempt was stopped."""


class _Expired(BaseException):
    """Raised inside a late reward call; a BaseException, so that the reward's own ``except Exception`` cannot
    swallow it."""


DEADLINE_SIGNAL = signal.SIGURG  # default action: ignore; math-verify uses SIGALRM, preemption TERM/INT/USR/HUP
STUCK_AFTER_S = 5.0  # seconds past the deadline before a call that did not stop is logged as stuck


def _async_raise(ident: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``ident`` when it next runs Python code; None drops one not yet raised."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


CLOCK_SLACK_S = 0.05  # a process's start is read in clock ticks (10 ms): one started since t - this counts


def _since_boot() -> float:
    """Seconds since boot in the clock of a process's start (Linux: ``CLOCK_BOOTTIME``; psutil's create times are the
    boot time, whole seconds, plus the start in ticks, so only their difference from the boot time is exact)."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - psutil.boot_time()


def _started_since(t: float) -> list[psutil.Process]:
    """This process's children, grandchildren, ... started ``t`` (``_since_boot``) or later (those that vanish while
    read are left out). Read only when a deadline fires: a call that returns in time costs nothing."""
    out, boot = [], psutil.boot_time()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if child.create_time() - boot >= t - CLOCK_SLACK_S:
                out.append(child)
    return out


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill(processes: list[psutil.Process], grace: float = 1.0) -> int:
    """SIGTERM, then SIGKILL after ``grace`` seconds for those still running; returns how many were running."""
    alive = [p for p in processes if _running(p)]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=grace)
    return len(alive)


class _Deadline:
    """``with _Deadline(seconds, what):`` raises ``self.token`` (at most once) inside the block when it runs past
    ``seconds``; ``__exit__`` stops the watchdog and restores the signal handler whichever way the block ends. A call
    stopped by it also loses the processes it started (its children and their children, found at the deadline,
    before the call unwinds and orphans them, and at the exit), and on the main thread any ``SIGALRM`` timer it armed
    and handler it set (math-verify arms one per expression: stopped between its ``alarm`` and its ``try``, the alarm
    would fire later in training code)."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.token = type("RewardDeadline", (_Expired,), {})  # this call's own: a nested deadline has another
        self.caller = threading.current_thread()
        self.on_main = self.caller is threading.main_thread() and hasattr(signal, "pthread_kill")
        self.lock, self.done = threading.Lock(), threading.Event()
        self.armed, self.fired, self.previous = True, False, None
        self.watchdog = threading.Thread(target=self._watch, name="steadyrl-reward-deadline", daemon=True)

    def __enter__(self) -> _Deadline:
        if self.on_main:
            self.previous = signal.signal(DEADLINE_SIGNAL, self._handler)
            self.alarm = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
        self.t0, self.started = _since_boot(), []
        self.watchdog.start()
        return self

    def _handler(self, signum: int, frame: Any) -> None:  # main thread, between two bytecodes of the call
        if self.fired and self.armed:
            self.armed = False
            raise self.token
        if callable(self.previous):  # a stray SIGURG, or an outer deadline's
            self.previous(signum, frame)

    def _watch(self) -> None:
        if self.done.wait(self.seconds):
            return
        with self.lock:
            if not self.armed:  # the call returned just now
                return
            self.fired = True
            self.started = _started_since(self.t0)
            if self.on_main:
                signal.pthread_kill(threading.main_thread().ident, DEADLINE_SIGNAL)
            else:
                self.armed = False
                _async_raise(self.caller.ident, self.token)
        if not self.done.wait(STUCK_AFTER_S):
            logger.error("%s is still running %g s after its timeout of %g s: it is inside code that does not return "
                         "to Python (a C extension or a blocking call) or that catches BaseException, and stops when "
                         "it returns", self.what, STUCK_AFTER_S, self.seconds)  # fmt: skip

    def __exit__(self, *exc_info: object) -> None:
        try:
            with self.lock:
                self.armed = False
                if self.fired and not self.on_main:
                    _async_raise(self.caller.ident, None)  # the call returned first: drop the pending raise
        finally:  # the token is raised at most once, so this part always runs to the end
            self.done.set()
            self.watchdog.join()
            if self.on_main:  # None: a handler installed outside Python, which Python cannot put back
                signal.signal(DEADLINE_SIGNAL, signal.SIG_DFL if self.previous is None else self.previous)
            if self.fired:
                self._clean_up()

    def _clean_up(self) -> None:
        """After a stopped call: its processes killed, the SIGALRM state it left put back."""
        late = _started_since(self.t0)
        if killed := _kill(list({p.pid: p for p in [*self.started, *late]}.values())):
            logger.warning("%s: killed %d process(es) the stopped call had started", self.what, killed)
        if self.on_main:
            handler, timer = self.alarm
            if timer == (0.0, 0.0):
                signal.setitimer(signal.ITIMER_REAL, 0)
            if handler is not None:
                signal.signal(signal.SIGALRM, handler)


def _example(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_score(value: Any) -> bool:
    zero_d = getattr(value, "ndim", None) == 0 and hasattr(value, "item")  # a 0-d tensor or numpy array
    return value is None or isinstance(value, numbers.Real) or zero_d


def check_scores(name: str, out: Any, expected: int | None) -> list[Any]:
    """``out`` as a list of one number (or None) per completion, or a RewardError naming the function and the value."""
    if hasattr(out, "tolist") and not isinstance(out, (str, bytes)):  # a tensor or numpy array
        out = out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardError(f"reward {name!r} returned {type(out).__name__} ({_example(out)}); a reward function returns "
                          "a list with one float (or None for unscorable) per completion")  # fmt: skip
    if expected is not None and len(out) != expected:
        raise RewardError(f"reward {name!r} returned {len(out)} values for {expected} completions (first value: "
                          f"{_example(out[0]) if len(out) else 'none'}); it must return exactly one per "
                          "completion")  # fmt: skip
    for i, value in enumerate(out):
        if not _is_score(value):
            raise RewardError(f"reward {name!r} returned a list containing {type(value).__name__} (e.g. "
                              f"{_example(value)} at index {i}); each entry must be a float, an int or None "
                              "(unscorable)")  # fmt: skip
    return list(out)


def call_with_timeout(
    fn: Callable[..., Any], timeout: float | None, args: tuple, kwargs: dict[str, Any], name: str = "reward"
) -> Any:
    """``fn(*args, **kwargs)`` in this thread; past ``timeout`` seconds (None: never) it is stopped and RewardTimeout
    raised."""
    if timeout is None:
        return fn(*args, **kwargs)
    rank = int(os.environ.get("RANK", "0"))
    deadline = _Deadline(timeout, f"reward {name!r} on rank {rank}")
    try:
        with deadline:
            return fn(*args, **kwargs)
    except deadline.token:
        raise RewardTimeout(f"no answer within {timeout:g} s (reward {name!r} on rank {rank}; the call was "
                            "stopped)") from None  # fmt: skip


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def is_async_reward(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine (an ``async def``, a partial of one, or an instance whose
    ``__call__`` is one), as TRL decides which rewards it awaits."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class GuardedReward:
    """A reward callable with the entry's error policy, timeout and return checks; ``sleep`` waits between attempts,
    ``output_dir`` is where the stop message looks for the last complete checkpoint. For an ``async def`` reward use
    ``AsyncGuardedReward`` (``guarded_reward`` picks)."""

    def __init__(self, name: str, fn: Callable[..., Any], policy: RewardSection, output_dir: str | Path | None = None,
                 sleep: Callable[[float], Any] = time.sleep) -> None:  # fmt: skip
        self.__name__ = self.__qualname__ = name
        self.__wrapped__ = fn  # inspect.signature follows it: check_reward_columns sees the user's parameters
        self.fn, self.policy, self.output_dir, self.sleep = fn, policy, output_dir, sleep
        self.consecutive_skips = 0

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        attempts, expected = self._plan(args, kwargs)
        errors, last = 0, None
        for attempt in range(attempts):
            if attempt:
                self.sleep(self._backoff(attempt))
            try:
                out = call_with_timeout(self.fn, self.policy.timeout, args, kwargs, self.__name__)
            except Exception as exc:  # a reward service can fail in any way; the policy decides
                errors, last = self._failed(attempt, attempts, errors, exc)
                continue
            return self._scored(out, expected, kwargs, errors)
        return self._give_up(last, attempts, expected, kwargs, errors)

    def _plan(self, args: tuple, kwargs: dict[str, Any]) -> tuple[int, int | None]:
        """(attempts allowed, completions expected)."""
        completions = kwargs.get("completions", args[1] if len(args) > 1 else None)
        expected = len(completions) if completions is not None else None
        return (1 if self.policy.on_error == "raise" else 1 + self.policy.retries), expected

    def _backoff(self, attempt: int) -> float:
        return self.policy.backoff * 2 ** (attempt - 1)

    def _failed(self, attempt: int, attempts: int, errors: int, exc: Exception) -> tuple[int, Exception]:
        name, text = self.__name__, _error_text(exc)
        logger.warning("reward %r failed (attempt %d of %d): %s", name, attempt + 1, attempts, text)
        return errors + 1, exc

    def _scored(self, out: Any, expected: int | None, kwargs: dict[str, Any], errors: int) -> list[Any]:
        scores = check_scores(self.__name__, out, expected)
        self.consecutive_skips = 0
        self._log(kwargs, errors, skipped=0)
        return scores

    def _give_up(self, last: Exception | None, attempts: int, expected: int | None, kwargs: dict[str, Any],
                 errors: int) -> list[Any]:  # fmt: skip
        """Every attempt failed: raise the RewardError the policy names, or (``skip``) score the call unscorable."""
        from steadyrl.trainers.checkpoints import last_checkpoint_note

        p, name = self.policy, self.__name__
        assert last is not None
        note = last_checkpoint_note(self.output_dir) if self.output_dir is not None else ""
        if p.on_error == "raise":
            raise RewardError(f"reward {name!r} failed: {_error_text(last)} (on_error: raise; on_error: retry or skip "
                              f"in its rewards entry rides out a flaky service).{note}") from last  # fmt: skip
        if p.on_error == "retry":
            raise RewardError(f"reward {name!r} failed {attempts} attempts in a row (on_error: retry, retries: "
                              f"{p.retries}); last error: {_error_text(last)}.{note}") from last  # fmt: skip
        self.consecutive_skips += 1
        if self.consecutive_skips >= p.max_consecutive_errors:
            raise RewardError(f"reward {name!r} failed {self.consecutive_skips} calls in a row (on_error: skip, "
                              f"max_consecutive_errors: {p.max_consecutive_errors}); last error: {_error_text(last)}."
                              f"{note}") from last  # fmt: skip
        logger.warning("reward %r: %d completions scored unscorable after %d failed attempts (%d call(s) in a row; "
                       "the run stops at %d)", name, expected or 0, attempts, self.consecutive_skips,
                       p.max_consecutive_errors)  # fmt: skip
        self._log(kwargs, errors, skipped=1)
        return [None] * (expected or 0)

    def _log(self, kwargs: dict[str, Any], errors: int, skipped: int) -> None:
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and self.policy.on_error != "raise":
            log_metric(reward_errors(self.__name__), float(errors))
            log_metric(reward_skipped(self.__name__), float(skipped))


class AsyncGuardedReward(GuardedReward):
    """``GuardedReward`` for an ``async def`` reward (an LLM judge, a remote verifier): TRL awaits it on its event
    loop, beside the other async rewards. ``timeout`` cancels the awaited call (``asyncio.timeout``: the coroutine
    gets CancelledError at its next await); ``sleep`` may return an awaitable (``asyncio.sleep``, the default)."""

    def __init__(self, name: str, fn: Callable[..., Any], policy: RewardSection, output_dir: str | Path | None = None,
                 sleep: Callable[[float], Any] = asyncio.sleep) -> None:  # fmt: skip
        super().__init__(name, fn, policy, output_dir, sleep)

    async def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:  # type: ignore[override]
        attempts, expected = self._plan(args, kwargs)
        errors, last = 0, None
        for attempt in range(attempts):
            if attempt and inspect.isawaitable(pause := self.sleep(self._backoff(attempt))):
                await pause
            try:
                out = await self._attempt(args, kwargs)
            except Exception as exc:  # a reward service can fail in any way; the policy decides
                errors, last = self._failed(attempt, attempts, errors, exc)
                continue
            return self._scored(out, expected, kwargs, errors)
        return self._give_up(last, attempts, expected, kwargs, errors)

    async def _attempt(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        timeout = self.policy.timeout
        try:
            async with asyncio.timeout(timeout):
                return await self.fn(*args, **kwargs)
        except TimeoutError as exc:
            rank = int(os.environ.get("RANK", "0"))
            raise RewardTimeout(f"no answer within {timeout:g} s (reward {self.__name__!r} on rank {rank}; the call "
                                "was cancelled)") from exc  # fmt: skip


def guarded_reward(name: str, fn: Callable[..., Any], policy: RewardSection,
                   output_dir: str | Path | None = None) -> GuardedReward:  # fmt: skip
    """``AsyncGuardedReward`` for an async ``fn``, else ``GuardedReward``."""
    cls = AsyncGuardedReward if is_async_reward(fn) else GuardedReward
    return cls(name, fn, policy, output_dir)


def call_reward(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` outside TRL (the periodic eval, ``steadyrl validate``): an async reward's coroutine is
    run to its end on a fresh event loop (this thread runs none)."""
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):

        async def wait() -> Any:
            return await out

        return asyncio.run(wait())
    return out
