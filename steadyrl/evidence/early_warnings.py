"""Early warnings from a run's log history: GRPO crashes announce themselves (docs/DESIGN.md, "Early warnings
and the doctor").

Three signals are checked over the last ``window`` logged values of a metric:
- advantage std rising steadily (``GEPO_ADV_STD``): at least ``RISING_FRACTION`` of consecutive pairs go up and the
  last value is ``adv_std_rise_ratio`` times the first (the signal is being hijacked by outliers or shrinking group
  std);
- entropy falling fast (``ENTROPY``): the last value is below ``entropy_drop_ratio`` times the first;
- vLLM rollouts off the policy (``SAMPLING_LOGP_GAP``): the median per-token log-prob gap between vLLM and the policy
  on the sampled tokens exceeds ``logp_gap_max``, or ``LOGP_GAP_RISE_RATIO`` x its median over the run's first
  window while above ``LOGP_GAP_FLOOR`` (a weight sync that does not reach vLLM trains silently off-policy).

Pure functions over plain dicts; the trainer-side callback only feeds them ``state.log_history``.
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
# A stale weight sync at a small learning rate moves the vLLM gap less than logp_gap_max: the monitor also warns when
# the window's median is LOGP_GAP_RISE_RATIO x the median of the run's first window and above LOGP_GAP_FLOOR (below
# it the gap is float noise). The same values as steadyrl doctor's.
LOGP_GAP_RISE_RATIO = 5.0
LOGP_GAP_FLOOR = 0.005


@dataclass
class MonitorConfig(Checked):
    enabled: bool = True
    every: int = bounded(50, ge=1)
    window: int = bounded(20, ge=2)
    adv_std_rise_ratio: float = 1.5
    entropy_drop_ratio: float = 0.7
    # vLLM rollouts: the per-token |log-prob gap| between vLLM and the policy on the sampled tokens (TRL's metric).
    # It stays near 0 (float noise, bf16 kernels) while each step's weight sync reaches vLLM; a median above this
    # over the window means vLLM generates from other weights than the ones being trained.
    logp_gap_max: float = 0.1


def recent(history: Sequence[dict[str, Any]], key: str, window: int) -> list[tuple[int, float]]:
    """The last ``window`` (step, value) pairs of ``key`` in a Trainer log history (None values skipped), oldest
    first. Reads the history from its end and stops after ``window`` of them, so a monitor that asks every few steps
    does not pay for the whole run each time."""
    rows: list[tuple[int, float]] = []
    for i in range(len(history) - 1, -1, -1):
        if len(rows) >= window:
            break
        r = history[i]
        if r.get(key) is not None:
            rows.append((int(r.get("step", i)), float(r[key])))
    rows.reverse()
    return rows


def logp_gap_allowance(top_p: float = 1.0, top_k: int | None = 0, min_p: float | None = 0.0,
                       repetition_penalty: float = 1.0) -> float | None:  # fmt: skip
    """The vLLM-policy log-prob gap that sampling settings alone put there; None: unbounded (no gap check).

    vLLM reports log-probs after its logit processing (TRL asks for ``processed_logprobs``) while the policy's are
    temperature-scaled only. Nucleus sampling renormalises over the kept tokens, whose mass is at least ``top_p``, so
    every sampled token's gap is at most -log(top_p). top-k, min-p and a repetition penalty change the log-probs
    by amounts no setting bounds.
    """
    if (top_k or 0) > 0 or (min_p or 0.0) > 0.0 or repetition_penalty != 1.0:
        return None
    return -math.log(top_p) if 0.0 < top_p < 1.0 else 0.0


def early_warnings(
    history: Sequence[dict[str, Any]], config: MonitorConfig, gap_allowance: float | None = 0.0
) -> list[str]:
    """Warning lines (empty when healthy) naming the metric, step range and values.

    gap_allowance: :func:`logp_gap_allowance` of the run's sampling settings. Above 0 it raises the vLLM gap's
    absolute threshold by that much and turns the rise rule off (the allowance moves with the entropy); None turns
    the vLLM gap check off.
    """
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
    ent = recent(history, ENTROPY, config.window)
    if len(ent) == config.window and ent[0][1] > 0 and ent[-1][1] < config.entropy_drop_ratio * ent[0][1]:
        warnings.append(
            f"entropy falling fast: {ENTROPY} {ent[0][1]:.4g} -> {ent[-1][1]:.4g} over steps "
            f"{ent[0][0]}-{ent[-1][0]}. Precursor of entropy collapse: raise the KL coefficient or lower the "
            "learning rate"
        )
    if gap_allowance is not None:
        warnings.extend(_logp_gap_warnings(history, config, gap_allowance))
    return warnings


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
    """The two vLLM-gap rules over (step, gap) points, shared by the live monitor and ``steadyrl doctor``.

    problem: the median of the last ``window`` finite values (at least 3) is above ``gap_max + allowance``.
    warning: with exact sampling (``allowance`` 0) and at least two windows of values, that median is above ``floor``
    and at least ``rise_ratio`` x the median of the first window. ``allowance`` None: no verdict.
    """
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
    return [
        f"vLLM and the policy drift apart: {where}, {verdict.growth()} of steps {verdict.early[0]}-{verdict.early[1]}. "
        f"{cause}"
    ]
