"""Early warnings from a run's log history (docs/DESIGN.md, "Early warnings and the doctor"), over the last
``window`` logged values of a metric: advantage std rising steadily (``RISING_FRACTION`` of consecutive pairs up,
last >= ``adv_std_rise_ratio`` x first), entropy falling fast (``entropy_falling``), and vLLM rollouts off the
policy (``logp_gap_verdict``). Pure functions over ``state.log_history``-like lists of dicts.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from steadyrl.metrics import ENTROPY, GEPO_ADV_STD, SAMPLING_LOGP_GAP
from steadyrl.ranges import Checked, bounded

RISING_FRACTION = 0.8  # "rising steadily": at least this share of consecutive pairs go up
# a stale weight sync at a small learning rate: a gap median this many x the first window's, above the floor (below
# it the gap is float noise); the same values as steadyrl doctor's
LOGP_GAP_RISE_RATIO = 5.0
LOGP_GAP_FLOOR = 0.005
# entropy falling fast: the last window's mean against the highest window mean of the ENTROPY_LOOKBACK windows' worth
# of values before it, beyond ENTROPY_Z standard errors of the difference (per-step entropies as independent draws)
ENTROPY_LOOKBACK, ENTROPY_Z = 5, 2.0


@dataclass
class MonitorConfig(Checked):
    enabled: bool = True
    every: int = bounded(50, ge=1)
    window: int = bounded(20, ge=2)
    adv_std_rise_ratio: float = 1.5
    entropy_drop_ratio: float = 0.5
    logp_gap_max: float = 0.1  # median vLLM-policy |log-prob gap| (nats/token) above this: vLLM runs other weights


def recent(history: Sequence[dict[str, Any]], key: str, window: int) -> list[tuple[int, float]]:
    """The last ``window`` (step, value) pairs of ``key`` in a log history (None skipped), oldest first."""
    rows: list[tuple[int, float]] = []
    for i in reversed(range(len(history))):
        if len(rows) >= window:
            break
        if (r := history[i]).get(key) is not None:
            rows.append((int(r.get("step", i)), float(r[key])))
    return rows[::-1]


def logp_gap_allowance(top_p: float = 1.0, top_k: int | None = 0, min_p: float | None = 0.0,
                       repetition_penalty: float = 1.0) -> float | None:  # fmt: skip
    """The vLLM-policy log-prob gap that sampling settings alone put there: at most -log(``top_p``) (nucleus sampling
    renormalises); None (no gap check) with top-k, min-p or a repetition penalty, which no setting bounds."""
    if (top_k or 0) > 0 or (min_p or 0.0) > 0.0 or repetition_penalty != 1.0:
        return None
    return -math.log(top_p) if 0.0 < top_p < 1.0 else 0.0


def early_warnings(
    history: Sequence[dict[str, Any]], config: MonitorConfig, gap_allowance: float | None = 0.0
) -> list[str]:
    """Warning lines (empty when healthy) naming the metric, step range and values; ``gap_allowance``:
    :func:`logp_gap_allowance` of the run's sampling settings."""
    warnings = []
    adv = recent(history, GEPO_ADV_STD, config.window)
    if len(adv) == config.window:
        values = [v for _, v in adv]
        ups = sum(b > a for a, b in pairwise(values)) / (len(values) - 1)
        if ups >= RISING_FRACTION and values[0] > 0 and values[-1] >= config.adv_std_rise_ratio * values[0]:
            warnings.append(
                f"advantage std rising steadily: {GEPO_ADV_STD} {values[0]:.4g} -> {values[-1]:.4g} over steps "
                f"{adv[0][0]}-{adv[-1][0]} ({ups:.0%} of steps up). Precursor of a hard crash: check for reward "
                "outliers (guards.grade) and group std collapse (guards.gepo.advantage)"
            )
    if (fall := entropy_falling(recent(history, ENTROPY, ENTROPY_LOOKBACK * config.window), config)) is not None:
        (s0, s1, before), (l0, l1, now) = fall
        warnings.append(
            f"entropy falling fast: mean {ENTROPY} {before:.4g} over steps {s0}-{s1} -> {now:.4g} over steps "
            f"{l0}-{l1}. Precursor of entropy collapse: raise the KL coefficient or lower the learning rate"
        )
    if gap_allowance is not None:
        warnings.extend(_logp_gap_warnings(history, config, gap_allowance))
    return warnings


Span = tuple[int, int, float]  # first step, last step, mean of a window


