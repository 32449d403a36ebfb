"""Fault injectors for tests and benchmarks: rewards that misbehave in controlled, reproducible ways."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from steadyrl.tasks.arithmetic import exact_match


def exact_match_cauchy(
    completions: Sequence[Any],
    answer: Sequence[str],
    scale: float = 1.0,
    seed: int = 0,
    trainer_state: Any = None,
    **_: Any,
) -> list[float]:
    """Exact match plus Cauchy noise of the given scale: a heavy-tailed reward model (seed 004's scenario).

    The noise is drawn from a generator seeded by (seed, optimizer step), so a run is reproducible and the
    same step sees the same noise in every variant of a benchmark.
    """
    step = int(getattr(trainer_state, "global_step", 0) or 0)
    rng = np.random.default_rng([seed, step])
    noise = scale * rng.standard_cauchy(len(completions))
    return [r + float(n) for r, n in zip(exact_match(completions, answer), noise, strict=True)]
