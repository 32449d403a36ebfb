"""``steadyrl doctor``: which way a finished (or dead) run is failing, from its logged metrics alone.

Failure modes are ``MODES`` (docs/DESIGN.md, "Early warnings and the doctor"). Each diagnosis is one row of
``RULES``; ``diagnose`` evaluates them in order and merges the hits per mode. Trends compare an early window of logged
rows with a late one; only large, sustained changes count.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from steadyrl import metrics as M
from steadyrl.evidence.early_warnings import logp_gap_allowance, logp_gap_verdict
from steadyrl.evidence.history import History, to_float
from steadyrl.evidence.saturation import saturation_checks
from steadyrl.guards.gold_watch import GoldDetector, eval_points, gold_se

MODES = (
    "hard_crash",
    "entropy_collapse",
    "reward_hacking",
    "regression",
    "off_policy_rollouts",
    "saturated_controller",
)
TITLES = {
    "hard_crash": "hard crash (inf/NaN, gradient explosion)",
    "entropy_collapse": "entropy collapse (the policy stops exploring and repeats itself)",
    "reward_hacking": "reward hacking (training reward up, real quality not)",
    "regression": "regression (the run got worse by itself: training reward or held-out metric fell)",
    "off_policy_rollouts": "off-policy rollouts (vLLM generates from other weights than the trained ones)",
    "saturated_controller": "a guard held at its bound (its setting does not fit this run)",
}
LOGP_GAP = M.SAMPLING_LOGP_GAP
NONFINITE_COUNTERS = (M.GEPO_NONFINITE_REWARDS, M.GEPO_NONFINITE_LOGPROBS)
NONFINITE_COUNTERS += (M.GEPO_NONFINITE_LOSS, M.GEPO_NONFINITE_RATIOS)
CHECKED = (M.LOSS, M.GRAD_NORM, M.REWARD, M.ENTROPY, M.QUATRO_ENTROPY, M.KL, M.QUATRO_KL_MEAN, M.GEPO_ADV_STD)
CHECKED += (M.GEPO_SKIPPED_STEPS, *NONFINITE_COUNTERS, M.OPEFO_REPAIRS, M.OPEFO_ROLLBACKS, M.QUATRO_FLOOR_ACTIVE)
CHECKED += (M.QUATRO_FLOOR_HELD_OFF, M.QUATRO_ENTROPY_FLOOR, M.EVAL_ACCURACY, M.COMPLETIONS_MEAN_LENGTH)
CHECKED += (M.COMPLETIONS_CLIPPED_RATIO, LOGP_GAP, M.FRAC_REWARD_ZERO_STD)
REPETITION_WORDS = ("repet", "parrot")  # quatro/filtered/<reason> names that count repeated output


@dataclass
class DoctorConfig:
    """Thresholds of every check; the defaults flag only large, sustained changes."""

    window: int = 10  # rows in the early and in the late window (a third of the series when shorter)
    min_points: int = 6  # fewer finite values than this: no trend is read from a metric
    spike_ratio: float = 100.0  # grad_norm >= this x the median of the values before it: orders-of-magnitude jump
    spike_median_window: int = 50  # ... the median of at most this many values before it
    spike_min_history: int = 5  # ... and only once this many values came before
    spike_min_value: float = 1.0  # ... and only when the norm itself is at least this (1e-4 -> 1e-2 is no crash)
    skip_fraction: float = 0.05  # GEPO skipped more than this fraction of optimizer steps
    adv_std_rise_ratio: float = 2.0  # gepo/adv_std: 4 chunk means of the last 4 windows rise, last >= this x first
    counter_rise_ratio: float = 2.0  # per-step counts (non-finite, filtered): late mean >= this x the early mean
    counter_nonzero_frac: float = 0.8  # ... and non-zero in at least this fraction of the late window's rows
    rollbacks_problem: int = 3  # OPEFO rollbacks: fewer is a warning, this many a problem
    entropy_drop_frac: float = 0.5  # late entropy mean below this x the early mean: entropy is collapsing
    # ... but while the reward still rises (the policy sharpening), only below this: healthy SmolLM2 runs learning a
    # short format reach 0.10-0.16, healthy tiny runs 0.37 (docs/benchmarks.md); a collapse goes on towards 0
    entropy_learning_frac: float = 0.05
    kl_rise_ratio: float = 2.0  # late KL mean >= this x the early mean: KL rising
    flat_z: float = 0.5  # reward gain (late - early mean) below this x the windows' pooled std: flat
    rise_z: float = 1.0  # reward gain above this x the pooled std: rising
    eval_drop: float = 0.05  # the last eval accuracy this far (absolute) below the best: falling ...
    # ... and eval_z standard errors of the difference (eval/accuracy_se, else the binomial bound over
    # eval/num_samples; the gold watch's noise model, steadyrl/guards/gold_watch.py)
    eval_z: float = 4.0
    eval_after_points: int = 2  # ... with at least this many evals after the best (one low eval is noise)
    reward_fall_z: float = 2.0  # training reward: late mean below the early one by this x the pooled std ...
    reward_fall_frac: float = 0.25  # ... and by this share of the early mean's size: the run regressed ...
    # ... read over windows of at least this many logged rewards each: over 3-step windows a healthy run's early
    # dip (0.68 -> 0.36 over steps 1-3 -> 8-10) and a reward model's outliers fell 2.2-2.3 std (peer_signals.json)
    reward_fall_points: int = 10
    zero_std_share: float = 0.9  # frac_reward_zero_std late mean at or above this: no learning signal left
    min_eval_points: int = 3  # eval rows needed to read an eval trend
    length_ratio: float = 2.0  # completions/mean_length late/early beyond this, or below 1/this: anomaly
    clipped_rise: float = 0.2  # completions/clipped_ratio late - early mean above this: truncation rising
    logp_gap_max: float = 0.1  # vLLM-policy log-prob gap (nats/token): late-window median above this: off-policy
    logp_gap_rise_ratio: float = 5.0  # ... or this x the early window's median (a warning; a stale sync at low lr)
    logp_gap_floor: float = 0.005  # ... when the late median is above this (below it is float noise)
    # what the run's sampling settings alone add to the gap (None: no gap check); see doctor_config_for
    logp_gap_allowance: float | None = 0.0
    # mismatch/ess, the effective sample size of the vLLM rollouts' importance weights (1: no mismatch)
    ess_problem: float = 0.5  # late-window median below this: most of a batch's weight sits on a few sequences
    ess_loss_rise: float = 5.0  # ... or 1 - ESS, late median >= this x the early window's lowest (a warning) ...
    ess_loss_floor: float = 0.01  # ... when the late median of 1 - ESS is above this (healthy runs: ~1e-6)
    # the run's truncated sampling where TRL <= 1.16 biases its vLLM correction beyond top_p: a sequence mode, or
    # top_k / min_p (doctor_config_for; None: no finding). top_p alone in a token mode is bounded and stated at load
    truncation: str | None = None


@dataclass
class Evidence:
    """What a check saw: one metric over a step range, the values in words."""

    metric: str
    first_step: int
    last_step: int
    detail: str

    def __str__(self) -> str:
        a, b = self.first_step, self.last_step
        return f"{self.metric}, {f'step {a}' if a == b else f'steps {a}-{b}'}: {self.detail}"


@dataclass
class Finding:
    """One failure mode under way or past: severity "warning" (precursor) or "problem" (it happened)."""

    mode: str
    severity: str
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)


@dataclass
class Hit:
    """What a rule's condition found: the evidence, the values its messages name, a severity overriding the rule's."""

    evidence: list[Evidence]
    fields: dict[str, Any] = field(default_factory=dict)
    severity: str | None = None


Condition = Callable[[History, "DoctorConfig"], Iterator[Hit]]


@dataclass(frozen=True)
class Rule:
    """One diagnosis: ``condition`` yields a Hit per finding; ``summary`` and ``fixes`` are ``str.format`` templates
    over its fields (a fix that formats to "" is left out). ``reads``: metrics, event kinds or prefixes it reads."""

    mode: str
    severity: str
    reads: tuple[str, ...]
    condition: Condition
    summary: str
    fixes: tuple[str, ...]

    def finding(self, hit: Hit) -> Finding:
        fixes = [fix for fix in (f.format_map(hit.fields) for f in self.fixes) if fix]
        severity, summary = hit.severity or self.severity, self.summary.format_map(hit.fields)
        return Finding(self.mode, severity, summary, hit.evidence, fixes)


# ----------------------------------------------------------------------------------------------- trends


@dataclass
class _Trend:
    """Early vs late window (``w`` values each) of one metric's finite values."""

    steps: np.ndarray
    values: np.ndarray
    w: int

    def __post_init__(self) -> None:
        self.early, self.late = self.values[: self.w], self.values[-self.w :]
        early, late = float(self.early.mean()), float(self.late.mean())
        self.ratio = late / early if early > 0 else (np.inf if self.late.mean() > 0 else 1.0)
        # (late mean - early mean) in units of the windows' pooled within-window std
        pooled = float(np.sqrt((self.early.var() + self.late.var()) / 2))
        self.z = float(self.late.mean() - self.early.mean()) / max(pooled, 1e-12 * max(1.0, abs(early)))

    def evidence(self, metric: str, extra: str = "") -> Evidence:
        e0, e1, l0, l1 = self.steps[0], self.steps[self.w - 1], self.steps[-self.w], self.steps[-1]
        means = f"mean {self.early.mean():.4g} over steps {e0}-{e1} -> {self.late.mean():.4g} over steps {l0}-{l1}"
        return Evidence(metric, int(self.steps[0]), int(self.steps[-1]), means + extra)