def entropy_falling(points: Sequence[tuple[int, float]], config: MonitorConfig) -> tuple[Span, Span] | None:
    """(the reference window, the last window) when the mean of the last ``window`` (step, entropy) points is below
    ``entropy_drop_ratio`` x the highest mean of ``window`` consecutive points before it, and below it by more than
    ``ENTROPY_Z`` standard errors of the difference. Noise model: per-step entropies scatter around their level (a
    healthy tiny run's 20-step means wander 0.13-0.22 on a plateau, single steps 0.03-0.28): single points or a 0.7
    ratio warned on 12 of 12 healthy 1,000-step runs; collapses fall 10-100x (docs/DESIGN.md, "Early warnings and
    the doctor")."""
    w = config.window
    if len(points) < 2 * w:
        return None
    values = [v for _, v in points]
    late = values[-w:]
    start = max(range(len(values) - 2 * w + 1), key=lambda i: statistics.fmean(values[i : i + w]))
    early = values[start : start + w]
    before, now = statistics.fmean(early), statistics.fmean(late)
    se = math.sqrt((statistics.pvariance(early) + statistics.pvariance(late)) / w)
    if before <= 0 or now >= config.entropy_drop_ratio * before or before - now <= ENTROPY_Z * se:
        return None
    return (points[start][0], points[start + w - 1][0], before), (points[-w][0], points[-1][0], now)


@dataclass
class GapVerdict:
    """What :func:`logp_gap_verdict` found: "problem" (median above ``limit``) or "warning" (grew from ``start``)."""

    severity: str
    median: float
    late: tuple[int, int]  # first and last step of the window the median is over
    limit: float
    start: float | None = None  # "warning": the median of the first window, over steps ``early``
    early: tuple[int, int] | None = None

    def growth(self) -> str:
        """For a "warning": "<ratio>x the median <start>" of the first window."""
        assert self.start is not None
        return f"{self.median / max(self.start, 1e-12):.1f}x the median {self.start:.4g}"


def logp_gap_verdict(
    points: Sequence[tuple[int, float]],
    window: int,
    gap_max: float,
    rise_ratio: float,
    floor: float,
    allowance: float | None,
) -> GapVerdict | None:
    """The vLLM-gap rules over (step, gap) points, for the live monitor and ``steadyrl doctor``. problem: the median
    of the last ``window`` finite values (at least 3) is above ``gap_max + allowance``; warning (``allowance`` 0 only,
    two windows of values): it is above ``floor`` and ``rise_ratio`` x the first window's. ``allowance`` None: none."""
    points = [(s, v) for s, v in points if math.isfinite(v)]
    late = points[-window:]
    if allowance is None or len(late) < 3:  # medians of at least 3: one noisy step does not decide
        return None
    median = statistics.median(v for _, v in late)
    span = (late[0][0], late[-1][0])
    limit = gap_max + allowance
    if median > limit:
        return GapVerdict("problem", median, span, limit)
    if allowance > 0 or len(points) < 2 * window or median <= floor:
        return None
    first = points[:window]
    start = statistics.median(v for _, v in first)
    if median < rise_ratio * start:
        return None
    return GapVerdict("warning", median, span, limit, start, (first[0][0], first[-1][0]))


def _logp_gap_warnings(history: Sequence[dict[str, Any]], config: MonitorConfig, allowance: float) -> list[str]:
    """The vLLM-policy log-prob gap: too large now, or grown far above where the run started."""
    if not any(SAMPLING_LOGP_GAP in row for row in history[-config.window :]):
        return []  # not logged lately (no vLLM): no late window to judge, and no need to scan the whole run
    points = recent(history, SAMPLING_LOGP_GAP, len(history))
    c = config
    verdict = logp_gap_verdict(points, c.window, c.logp_gap_max, LOGP_GAP_RISE_RATIO, LOGP_GAP_FLOOR, allowance)
    if verdict is None:
        return []
    first, last = verdict.late
    where = f"median {SAMPLING_LOGP_GAP} {verdict.median:.4g} nats per token over steps {first}-{last}"
    cause = (
        "vLLM is generating from other weights than the trained ones (a weight sync that does not reach it: check the "
        "vLLM version, see steadyrl.trainers.vllm_support); the updates are off-policy"
    )
    if verdict.severity == "problem":
        return [f"vLLM and the policy disagree: {where} > {verdict.limit:.4g}. {cause}"]
    assert verdict.early is not None
    early = f"{verdict.growth()} of steps {verdict.early[0]}-{verdict.early[1]}"
    return [f"vLLM and the policy drift apart: {where}, {early}. {cause}"]
