"""Reward functions: built-ins by name, user functions as ``module:function``.

A reward function has TRL's signature ``fn(prompts, completions, completion_ids, **columns) -> list[float]``
(``None`` for an unscorable completion). Extra dataset columns arrive as keyword arguments, so a function
that declares ``answer`` needs an ``answer`` column: ``check_reward_columns`` says so before training starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from steadyrl.config.loader import ConfigError
from steadyrl.tasks.arithmetic import answer_anywhere, answer_length, digit_credit, exact_match, numeric_match
from steadyrl.tasks.word_problems import concise_answer, math_answer

RewardFn = Callable[..., list[float | None]]

BUILTIN_REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "digit_credit": digit_credit,
                                         "answer_anywhere": answer_anywhere, "answer_length": answer_length,
                                         "numeric_match": numeric_match, "math_answer": math_answer,
                                         "concise_answer": concise_answer}  # fmt: skip

TRL_REWARD_KWARGS = frozenset(  # keyword arguments TRL passes to every reward function itself (not dataset columns)
    {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}
)


def load_reward_fn(spec: str) -> RewardFn:
    """A built-in name (``exact_match``) or ``package.module:function``; raises ConfigError naming the cause (for a
    built-in whose optional dependency is missing: the package and the install command)."""
    if ":" not in spec:
        if spec not in BUILTIN_REWARDS:
            raise ConfigError(f"reward fn {spec!r} is not a built-in ({sorted(BUILTIN_REWARDS)}); "
                              "for your own function write 'package.module:function'")  # fmt: skip
        from steadyrl.config.requirements import REWARD_MODULES, Missing, installed

        if spec in REWARD_MODULES and not installed(REWARD_MODULES[spec][0]):
            module, install = REWARD_MODULES[spec]
            raise ConfigError("missing package(s) this config needs:\n  "
                              f"{Missing(module, f'reward fn {spec!r}', install).line()}")  # fmt: skip
        return BUILTIN_REWARDS[spec]
    from steadyrl.config.loader import load_object

    fn = load_object(spec, f"reward fn {spec!r}")
    if not callable(fn):
        raise ConfigError(f"reward fn {spec!r} is not callable")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn
    if not any(p.name == "completions" or p.kind is p.VAR_KEYWORD for p in params):
        raise ConfigError(f"reward fn {spec!r} must accept a `completions` argument (and **kwargs for the other "
                          f"columns); its signature is {inspect.signature(fn)}")  # fmt: skip
    return fn


def required_columns(fn: RewardFn) -> set[str]:
    """Dataset columns a reward function needs: its named parameters without defaults, beyond TRL's own."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set()
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty]
    return {p.name for p in named if p.name not in TRL_REWARD_KWARGS}


def check_reward_columns(name: str, fn: RewardFn, columns: list[str]) -> None:
    if missing := required_columns(fn) - set(columns):
        raise ConfigError(f"reward {name!r} needs dataset column(s) {sorted(missing)}, but the dataset has "
                          f"{sorted(columns)}; add the column(s) to the data or use a reward that does not need "
                          "them")  # fmt: skip


def bind_reward(name: str, fn: RewardFn, kwargs: dict[str, Any]) -> RewardFn:
    """``fn`` with config ``kwargs`` bound, named ``name`` (TRL logs rewards under ``__name__``); async when ``fn`` is
    (TRL awaits those on its event loop)."""
    from steadyrl.rewards.guarded import is_async_reward

    if is_async_reward(fn):

        async def reward(*args: Any, **kw: Any) -> list[float | None]:
            return await fn(*args, **{**kw, **kwargs})

    else:

        def reward(*args: Any, **kw: Any) -> list[float | None]:
            return fn(*args, **{**kw, **kwargs})

    reward.__name__ = reward.__qualname__ = name
    reward.__wrapped__ = fn  # type: ignore[attr-defined]  # keeps inspect.signature pointing at fn
    return reward