def _trend(history: History, name: str | None, config: DoctorConfig) -> _Trend | None:
    if not name:
        return None
    steps, values = history.finite(name)
    if len(values) < config.min_points:
        return None
    return _Trend(steps, values, max(2, min(config.window, len(values) // 3)))


def _first(history: History, *names: str) -> str | None:
    return next((n for n in names if history.has(n)), None)


def _counter_rising(history: History, name: str, config: DoctorConfig) -> _Trend | None:
    """A per-step count that is non-zero in most late rows and ``counter_rise_ratio`` x its early mean."""
    trend = _trend(history, name, config)
    if trend is None or np.count_nonzero(trend.late) < config.counter_nonzero_frac * trend.w:
        return None
    return trend if trend.ratio >= config.counter_rise_ratio else None


def _span(steps: Any, default: int) -> tuple[int, int]:
    return (int(steps[0]), int(steps[-1])) if len(steps) else (0, default)


# ----------------------------------------------------------------------------------------------- conditions


def _nonfinite(history: History) -> tuple[list[tuple[Evidence, int]], list[Evidence]]:
    """Non-finite loss/grad norm: (died: the run ended on an unskipped one, with its last step; survived)."""
    skipped = set(history.skipped_steps.tolist())
    died, survived = [], []
    for name in (M.LOSS, M.GRAD_NORM):
        steps, values = history.series(name)
        bad = steps[~np.isfinite(values)]
        if not len(bad):
            continue
        covered = all(int(s) in skipped for s in bad)
        detail = f"{len(bad)} non-finite of {len(values)} logged (steps {', '.join(map(str, bad[:5].tolist()))}"
        detail += ", ...)" if len(bad) > 5 else ")"
        detail += f"; last value {values[-1]:.4g}" + (", every one a skipped step" if covered else "")
        evidence = Evidence(name, int(bad[0]), int(bad[-1]), detail)
        if not history.finished and not np.isfinite(values[-1]) and int(steps[-1]) not in skipped:
            died.append((evidence, int(steps[-1])))
        else:
            survived.append(evidence)
    return died, survived


def _died(history: History, config: DoctorConfig) -> Iterator[Hit]:
    if died := _nonfinite(history)[0]:
        evidence = [e for e, _ in died]
        fields = {"names": ", ".join(e.metric for e in evidence), "first_bad": min(e.first_step for e in evidence)}
        yield Hit(evidence, {**fields, "last": max(0, *(step for _, step in died))})


def _survived(history: History, config: DoctorConfig) -> Iterator[Hit]:
    if survived := _nonfinite(history)[1]:
        yield Hit(survived, {"names": ", ".join(e.metric for e in survived)})


def _last_row_nonfinite(history: History, config: DoctorConfig) -> Iterator[Hit]:
    rows = [r for r in history.rows if M.TRAIN_RUNTIME not in r]
    if not rows or history.finished or _nonfinite(history)[0]:
        return
    last = max(rows, key=lambda r: r["step"])
    if last["step"] in set(history.skipped_steps.tolist()):  # a skipped step's NaN never reached the weights
        return
    bad_keys = [k for k, v in last.items() if k != "step" and (f := to_float(v)) is not None and not np.isfinite(f)]
    if bad_keys:
        detail = ", ".join(f"{k}={last[k]}" for k in bad_keys[:6])
        yield Hit([Evidence(bad_keys[0], last["step"], last["step"], detail)], {"step": last["step"]})


def _spike(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """grad norm >= ``spike_ratio`` x the median of up to ``spike_median_window`` values before it."""
    steps, values = history.finite(M.GRAD_NORM)
    jumps = []
    for i in range(config.spike_min_history, len(values)):
        median = float(np.median(values[max(0, i - config.spike_median_window) : i]))
        if median > 0 and values[i] >= config.spike_ratio * median and values[i] >= config.spike_min_value:
            jumps.append((int(steps[i]), float(values[i]), median))
    if jumps:
        skipped = set(history.skipped_steps.tolist())
        shown = "; ".join(
            f"step {s}: {v:.4g} = {v / m:.0f}x the running median {m:.3g}" + (" (skipped)" if s in skipped else "")
            for s, v, m in jumps[:3]
        )
        detail = f"{len(jumps)} jump(s) of >= {config.spike_ratio:g}x: {shown}"
        yield Hit([Evidence(M.GRAD_NORM, jumps[0][0], jumps[-1][0], detail)])


def _many_skips(history: History, config: DoctorConfig) -> Iterator[Hit]:
    n, total = history.count(M.GEPO_SKIPPED_STEPS, M.EVENT_SKIP), history.last_step
    if n and total and n / total > config.skip_fraction:
        detail = f"{n} of {total} optimizer steps skipped ({n / total:.0%})"
        yield Hit([Evidence(M.GEPO_SKIPPED_STEPS, *_span(history.skipped_steps, total), detail)])


def _rising_count(name: str) -> Condition:
    def condition(history: History, config: DoctorConfig) -> Iterator[Hit]:
        if (trend := _counter_rising(history, name, config)) is not None:
            yield Hit([trend.evidence(name)])

    return condition


def _adv_std_rising(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """Means of 4 chunks of the last 4 windows rise, the last ``adv_std_rise_ratio`` x the first."""
    steps, adv = history.finite(M.GEPO_ADV_STD)
    if len(adv) < max(config.min_points, 8):
        return
    tail = slice(-min(len(adv), 4 * config.window), None)
    means = np.array([c.mean() for c in np.array_split(adv[tail], 4)])
    if np.all(np.diff(means) > 0) and means[0] > 0 and means[-1] >= config.adv_std_rise_ratio * means[0]:
        detail = "chunk means " + " -> ".join(f"{m:.3g}" for m in means)
        yield Hit([Evidence(M.GEPO_ADV_STD, *_span(steps[tail], 0), detail)])


def _rollbacks(history: History, config: DoctorConfig) -> Iterator[Hit]:
    if n := history.count(M.OPEFO_ROLLBACKS, M.EVENT_ROLLBACK):
        causes = sorted({str(e.get("cause")) for e in history.events_of(M.EVENT_ROLLBACK) if e.get("cause")})
        detail = f"{n} rollback(s)" + (f", causes: {', '.join(causes)}" if causes else "")
        evidence = Evidence(M.OPEFO_ROLLBACKS, *_span(history.rollback_steps, history.last_step), detail)
        yield Hit([evidence], severity="problem" if n >= config.rollbacks_problem else "warning")


def _gold_rollbacks(verdict: str) -> Condition:
    """The gold watch's rollbacks (events) whose confirmed fall was ``verdict`` (``diverged``: the reward held,
    ``regressed``: it fell with the gold metric): what it acted on, a warning (the run ended on its best policy)."""

    def condition(history: History, config: DoctorConfig) -> Iterator[Hit]:
        events = [e for e in history.events_of(M.EVENT_GOLD_ROLLBACK) if e.get("verdict") == verdict]
        if events:
            steps = [int(e["step"]) for e in events]
            detail = (
                f"{len(events)} rollback(s) at step(s) {', '.join(map(str, steps))}; first: {events[0].get('cause')}"
            )
            where = "the best policy the watch kept (OUTPUT_DIR/best-gold)"
            yield Hit(
                [Evidence(M.EVENT_GOLD_ROLLBACK, steps[0], steps[-1], detail)], {"n": len(events), "where": where}
            )

    return condition


def _repairs(history: History, config: DoctorConfig) -> Iterator[Hit]:
    if n := history.count(M.OPEFO_REPAIRS, M.EVENT_STATE_REPAIR):
        events = history.events_of(M.EVENT_STATE_REPAIR)
        entries = sum(int(e.get("entries", 0)) for e in events)
        detail = f"{n} repair(s) of {entries} non-finite Adam moment entries in place (weights finite)"
        steps = [int(e["step"]) for e in events if "step" in e]
        yield Hit([Evidence(M.OPEFO_REPAIRS, *_span(steps, history.last_step), detail)])


def _only(severity: str, condition: Condition) -> Condition:
    """``condition``'s hits of one severity (for rules whose message depends on it)."""
    return lambda history, config: (hit for hit in condition(history, config) if hit.severity == severity)


def _entropy_fall(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """Entropy's late mean below ``entropy_drop_frac`` x its early mean: a problem with KL rising, repetition rising
    or reward flat/falling, unless reward still rises (the policy sharpening; docs/DESIGN.md, "Why GRPO runs die"),
    which is a warning only below ``entropy_learning_frac``."""
    name = _first(history, M.ENTROPY, M.QUATRO_ENTROPY)
    entropy = _trend(history, name, config)
    if entropy is None or entropy.early.mean() <= 0 or entropy.ratio >= config.entropy_drop_frac:
        return
    reward = _trend(history, M.REWARD, config)
    rising = reward is not None and reward.z >= config.rise_z
    evidence, signs = [entropy.evidence(name, f" ({entropy.ratio:.0%} of the early mean)")], []
    kl_name = _first(history, M.KL, M.QUATRO_KL_MEAN)
    if (kl := _trend(history, kl_name, config)) is not None and kl.ratio >= config.kl_rise_ratio:
        signs.append("KL rising")
        evidence.append(kl.evidence(kl_name))
    for reason in history.matching(M.QUATRO_FILTERED_PREFIX):
        if any(w in reason for w in REPETITION_WORDS) and (rep := _counter_rising(history, reason, config)):
            signs.append("repetition filter counts rising")
            evidence.append(rep.evidence(reason))
    if reward is not None and reward.z < config.flat_z:
        signs.append("reward flat" if reward.z > -config.flat_z else "reward falling")
        evidence.append(reward.evidence(M.REWARD, f" (change {reward.z:+.1f} pooled std)"))
    steps, floor = history.finite(M.QUATRO_FLOOR_ACTIVE)
    if floor_on := bool(np.count_nonzero(floor)):
        detail = f"floor active at {np.count_nonzero(floor > 0)} logged step(s) and entropy still fell"
        evidence.append(Evidence(M.QUATRO_FLOOR_ACTIVE, *_span(steps[floor > 0], 0), detail))
    steps, held = history.finite(M.QUATRO_FLOOR_HELD_OFF)
    if gate := bool(np.count_nonzero(held)):
        detail = f"the learning gate held the floor off at {np.count_nonzero(held > 0)} logged step(s): the training "
        evidence.append(Evidence(M.QUATRO_FLOOR_HELD_OFF, *_span(steps[held > 0], 0), detail + "reward rose"))
    followed = False
    steps, floors = history.finite(M.QUATRO_ENTROPY_FLOOR)
    if len(floors) >= 2 and floors[-1] < floors[0]:  # the floor is fixed once set; only follow_learning lowers it
        detail = f"the floor followed entropy down {floors[0]:.4g} -> {floors[-1]:.4g} (follow_learning: the learning "
        lowered = steps[1:][np.diff(floors) < 0]
        evidence.append(Evidence(M.QUATRO_ENTROPY_FLOOR, *_span(lowered, 0), detail + "gate's reward rose)"))
        # entropy at or above the floor it was allowed to fall to, and no sign of a collapse that makes it a problem
        followed = entropy.late.mean() >= floors[-1] and (rising or not signs)
    repeating = any(sign.startswith("repetition") for sign in signs)
    if rising and entropy.ratio >= config.entropy_learning_frac and not floor_on and not repeating:
        return  # a policy sharpening while it learns (its KL rises too, nothing repeats): not a precursor
    note = (" while reward still rises" if rising else "") + (f" ({', '.join(signs)})" if signs else "")
    fixes = {"followed": CHANGE_FOLLOWED if followed else "", "floor": CHANGE_FLOOR_ON if floor_on else CHANGE_FLOOR}
    fields = {"ratio": entropy.ratio, "signs": ", ".join(signs), "note": note, "gate": CHANGE_GATE if gate else ""}
    yield Hit(evidence, fields | fixes, "problem" if signs and not rising else "warning")


def _eval_fall(history: History, config: DoctorConfig) -> tuple[int, int, Evidence] | None:
    """(best step, last step, evidence) when the last eval accuracy is below the best by more than its noise
    (``eval_drop`` and ``eval_z`` standard errors of the difference) with ``eval_after_points`` evals after the best."""
    points = [
        (int(r["step"]), float(r[M.EVAL_ACCURACY]), r)
        for r in history.rows
        if to_float(r.get(M.EVAL_ACCURACY)) is not None and np.isfinite(float(r[M.EVAL_ACCURACY]))
    ]
    if len(points) < config.min_eval_points:
        return None
    best = max(range(len(points)), key=lambda i: points[i][1])
    (best_step, top, _), (last_step, last, _) = points[best], points[-1]
    se = [gold_se(row, gold) for _, gold, row in (points[best], points[-1])]
    margin = max(config.eval_drop, config.eval_z * float(np.hypot(*[x if np.isfinite(x) else 0.0 for x in se])))
    if len(points) - 1 - best < config.eval_after_points or top - last <= margin:
        return None
    detail = f"best {top:.4g} at step {best_step} -> {last:.4g} at step {last_step} ({margin:.3g} allowed by its noise)"
    return best_step, last_step, Evidence(M.EVAL_ACCURACY, best_step, last_step, detail)


def _eval_falls(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """Eval accuracy fell beyond its noise (``_eval_fall``) while the reward rose after the best."""
    fall = _eval_fall(history, config)
    r_steps, reward = history.finite(M.REWARD)
    if fall is None:
        return
    best_step, last_step, evidence = fall
    before, after = r_steps <= best_step, (r_steps > best_step) & (r_steps <= last_step)
    w = min(config.window, int(before.sum()), int(after.sum()))
    if w < 2:
        return
    idx = np.concatenate([np.flatnonzero(before)[-w:], np.flatnonzero(after)[-w:]])
    if (trend := _Trend(r_steps[idx], reward[idx], w)).z >= config.rise_z:
        yield Hit([evidence, trend.evidence(M.REWARD, f" (+{trend.z:.1f} pooled std)")], {"best_step": best_step})


def _watch_replay(history: History, verdict: str) -> tuple[int, Evidence] | None:
    """(reference step, evidence) of the first fall the gold watch's rule (``guards.gold_watch``, its defaults)
    confirms as ``verdict`` on this history; None when none, or when the watch acted live (its rollbacks are the
    finding, and the history after them is another policy's). A watch in observe mode logs no rollback: replayed."""
    if any(e.get("verdict") for e in history.events_of(M.EVENT_GOLD_ROLLBACK)):
        return None
    detector = GoldDetector()
    for point in eval_points(history.rows):
        if detector.update(*point) == verdict:
            assert detector.best_step is not None and detector.best_gold is not None
            how = "held" if verdict == "diverged" else "fell with it"
            detail = (
                f"the gold watch's rule, replayed: {detector.best_gold:.4g} at step {detector.best_step} -> "
                f"{point.gold:.4g} at step {point.step}, {detector.streak} evals in a row more than "
                f"{detector.margin(point.gold_se):.3g} below it (its noise); the training reward {how}"
            )
            return detector.best_step, Evidence(M.EVAL_ACCURACY, detector.best_step, point.step, detail)
    return None


def _watch_diverged(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """The gold watch's rule, replayed on a run it did not watch, confirms a fall while the reward held."""
    if (found := _watch_replay(history, "diverged")) is not None:
        yield Hit([found[1]], {"best_step": found[0]})


def _regressed(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """The run got worse by itself: the training reward fell (``reward_fall_z`` pooled std and ``reward_fall_frac`` of
    its early level, windows of ``reward_fall_points`` rewards or more), the last eval is below the best beyond its
    noise while the reward did not rise (that is hacking), or the gold watch's rule, replayed, confirms a fall with
    the reward (the run may have recovered since)."""
    reward = _trend(history, M.REWARD, config)
    if reward is None:
        return
    early, late = float(reward.early.mean()), float(reward.late.mean())
    fell = reward.z <= -config.reward_fall_z and early - late >= config.reward_fall_frac * max(abs(early), 1e-12)
    fell = fell and reward.w >= config.reward_fall_points
    fall = _eval_fall(history, config) if reward.z < config.rise_z else None
    watch = _watch_replay(history, "regressed")
    if not (fell or fall or watch):
        return
    evidence = [reward.evidence(M.REWARD, f" ({reward.z:.1f} pooled std)")] if fell else []
    best_step = None
    if fall is not None:
        best_step, _, eval_evidence = fall
        evidence.append(eval_evidence)
    if watch is not None:
        best_step = watch[0] if best_step is None else best_step
        evidence.append(watch[1])
    signal = ""
    zero = _trend(history, M.FRAC_REWARD_ZERO_STD, config)
    if zero is not None and float(zero.late.mean()) >= config.zero_std_share:
        evidence.append(zero.evidence(M.FRAC_REWARD_ZERO_STD, " (groups whose completions all got one reward)"))
        signal = "; no learning signal left (nearly every group's rewards are equal: zero advantage, zero gradient)"
    where = (
        f"the checkpoint nearest step {best_step} (the best eval)" if best_step is not None else "an early checkpoint"
    )
    yield Hit(evidence, {"signal": signal, "where": where})


def _while_reward_rises(drifted: Callable[[_Trend, DoctorConfig], bool], name: str) -> Condition:
    """``name``'s trend ``drifted`` while the training reward rose."""

    def condition(history: History, config: DoctorConfig) -> Iterator[Hit]:
        reward = _trend(history, M.REWARD, config)
        if reward is None or reward.z < config.rise_z or (trend := _trend(history, name, config)) is None:
            return
        if drifted(trend, config):
            fields = {"way": "grew" if trend.ratio > 1 else "shrank", "ratio": trend.ratio}
            extra = f" ({trend.ratio:.2g}x)" if name == M.COMPLETIONS_MEAN_LENGTH else ""
            yield Hit([trend.evidence(name, extra), reward.evidence(M.REWARD)], fields)

    return condition


def _logp_gap(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """The vLLM-policy log-prob gap rules (``early_warnings.logp_gap_verdict``) over the whole run."""
    steps, values = history.finite(LOGP_GAP)
    c, w = config, max(3, min(config.window, len(values) // 3))
    points = list(zip(steps.tolist(), values.tolist(), strict=True))
    verdict = logp_gap_verdict(points, w, c.logp_gap_max, c.logp_gap_rise_ratio, c.logp_gap_floor, c.logp_gap_allowance)
    if verdict is None:
        return
    where = f"median {verdict.median:.4g} nats per token over steps {verdict.late[0]}-{verdict.late[1]}"
    if verdict.severity == "problem":
        first_bad = int(steps[np.argmax(values > verdict.limit)])
        detail = f"{where} (> {verdict.limit:.4g}); first above it at step {first_bad}, first value {values[0]:.4g}"
    else:
        assert verdict.early is not None
        detail = f"{where}, {verdict.growth()} over steps {verdict.early[0]}-{verdict.early[1]}"
    yield Hit([Evidence(LOGP_GAP, int(steps[0]), int(steps[-1]), detail)], severity=verdict.severity)


def _ess_falls(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """``mismatch/ess`` (vLLM rollouts): a problem when the late median is below ``ess_problem``; a warning when the
    loss 1 - ESS grew ``ess_loss_rise`` x from the early window's lowest (the best agreement seen: a sync that stops
    in the first steps leaves one in-sync batch) to a late median above ``ess_loss_floor``."""
    steps, values = history.finite(M.MISMATCH_ESS)
    if len(values) < config.min_points:
        return
    c, w = config, max(3, min(config.window, len(values) // 3))
    loss = 1.0 - values
    early, late = float(loss[:w].min()), float(np.median(loss[-w:]))
    where = f"median {1 - late:.4g} over steps {steps[-w]}-{steps[-1]} (highest {1 - early:.4g} over steps {steps[0]}-"
    where += f"{steps[w - 1]})"
    if 1 - late < c.ess_problem:
        yield Hit([Evidence(M.MISMATCH_ESS, int(steps[0]), int(steps[-1]), where)], {"ess": 1 - late}, "problem")
    elif late >= c.ess_loss_floor and late >= c.ess_loss_rise * early:
        yield Hit([Evidence(M.MISMATCH_ESS, int(steps[0]), int(steps[-1]), where)], {"ess": 1 - late}, "warning")


def _truncation_bias(history: History, config: DoctorConfig) -> Iterator[Hit]:
    """A vLLM run (``mismatch/ess`` logged) whose sampling settings bias TRL's correction (``config.truncation``)."""
    if config.truncation is None:
        return
    steps, values = history.finite(M.MISMATCH_ESS)
    if len(values):
        where = f"{len(values)} generation batches, median ESS {float(np.median(values)):.4g}"
        yield Hit([Evidence(M.MISMATCH_ESS, int(steps[0]), int(steps[-1]), where)], {"settings": config.truncation})


def _saturated(history: History, config: DoctorConfig) -> Iterator[Hit]:
    for c in saturation_checks(history):
        yield Hit([Evidence(c.metric, c.first_step, c.last_step, c.detail)], {"summary": c.summary, "fix": c.change})


# ----------------------------------------------------------------------------------------------- the rules

# fmt: off
CHANGE_SPIKE = ("guards.gepo.enabled: true and guards.gepo.spike.enabled: true: skip a step whose gradient norm is "
    "non-finite or above guards.gepo.spike.min_ratio (100; lower it for smaller jumps) x the median of its recent "
    "norms and z_threshold (6) robust spreads above it (docs/DESIGN.md: GEPO: spike skip)")
CHANGE_LR = "trainer.learning_rate: lower it 2-3x (NaN loss -> lower the learning rate, clip gradients)"
CHANGE_CLIP = "trainer.max_grad_norm: 1.0 (clip what the spike guard lets through)"
CHANGE_LOGPROB = ("guards.gepo.logprob_min: -100: a -inf log-prob makes the ratio NaN (docs/DESIGN.md: GEPO: "
    "log-prob floor and finite checks); also check that the attention mask covers the padding")
CHANGE_NAN_REWARD = ("fix the reward function that returns NaN/inf (rewards:); guards.gepo.enabled: true treats such "
    "rewards as unscorable")
CHANGE_ROLLBACK = CHANGE_LR + ("; OPEFO already runs each recovery at 0.3x the rate, so repeated rollbacks mean the "
    "base rate is too high")
CHANGE_REPAIR = ("usually a one-off (an overflow in one gradient entry): nothing to change. If it repeats, look for "
    "inf/NaN in the rewards or log-probs, and ") + CHANGE_LR
CHANGE_FLOOR = ("guards.quatro.entropy: turn the entropy floor on (0.8x the early entropy, bonus below it; "
    "docs/DESIGN.md: QUATRO: entropy floor)")
CHANGE_FLOOR_ON = ("guards.quatro.entropy.coef_max: the floor is on and entropy still fell; raise the bonus cap "
    "(0.01), pg_brake (1.0: no reward gradient while the control is at 1; brake_moments 0.01 lets the bonus and the KL "
    "term act at full speed) or the gain ki, or lower floor_ratio if the falling entropy is the task being learned "
    "(docs/DESIGN.md: QUATRO: entropy floor)")
CHANGE_GATE = ("guards.quatro.entropy.gate_reward: the learning gate held the floor off while the training reward "
    "rose; if the collapse itself can buy that reward (a proxy, a reward model), name a trusted one for the gate (a "
    "verifier, weight 0 allowed) and set follow_learning: true (docs/DESIGN.md: QUATRO: entropy floor)")
CHANGE_FOLLOWED = ("nothing, if the held-out accuracy holds: the floor followed entropy down as its learning gate's "
    "reward rose; follow_learning: false holds floor_ratio x the early entropy (docs/DESIGN.md: QUATRO: entropy floor)")
CHANGE_KL = ("guards.quatro.kl.target: set a number below the logged KL (target: auto only steps in at 10x the early "
    "KL), or trainer.beta: raise it 2-3x, to pull the policy back to the reference (docs/DESIGN.md: QUATRO: adaptive "
    "KL)")
CHANGE_FILTER = ("guards.quatro: tighten the rollout filters (reward z-score 3.5 -> 3.0, length and repetition "
    "filters; docs/DESIGN.md: QUATRO: rollout filters)")
CHANGE_LOOK = ("read the highest-reward rollouts for padding, format tricks, repeated phrases (docs/DESIGN.md: "
    "Periodic eval)")
CHANGE_TRUNCATION = ("the reward favours long answers: add a length penalty to rewards: or tighten the guards.quatro "
    "length filter; a larger trainer.max_completion_length only hides it")
CHANGE_SYNC = ("check that each weight sync reaches vLLM: vLLM >= 0.22, < 0.32 with TRL 1.16 (steadyrl.trainers."
    "vllm_support warns about others); on vLLM's CPU backend steadyrl must have logged 'weight prepacking is off'",
    "meanwhile trainer.use_vllm: false generates on-policy")
CHANGE_MISMATCH = ("meanwhile trainer.vllm_importance_sampling_mode: token_mask (or sequence_mask with a lower "
    "trainer.vllm_importance_sampling_clip_max, e.g. 2.0) drops the mismatched tokens, and "
    "guards.gepo.mismatch.ess_min: 0.5 skips the updates trained on such batches")
CHANGE_TRUNCATED = ("trainer.vllm_importance_sampling_mode: token_truncate, or trainer.top_p: 1.0 and trainer.top_k: "
    "0 (temperature alone), or trainer.vllm_importance_sampling_correction: false (steadyrl refuses the sequence "
    "modes with truncated sampling on TRL <= 1.16)")
CHANGE_REGRESSION = ("trainer.learning_rate: lower it 3-10x and resume from {where}; with a periodic eval (eval.every, "
    "eval.on_start: true) the gold watch (guards.quatro.gold) rolls back to the best policy and halves the learning "
    "rate when the held-out metric falls beyond its noise (docs/DESIGN.md: QUATRO: gold watch)")
CRASH = (CHANGE_SPIKE, CHANGE_LR, CHANGE_LOGPROB)
COLLAPSE_READS = (M.ENTROPY, M.QUATRO_ENTROPY, M.KL, M.QUATRO_KL_MEAN, M.QUATRO_FILTERED_PREFIX, M.REWARD)
COLLAPSE_READS += (M.QUATRO_FLOOR_ACTIVE, M.QUATRO_FLOOR_HELD_OFF, M.QUATRO_ENTROPY_FLOOR)
COLLAPSE = ("{followed}", "{floor}", "{gate}", CHANGE_KL, "trainer.learning_rate: lower it")
COLLAPSE += ("trainer.temperature: 0.8 or more, trainer.top_p 0.9-0.95 (repeated text)",)
LENGTH = (M.COMPLETIONS_MEAN_LENGTH, M.REWARD)
CLIPPED = (M.COMPLETIONS_CLIPPED_RATIO, M.REWARD)

# Within a mode the hits keep this order, problems first; the finding's fixes are theirs in order, without repeats.
RULES: tuple[Rule, ...] = (
    Rule("hard_crash", "problem", (M.LOSS, M.GRAD_NORM), _died,
         "{names} non-finite at the end of a run with no final row: it died at step {last}",
         (CHANGE_SPIKE, CHANGE_LR, CHANGE_CLIP, CHANGE_LOGPROB,
          "resume from a checkpoint saved before step {first_bad} (trainer.resume_from_checkpoint)")),
    Rule("hard_crash", "warning", (M.LOSS, M.GRAD_NORM), _survived,
         "{names} non-finite at some steps; training went on", CRASH),
    Rule("hard_crash", "problem", ("*",), _last_row_nonfinite,
         "the last logged row (step {step}) is non-finite and the run has no final row", CRASH),
    Rule("hard_crash", "warning", (M.GRAD_NORM,), _spike,
         "grad norm jumped by orders of magnitude", (CHANGE_SPIKE, CHANGE_CLIP, CHANGE_LR)),
    Rule("hard_crash", "warning", (M.GEPO_SKIPPED_STEPS, M.EVENT_SKIP), _many_skips,
         "GEPO skips many steps",
         (CHANGE_LR, "guards.grade.enabled: true: reward outliers drive gradient spikes (docs/DESIGN.md: GRADE: "
          "reward scaler)")),
    *(Rule("hard_crash", "warning", (name,), _rising_count(name), name + " rising", (fix, CHANGE_SPIKE))
      for name, fix in zip(NONFINITE_COUNTERS, (CHANGE_NAN_REWARD, *[CHANGE_LOGPROB] * 3), strict=True)),
    Rule("hard_crash", "warning", (M.GEPO_ADV_STD,), _adv_std_rising,
         "advantage std rising steadily",
         ("guards.grade.enabled: true: reward outliers hijack the group statistics (docs/DESIGN.md: GRADE: reward "
          "scaler)", "guards.gepo.advantage.enabled: true (median/MAD + tanh clip, clip_scale 3.0)")),
    Rule("hard_crash", "warning", (M.OPEFO_ROLLBACKS, M.EVENT_ROLLBACK), _rollbacks,  # problem: rollbacks_problem+
         "OPEFO rolled back to a snapshot", (CHANGE_ROLLBACK, CHANGE_SPIKE)),
    Rule("hard_crash", "warning", (M.OPEFO_REPAIRS, M.EVENT_STATE_REPAIR), _repairs,
         "OPEFO repaired non-finite optimizer state", (CHANGE_REPAIR,)),
    Rule("entropy_collapse", "problem", COLLAPSE_READS, _only("problem", _entropy_fall),
         "entropy fell to {ratio:.0%} of its early mean with {signs}", COLLAPSE),
    Rule("entropy_collapse", "warning", COLLAPSE_READS, _only("warning", _entropy_fall),
         "entropy fell to {ratio:.0%} of its early mean{note}: precursor", COLLAPSE),
    Rule("reward_hacking", "problem", (M.EVAL_ACCURACY, M.REWARD), _eval_falls,
         "training reward rises while eval accuracy falls",
         ("keep the checkpoint nearest step {best_step} (best eval accuracy), not the last one",
          CHANGE_KL.replace("to pull the policy back", "to anchor the policy"), CHANGE_FILTER, CHANGE_LOOK)),
    Rule("reward_hacking", "problem", (M.EVAL_ACCURACY, M.REWARD), _watch_diverged,
         "the held-out metric fell beyond its noise while the training reward held",
         ("keep the checkpoint nearest step {best_step} (the best eval), not the last one; the gold watch (GRPO with "
          "eval.every) rolls back to it while the run trains", CHANGE_LOOK)),
    Rule("regression", "problem", (M.REWARD, M.EVAL_ACCURACY, M.FRAC_REWARD_ZERO_STD), _regressed,
         "the run regressed by itself{signal}", (CHANGE_REGRESSION,)),
    Rule("reward_hacking", "warning", (M.EVENT_GOLD_ROLLBACK,), _gold_rollbacks("diverged"),
         "the gold watch rolled back {n} time(s): the training reward held while the held-out metric fell",
         (CHANGE_LOOK,)),
    Rule("regression", "warning", (M.EVENT_GOLD_ROLLBACK,), _gold_rollbacks("regressed"),
         "the gold watch rolled back {n} time(s): the training reward fell with the held-out metric",
         (CHANGE_REGRESSION,)),
    Rule("reward_hacking", "warning", LENGTH,
         _while_reward_rises(lambda t, c: not 1 / c.length_ratio < t.ratio < c.length_ratio, LENGTH[0]),
         "completion length {way} {ratio:.2g}x while reward rises",
         ("add a length penalty to rewards: (a reward function), or tighten the guards.quatro length filter",
          CHANGE_LOOK)),
    Rule("reward_hacking", "warning", CLIPPED,
         _while_reward_rises(lambda t, c: t.late.mean() - t.early.mean() >= c.clipped_rise, CLIPPED[0]),
         "more completions hit max_completion_length while reward rises", (CHANGE_TRUNCATION, CHANGE_LOOK)),
    Rule("off_policy_rollouts", "problem", (LOGP_GAP,), _only("problem", _logp_gap),
         "vLLM's log-probs of its own samples disagree with the policy's", CHANGE_SYNC),
    Rule("off_policy_rollouts", "warning", (LOGP_GAP,), _only("warning", _logp_gap),
         "vLLM's log-probs drift away from the policy's", CHANGE_SYNC),
    Rule("off_policy_rollouts", "problem", (M.MISMATCH_ESS,), _only("problem", _ess_falls),
         "the vLLM rollouts' effective sample size fell to {ess:.2g}", (*CHANGE_SYNC, CHANGE_MISMATCH)),
    Rule("off_policy_rollouts", "warning", (M.MISMATCH_ESS,), _only("warning", _ess_falls),
         "the vLLM rollouts' effective sample size is falling ({ess:.3g})", (*CHANGE_SYNC, CHANGE_MISMATCH)),
    Rule("off_policy_rollouts", "warning", (M.MISMATCH_ESS,), _truncation_bias,
         "{settings}: TRL's vLLM importance ratio carries each token's kept probability mass (huggingface/trl#6789), "
         "not a sync fault", (CHANGE_TRUNCATED,)),
    Rule("saturated_controller", "warning", ("steadyrl.evidence.saturation",), _saturated, "{summary}", ("{fix}",)),
)
# fmt: on


# ----------------------------------------------------------------------------------------------- public


ROLLOUT_HACKING = {"length_drift": LENGTH, "clipped_rise": CLIPPED}  # the reward-hacking rules that read rollouts only


def rollout_hacking(history: History, config: DoctorConfig | None = None) -> list[tuple[str, str]]:
    """``(name, summary)`` of each reward-hacking rule in ``ROLLOUT_HACKING`` that fires on ``history``: completion
    length grown by ``length_ratio`` or truncation up by ``clipped_rise``, while the reward rises. They need no eval
    metric: ``SignalMonitor`` runs them during training. Length that shrinks is left to the doctor: it is what a run
    learning a concise format does."""
    config = config or DoctorConfig()
    return [(name, rule.finding(hit).summary) for name, reads in ROLLOUT_HACKING.items()
            for rule in RULES if rule.mode == "reward_hacking" and rule.reads == reads
            for hit in rule.condition(history, config) if hit.fields.get("way") != "shrank"]  # fmt: skip


def rollout_mismatch(history: History, config: DoctorConfig | None = None) -> list[str]:
    """The doctor's ``mismatch/ess`` rule (``_ess_falls``) as summaries with their evidence, for ``SignalMonitor``:
    a falling effective sample size of the vLLM rollouts (problem or warning)."""
    config = config or DoctorConfig()
    return [f"{rule.finding(hit).summary}: {hit.evidence[0]}" for rule in RULES if rule.reads == (M.MISMATCH_ESS,)
            for hit in rule.condition(history, config)]  # fmt: skip


def doctor_config_for(run_dir: str | Path) -> DoctorConfig:
    """Default thresholds, with the vLLM gap allowance of the run's sampling settings (``resolved_config.yaml``)."""
    resolved = Path(run_dir) / "resolved_config.yaml"
    trainer = {}
    if resolved.is_file():
        trainer = (yaml.safe_load(resolved.read_text()) or {}).get("trainer") or {}
    sampling = float(trainer.get("top_p", 1.0)), int(trainer.get("top_k") or 0), float(trainer.get("min_p") or 0.0)
    allowance = logp_gap_allowance(*sampling, float(trainer.get("repetition_penalty", 1.0)))
    return DoctorConfig(logp_gap_allowance=allowance, truncation=_truncation(run_dir, trainer))


def _truncation(run_dir: str | Path, trainer: dict[str, Any]) -> str | None:
    """``DoctorConfig.truncation`` of a run: its settings in words when TRL's correction was on under truncated
    sampling, on the TRL that ran it (``environment.json``; the installed one when absent), in a sequence mode or with
    top_k / min_p; None otherwise."""
    from importlib.metadata import PackageNotFoundError, version

    from steadyrl.guards.mismatch import truncation_band, truncation_settings

    if not trainer.get("use_vllm") or not trainer.get("vllm_importance_sampling_correction", True):
        return None
    env = Path(run_dir) / "environment.json"
    trl_version = None
    if env.is_file():
        trl_version = (json.loads(env.read_text()).get("packages") or {}).get("trl")
    if trl_version is None:
        with contextlib.suppress(PackageNotFoundError):
            trl_version = version("trl")
    band = truncation_band(trainer, trl_version)
    mode = str(trainer.get("vllm_importance_sampling_mode", "sequence_mask"))
    if band is None or (math.isfinite(band) and not mode.startswith("sequence")):
        return None
    return f"{mode} with {truncation_settings(trainer)} on TRL {trl_version}"


def diagnose(history: History, config: DoctorConfig | None = None) -> list[Finding]:
    """One Finding per failure mode found (in MODES order); an empty list means healthy."""
    config = config or DoctorConfig()
    findings = []
    for mode in MODES:
        found = [rule.finding(hit) for rule in RULES if rule.mode == mode for hit in rule.condition(history, config)]
        found.sort(key=lambda f: f.severity != "problem")
        if found:
            changes = list(dict.fromkeys(c for f in found for c in f.changes))
            evidence = [e for f in found for e in f.evidence]
            findings.append(Finding(mode, found[0].severity, "; ".join(f.summary for f in found), evidence, changes))
    return findings


def format_findings(findings: list[Finding], history: History) -> str:
    """Plain text for a terminal: a headline per finding, its evidence, what to change; or the healthy line."""
    source = f"{history.source or 'history'} ({history.status()})"
    if not findings:
        checked = [m for m in CHECKED if history.has(m)] + history.matching(M.QUATRO_FILTERED_PREFIX)
        checked = ", ".join(checked) or "none"
        return f"healthy: no failure mode found ({history.last_step} steps, metrics checked: {checked})\n{source}\n"
    lines = [source, ""]
    for f in findings:
        headline = f"{f.severity.upper()} [{f.mode}] {TITLES[f.mode]}"
        lines += [headline, f"  {f.summary}", "  evidence:", *(f"    - {e}" for e in f.evidence)]
        lines += ["  what to change:", *(f"    - {c}" for c in f.changes), ""]
    return "\n".join(lines)
