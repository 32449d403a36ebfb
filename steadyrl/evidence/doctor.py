"""``steadyrl doctor``: which of the three ways a GRPO run dies is under way, from its logged metrics alone.

The three ways a run dies (docs/DESIGN.md, "Why GRPO runs die") each announce themselves in the logs:
- ``hard_crash``: loss/grad norm go inf/NaN; before that the grad norm jumps by orders of magnitude, advantage
  std creeps up, non-finite rewards/log-probs appear, GEPO skips and OPEFO rollbacks pile up.
- ``entropy_collapse``: entropy falls while KL rises and reward stays flat or falls; the model repeats
  itself (repetition filter counts rise).
- ``reward_hacking`` (silent failure): training reward rises while eval accuracy falls, or while completion
  length or truncation drifts far from where it started.
The remedies are the design's (docs/DESIGN.md), written as steadyrl config keys.

One more silent failure, outside the original design notes: ``off_policy_rollouts``, vLLM generating from other
weights than the ones being trained (a weight sync that does not reach it). TRL's
``sampling/sampling_logp_difference/mean`` (per-token |vLLM log-prob - policy log-prob| of the sampled tokens) then
grows from float noise to nats.

And one that is steadyrl's own: ``saturated_controller``, a guard held at its bound (the KL coefficient at its
cap, the entropy bonus at its cap, filters dropping a large share, the spike guard skipping in a row or
re-anchoring, GRADE's tail clip touching far more rows than its quantiles expect), which means one of its
settings does not fit this run (``steadyrl.evidence.saturation``).

Trends compare an early window of logged rows with a late one (``DoctorConfig.window`` rows each, a third of a
short series). Every check needs a large, sustained change, so a noisy but healthy run gives no finding. The
doctor reads logs only: it cannot see the samples, so a finding says where to look, not what the model did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from steadyrl.evidence.early_warnings import logp_gap_allowance, logp_gap_verdict
from steadyrl.evidence.history import History, to_float
from steadyrl.evidence.saturation import saturation_checks
from steadyrl.metrics import (
    COMPLETIONS_CLIPPED_RATIO,
    COMPLETIONS_MEAN_LENGTH,
    ENTROPY,
    EVAL_ACCURACY,
    EVENT_ROLLBACK,
    EVENT_SKIP,
    EVENT_STATE_REPAIR,
    GEPO_ADV_STD,
    GEPO_NONFINITE_LOGPROBS,
    GEPO_NONFINITE_LOSS,
    GEPO_NONFINITE_RATIOS,
    GEPO_NONFINITE_REWARDS,
    GEPO_SKIPPED_STEPS,
    GRAD_NORM,
    KL,
    LOSS,
    OPEFO_REPAIRS,
    OPEFO_ROLLBACKS,
    QUATRO_ENTROPY,
    QUATRO_ENTROPY_FLOOR,
    QUATRO_FILTERED_PREFIX,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_FLOOR_HELD_OFF,
    QUATRO_KL_MEAN,
    REWARD,
    SAMPLING_LOGP_GAP,
    TRAIN_RUNTIME,
)

MODES = ("hard_crash", "entropy_collapse", "reward_hacking", "off_policy_rollouts", "saturated_controller")
TITLES = {
    "hard_crash": "hard crash (inf/NaN, gradient explosion)",
    "entropy_collapse": "entropy collapse (the policy stops exploring and repeats itself)",
    "reward_hacking": "reward hacking (training reward up, real quality not)",
    "off_policy_rollouts": "off-policy rollouts (vLLM generates from other weights than the trained ones)",
    "saturated_controller": "a guard held at its bound (its setting does not fit this run)",
}
LOGP_GAP = SAMPLING_LOGP_GAP
NONFINITE_COUNTERS = (
    GEPO_NONFINITE_REWARDS,
    GEPO_NONFINITE_LOGPROBS,
    GEPO_NONFINITE_LOSS,
    GEPO_NONFINITE_RATIOS,
)
CHECKED = (
    LOSS,
    GRAD_NORM,
    REWARD,
    ENTROPY,
    QUATRO_ENTROPY,
    KL,
    QUATRO_KL_MEAN,
    GEPO_ADV_STD,
    GEPO_SKIPPED_STEPS,
    *NONFINITE_COUNTERS,
    OPEFO_REPAIRS,
    OPEFO_ROLLBACKS,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_FLOOR_HELD_OFF,
    QUATRO_ENTROPY_FLOOR,
    EVAL_ACCURACY,
    COMPLETIONS_MEAN_LENGTH,
    COMPLETIONS_CLIPPED_RATIO,
    LOGP_GAP,
)
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
    kl_rise_ratio: float = 2.0  # late KL mean >= this x the early mean: KL rising
    flat_z: float = 0.5  # reward gain (late - early mean) below this x the windows' pooled std: flat
    rise_z: float = 1.0  # reward gain above this x the pooled std: rising
    eval_drop: float = 0.05  # the last eval accuracy this far (absolute) below the best: falling
    eval_after_points: int = 2  # ... with at least this many evals after the best (one low eval is noise)
    min_eval_points: int = 3  # eval rows needed to read an eval trend
    length_ratio: float = 2.0  # completions/mean_length late/early beyond this, or below 1/this: anomaly
    clipped_rise: float = 0.2  # completions/clipped_ratio late - early mean above this: truncation rising
    logp_gap_max: float = 0.1  # vLLM-policy log-prob gap (nats/token): late-window median above this: off-policy
    logp_gap_rise_ratio: float = 5.0  # ... or this x the early window's median (a warning; a stale sync at low lr)
    logp_gap_floor: float = 0.005  # ... when the late median is above this (below it is float noise)
    # what the run's sampling settings alone add to the gap (guards.monitor.logp_gap_allowance; None: no gap check);
    # doctor_config_for(run_dir) reads it from resolved_config.yaml
    logp_gap_allowance: float | None = 0.0


@dataclass
class Evidence:
    """What a check saw: one metric over a step range, the values in words."""

    metric: str
    first_step: int
    last_step: int
    detail: str

    def __str__(self) -> str:
        one = self.first_step == self.last_step
        steps = f"step {self.first_step}" if one else f"steps {self.first_step}-{self.last_step}"
        return f"{self.metric}, {steps}: {self.detail}"


@dataclass
class Finding:
    """One failure mode under way or past: severity "warning" (precursor) or "problem" (it happened)."""

    mode: str
    severity: str
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    changes: list[str] = field(default_factory=list)

    @property
    def headline(self) -> str:
        return f"{self.severity.upper()} [{self.mode}] {TITLES[self.mode]}"


# ----------------------------------------------------------------------------------------------- helpers


def _finite(history: History, name: str) -> tuple[np.ndarray, np.ndarray]:
    steps, values = history.series(name)
    ok = np.isfinite(values)
    return steps[ok], values[ok]


@dataclass
class _Trend:
    """Early vs late window of one metric's finite values."""

    steps: np.ndarray
    values: np.ndarray
    w: int

    @property
    def early(self) -> np.ndarray:
        return self.values[: self.w]

    @property
    def late(self) -> np.ndarray:
        return self.values[-self.w :]

    @property
    def ratio(self) -> float:
        early = float(self.early.mean())
        return float(self.late.mean()) / early if early > 0 else (np.inf if self.late.mean() > 0 else 1.0)

    @property
    def z(self) -> float:
        """(late mean - early mean) in units of the windows' pooled within-window std."""
        gain = float(self.late.mean() - self.early.mean())
        pooled = float(np.sqrt((self.early.var() + self.late.var()) / 2))
        scale = max(pooled, 1e-12 * max(1.0, abs(float(self.early.mean()))))
        return gain / scale

    def describe(self, fmt: str = ".4g") -> str:
        e0, e1, l0, l1 = self.steps[0], self.steps[self.w - 1], self.steps[-self.w], self.steps[-1]
        return f"mean {self.early.mean():{fmt}} over steps {e0}-{e1} -> {self.late.mean():{fmt}} over steps {l0}-{l1}"

    def evidence(self, metric: str, extra: str = "") -> Evidence:
        return Evidence(metric, int(self.steps[0]), int(self.steps[-1]), self.describe() + extra)


def _trend(history: History, name: str, config: DoctorConfig) -> _Trend | None:
    steps, values = _finite(history, name)
    if len(values) < config.min_points:
        return None
    return _Trend(steps, values, max(2, min(config.window, len(values) // 3)))


def _first(history: History, *names: str) -> str | None:
    return next((n for n in names if history.has(n)), None)


def _counter_rising(history: History, name: str, config: DoctorConfig) -> _Trend | None:
    """A per-step count (non-finite values, filtered rollouts) that became frequent and larger late in the run.

    Rising: at least ``counter_nonzero_frac`` of the late window's rows are non-zero, and the late mean is
    ``counter_rise_ratio`` x the early window's mean. A count that shows up now and then (a reward function that
    returns NaN once in a while) stays silent.
    """
    trend = _trend(history, name, config)
    if trend is None or np.count_nonzero(trend.late) < config.counter_nonzero_frac * trend.w:
        return None
    if trend.ratio < config.counter_rise_ratio:
        return None
    return trend


@dataclass
class _Check:
    severity: str
    summary: str
    evidence: list[Evidence]
    changes: list[str]


# ----------------------------------------------------------------------------------------------- hard crash

CHANGE_SPIKE = (
    "guards.gepo.enabled: true and guards.gepo.spike.enabled: true: skip an optimizer step whose gradient norm is "
    "non-finite or above spike_factor x its EMA (docs/DESIGN.md: GEPO: spike skip); lower "
    "guards.gepo.spike.spike_factor (5.0) to "
    "catch smaller jumps"
)
CHANGE_LR = "trainer.learning_rate: lower it 2-3x (NaN loss -> lower the learning rate, clip gradients)"
CHANGE_CLIP = "trainer.max_grad_norm: 1.0 (clip what the spike guard lets through)"
CHANGE_LOGPROB = (
    "guards.gepo.logprob_min: -100: a -inf log-prob makes the ratio NaN (docs/DESIGN.md: GEPO: log-prob floor and "
    "finite checks); also check that the "
    "attention mask covers the padding"
)


def _nonfinite_checks(history: History, config: DoctorConfig) -> list[_Check]:
    checks = []
    skipped = set(history.skipped_steps.tolist())
    died, survived, last_step = [], [], 0
    for name in (LOSS, GRAD_NORM):
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
            died.append(evidence)
            last_step = max(last_step, int(steps[-1]))
        else:
            survived.append(evidence)
    if died:
        names = ", ".join(e.metric for e in died)
        first_bad = min(e.first_step for e in died)
        changes = [
            CHANGE_SPIKE,
            CHANGE_LR,
            CHANGE_CLIP,
            CHANGE_LOGPROB,
            f"resume from a checkpoint saved before step {first_bad} (trainer.resume_from_checkpoint)",
        ]
        summary = f"{names} non-finite at the end of a run with no final row: it died at step {last_step}"
        checks.append(_Check("problem", summary, died, changes))
    if survived:
        names = ", ".join(e.metric for e in survived)
        summary = f"{names} non-finite at some steps; training went on"
        checks.append(_Check("warning", summary, survived, [CHANGE_SPIKE, CHANGE_LR, CHANGE_LOGPROB]))
    rows = [r for r in history.rows if TRAIN_RUNTIME not in r]
    if rows and not history.finished and not any(c.severity == "problem" for c in checks):
        last = max(rows, key=lambda r: r["step"])
        if last["step"] in skipped:  # a skipped step's NaN never reached the weights
            return checks
        bad_keys = [k for k, v in last.items() if k != "step" and (f := to_float(v)) is not None and not np.isfinite(f)]
        if bad_keys:
            detail = ", ".join(f"{k}={last[k]}" for k in bad_keys[:6])
            checks.append(
                _Check(
                    "problem",
                    f"the last logged row (step {last['step']}) is non-finite and the run has no final row",
                    [Evidence(bad_keys[0], last["step"], last["step"], detail)],
                    [CHANGE_SPIKE, CHANGE_LR, CHANGE_LOGPROB],
                )
            )
    return checks


def _spike_check(history: History, config: DoctorConfig) -> _Check | None:
    steps, values = _finite(history, GRAD_NORM)
    jumps = []
    for i in range(config.spike_min_history, len(values)):
        median = float(np.median(values[max(0, i - config.spike_median_window) : i]))
        if median > 0 and values[i] >= config.spike_ratio * median and values[i] >= config.spike_min_value:
            jumps.append((int(steps[i]), float(values[i]), median))
    if not jumps:
        return None
    skipped = set(history.skipped_steps.tolist())
    shown = "; ".join(
        f"step {s}: {v:.4g} = {v / m:.0f}x the running median {m:.3g}" + (" (skipped)" if s in skipped else "")
        for s, v, m in jumps[:3]
    )
    evidence = Evidence(
        GRAD_NORM, jumps[0][0], jumps[-1][0], f"{len(jumps)} jump(s) of >= {config.spike_ratio:g}x: {shown}"
    )
    return _Check(
        "warning", "grad norm jumped by orders of magnitude", [evidence], [CHANGE_SPIKE, CHANGE_CLIP, CHANGE_LR]
    )


def _precursor_checks(history: History, config: DoctorConfig) -> list[_Check]:
    checks = []
    skipped = history.skipped_steps
    n_skipped = history.count(GEPO_SKIPPED_STEPS, EVENT_SKIP)
    if n_skipped and history.last_step and n_skipped / history.last_step > config.skip_fraction:
        first, last = (int(skipped[0]), int(skipped[-1])) if len(skipped) else (0, history.last_step)
        detail = f"{n_skipped} of {history.last_step} optimizer steps skipped ({n_skipped / history.last_step:.0%})"
        changes = [
            CHANGE_LR,
            "guards.grade.enabled: true: reward outliers drive gradient spikes (docs/DESIGN.md: GRADE: reward scaler)",
        ]
        checks.append(
            _Check("warning", "GEPO skips many steps", [Evidence(GEPO_SKIPPED_STEPS, first, last, detail)], changes)
        )
    for name in NONFINITE_COUNTERS:
        if (trend := _counter_rising(history, name, config)) is not None:
            change = {
                GEPO_NONFINITE_REWARDS: "fix the reward function that returns NaN/inf (rewards:); "
                "guards.gepo.enabled: true treats such rewards as unscorable",
            }.get(name, CHANGE_LOGPROB)
            checks.append(_Check("warning", f"{name} rising", [trend.evidence(name)], [change, CHANGE_SPIKE]))
    adv_steps, adv = _finite(history, GEPO_ADV_STD)
    if len(adv) >= max(config.min_points, 8):
        tail = slice(-min(len(adv), 4 * config.window), None)
        chunks = np.array_split(adv[tail], 4)
        means = np.array([c.mean() for c in chunks])
        if np.all(np.diff(means) > 0) and means[0] > 0 and means[-1] >= config.adv_std_rise_ratio * means[0]:
            tail_steps = adv_steps[tail]
            detail = "chunk means " + " -> ".join(f"{m:.3g}" for m in means)
            changes = [
                "guards.grade.enabled: true: reward outliers hijack the group statistics (docs/DESIGN.md: GRADE: "
                "reward scaler)",
                "guards.gepo.advantage.enabled: true (median/MAD + tanh clip, clip_scale 3.0)",
            ]
            evidence = Evidence(GEPO_ADV_STD, int(tail_steps[0]), int(tail_steps[-1]), detail)
            checks.append(_Check("warning", "advantage std rising steadily", [evidence], changes))
    n_rollbacks = history.count(OPEFO_ROLLBACKS, EVENT_ROLLBACK)
    if n_rollbacks:
        steps = history.rollback_steps
        causes = sorted({str(e.get("cause")) for e in history.events_of(EVENT_ROLLBACK) if e.get("cause")})
        detail = f"{n_rollbacks} rollback(s)" + (f", causes: {', '.join(causes)}" if causes else "")
        first, last = (int(steps[0]), int(steps[-1])) if len(steps) else (0, history.last_step)
        severity = "problem" if n_rollbacks >= config.rollbacks_problem else "warning"
        changes = [
            CHANGE_LR + "; OPEFO already runs each recovery at 0.3x the rate, so repeated rollbacks mean the base "
            "rate is too high",
            CHANGE_SPIKE,
        ]
        checks.append(
            _Check(
                severity, "OPEFO rolled back to a snapshot", [Evidence(OPEFO_ROLLBACKS, first, last, detail)], changes
            )
        )
    n_repairs = history.count(OPEFO_REPAIRS, EVENT_STATE_REPAIR)
    if n_repairs:
        events = history.events_of(EVENT_STATE_REPAIR)
        steps = [int(e["step"]) for e in events if "step" in e]
        entries = sum(int(e.get("entries", 0)) for e in events)
        detail = f"{n_repairs} repair(s) of {entries} non-finite Adam moment entries in place (weights finite)"
        first, last = (steps[0], steps[-1]) if steps else (0, history.last_step)
        changes = [
            "usually a one-off (an overflow in one gradient entry): nothing to change. If it repeats, look for "
            "inf/NaN in the rewards or log-probs, and " + CHANGE_LR,
        ]
        evidence = [Evidence(OPEFO_REPAIRS, first, last, detail)]
        checks.append(_Check("warning", "OPEFO repaired non-finite optimizer state", evidence, changes))
    return checks


# ----------------------------------------------------------------------------------------------- collapse

CHANGE_FLOOR = (
    "guards.quatro.entropy: turn the entropy floor on (0.8x the early entropy, bonus below it; docs/DESIGN.md: "
    "QUATRO: entropy floor)"
)
CHANGE_FLOOR_ON = (
    "guards.quatro.entropy.coef_max: the floor is on and entropy still fell; raise the bonus cap (0.01 by "
    "default), cov_clip (0, off, by default; 1.0 is every sharpening token), pg_brake (1.0 by "
    "default: the reward's policy gradient goes while the control is at 1; with brake_moments 0.01, the default, "
    "Adam's moments follow it, so the bonus and the KL term pull entropy back at full speed; check both are set) "
    "or the gain ki, or lower floor_ratio if the falling entropy is the task being learned (docs/DESIGN.md: "
    "QUATRO: entropy floor)"
)
CHANGE_GATE = (
    "guards.quatro.entropy.gate_reward: the learning gate held the floor off while the training reward rose; if that "
    "reward can be bought by the collapse itself (a proxy, a reward model, a format reward), name a reward you trust "
    "for the gate (a verifier, weight 0 allowed) and set follow_learning: true (docs/DESIGN.md: QUATRO: entropy floor)"
)
CHANGE_FOLLOWED = (
    "nothing, if the held-out accuracy holds: the floor followed entropy down because the reward its learning gate "
    "reads rose (follow_learning), so it accepted this fall as learning; set follow_learning: false to hold "
    "floor_ratio x the early entropy instead (docs/DESIGN.md: QUATRO: entropy floor)"
)
CHANGE_KL = (
    "guards.quatro.kl.target: set a number below the logged KL (target: auto only steps in at 10x the early KL), "
    "or trainer.beta: raise it 2-3x, to pull the policy back to the reference (docs/DESIGN.md: QUATRO: adaptive KL)"
)


def _collapse_check(history: History, config: DoctorConfig) -> _Check | None:
    name = _first(history, ENTROPY, QUATRO_ENTROPY)
    entropy = _trend(history, name, config) if name else None
    if entropy is None or entropy.early.mean() <= 0 or entropy.ratio >= config.entropy_drop_frac:
        return None
    evidence = [entropy.evidence(name, f" ({entropy.ratio:.0%} of the early mean)")]
    signs = []
    kl_name = _first(history, KL, QUATRO_KL_MEAN)
    kl = _trend(history, kl_name, config) if kl_name else None
    if kl is not None and kl.ratio >= config.kl_rise_ratio:
        signs.append("KL rising")
        evidence.append(kl.evidence(kl_name))
    for reason in history.matching(QUATRO_FILTERED_PREFIX):
        if any(w in reason for w in REPETITION_WORDS) and (rep := _counter_rising(history, reason, config)):
            signs.append("repetition filter counts rising")
            evidence.append(rep.evidence(reason))
    reward = _trend(history, REWARD, config)
    rising = reward is not None and reward.z >= config.rise_z
    if reward is not None and reward.z < config.flat_z:
        signs.append("reward flat" if reward.z > -config.flat_z else "reward falling")
        evidence.append(reward.evidence(REWARD, f" (change {reward.z:+.1f} pooled std)"))
    floor_steps, floor = _finite(history, QUATRO_FLOOR_ACTIVE)
    floor_on = bool(np.count_nonzero(floor))
    if floor_on:
        active = floor_steps[floor > 0]
        detail = f"floor active at {len(active)} logged step(s) and entropy still fell"
        evidence.append(Evidence(QUATRO_FLOOR_ACTIVE, int(active[0]), int(active[-1]), detail))
    changes = [CHANGE_FLOOR_ON if floor_on else CHANGE_FLOOR, CHANGE_KL, "trainer.learning_rate: lower it"]
    held_steps, held = _finite(history, QUATRO_FLOOR_HELD_OFF)
    if np.count_nonzero(held):
        off = held_steps[held > 0]
        detail = f"the learning gate held the floor off at {len(off)} logged step(s): the training reward rose"
        evidence.append(Evidence(QUATRO_FLOOR_HELD_OFF, int(off[0]), int(off[-1]), detail))
        changes.insert(1, CHANGE_GATE)
    floor_steps, floors = _finite(history, QUATRO_ENTROPY_FLOOR)
    if len(floors) >= 2 and floors[-1] < floors[0]:  # the floor is fixed once set; only follow_learning lowers it
        lowered = floor_steps[1:][np.diff(floors) < 0]
        detail = (
            f"the floor followed entropy down {floors[0]:.4g} -> {floors[-1]:.4g} (follow_learning: the learning "
            "gate's reward rose)"
        )
        evidence.append(Evidence(QUATRO_ENTROPY_FLOOR, int(lowered[0]), int(lowered[-1]), detail))
        # entropy at or above the floor it was allowed to fall to, and no sign of a collapse that makes it a problem
        if entropy.late.mean() >= floors[-1] and (rising or not signs):
            changes.insert(0, CHANGE_FOLLOWED)
    changes.append("trainer.temperature: 0.8 or more, trainer.top_p 0.9-0.95 (repeated text)")
    if signs and not rising:
        summary = f"entropy fell to {entropy.ratio:.0%} of its early mean with {', '.join(signs)}"
        return _Check("problem", summary, evidence, changes)
    # Reward still rising: the policy is sharpening, not yet collapsed (collapse = reward stuck; docs/DESIGN.md,
    # "Why GRPO runs die").
    note = " while reward still rises" if rising else ""
    note += f" ({', '.join(signs)})" if signs else ""
    summary = f"entropy fell to {entropy.ratio:.0%} of its early mean{note}: precursor"
    return _Check("warning", summary, evidence, changes)


# ----------------------------------------------------------------------------------------------- hacking

CHANGE_FILTER = (
    "guards.quatro: tighten the rollout filters (reward z-score 3.5 -> 3.0, length and repetition filters; "
    "docs/DESIGN.md: QUATRO: rollout filters)"
)
CHANGE_LOOK = (
    "read the highest-reward rollouts for padding, format tricks, repeated phrases (docs/DESIGN.md: Periodic eval)"
)


def _hacking_checks(history: History, config: DoctorConfig) -> list[_Check]:
    checks = []
    e_steps, acc = _finite(history, EVAL_ACCURACY)
    r_steps, reward = _finite(history, REWARD)
    if len(acc) >= config.min_eval_points:
        best = int(np.argmax(acc))
        best_step, last_step = int(e_steps[best]), int(e_steps[-1])
        before = r_steps <= best_step
        after = (r_steps > best_step) & (r_steps <= last_step)
        w = min(config.window, int(before.sum()), int(after.sum()))
        sustained = len(acc) - 1 - best >= config.eval_after_points and acc[best] - acc[-1] >= config.eval_drop
        if sustained and w >= 2:
            idx = np.concatenate([np.flatnonzero(before)[-w:], np.flatnonzero(after)[-w:]])
            trend = _Trend(r_steps[idx], reward[idx], w)
            if trend.z >= config.rise_z:
                detail = f"best {acc[best]:.4g} at step {best_step} -> {acc[-1]:.4g} at step {last_step}"
                evidence = [
                    Evidence(EVAL_ACCURACY, best_step, last_step, detail),
                    trend.evidence(REWARD, f" (+{trend.z:.1f} pooled std)"),
                ]
                changes = [
                    f"keep the checkpoint nearest step {best_step} (best eval accuracy), not the last one",
                    CHANGE_KL.replace("to pull the policy back", "to anchor the policy"),
                    CHANGE_FILTER,
                    CHANGE_LOOK,
                ]
                checks.append(_Check("problem", "training reward rises while eval accuracy falls", evidence, changes))
    reward_trend = _trend(history, REWARD, config)
    if reward_trend is None or reward_trend.z < config.rise_z:
        return checks
    length = _trend(history, COMPLETIONS_MEAN_LENGTH, config)
    if length is not None and not 1 / config.length_ratio < length.ratio < config.length_ratio:
        way = "grew" if length.ratio > 1 else "shrank"
        evidence = [
            length.evidence(COMPLETIONS_MEAN_LENGTH, f" ({length.ratio:.2g}x)"),
            reward_trend.evidence(REWARD),
        ]
        changes = [
            "add a length penalty to rewards: (a reward function), or tighten the guards.quatro length filter",
            CHANGE_LOOK,
        ]
        checks.append(
            _Check("warning", f"completion length {way} {length.ratio:.2g}x while reward rises", evidence, changes)
        )
    clipped = _trend(history, COMPLETIONS_CLIPPED_RATIO, config)
    if clipped is not None and clipped.late.mean() - clipped.early.mean() >= config.clipped_rise:
        evidence = [clipped.evidence(COMPLETIONS_CLIPPED_RATIO), reward_trend.evidence(REWARD)]
        changes = [
            "the reward favours long answers: add a length penalty to rewards: or tighten the guards.quatro length "
            "filter; a larger trainer.max_completion_length only hides it",
            CHANGE_LOOK,
        ]
        checks.append(
            _Check("warning", "more completions hit max_completion_length while reward rises", evidence, changes)
        )
    return checks


# ----------------------------------------------------------------------------------------------- off-policy rollouts


def _off_policy_check(history: History, config: DoctorConfig) -> _Check | None:
    """The vLLM-policy log-prob gap rules (``steadyrl.evidence.early_warnings.logp_gap_verdict``) over the whole run."""
    steps, values = _finite(history, LOGP_GAP)
    w = max(3, min(config.window, len(values) // 3))
    c = config
    points = list(zip(steps.tolist(), values.tolist(), strict=True))
    verdict = logp_gap_verdict(points, w, c.logp_gap_max, c.logp_gap_rise_ratio, c.logp_gap_floor, c.logp_gap_allowance)
    if verdict is None:
        return None
    where = f"median {verdict.median:.4g} nats per token over steps {verdict.late[0]}-{verdict.late[1]}"
    if verdict.severity == "problem":
        summary = "vLLM's log-probs of its own samples disagree with the policy's"
        first_bad = int(steps[np.argmax(values > verdict.limit)])
        detail = f"{where} (> {verdict.limit:.4g}); first above it at step {first_bad}, first value {values[0]:.4g}"
    else:
        assert verdict.early is not None
        summary = "vLLM's log-probs drift away from the policy's"
        detail = f"{where}, {verdict.growth()} over steps {verdict.early[0]}-{verdict.early[1]}"
    changes = [
        "check that each weight sync reaches vLLM: vLLM >= 0.22, < 0.32 with TRL 1.16 (steadyrl.trainers.vllm_support "
        "warns about others); on vLLM's CPU backend steadyrl must have logged 'weight prepacking is off'",
        "meanwhile trainer.use_vllm: false generates on-policy",
    ]
    evidence = [Evidence(LOGP_GAP, int(steps[0]), int(steps[-1]), detail)]
    return _Check(verdict.severity, summary, evidence, changes)


# ----------------------------------------------------------------------------------------------- public


def _saturation_checks(history: History) -> list[_Check]:
    """steadyrl.evidence.saturation's findings (a controller at a bound), as warnings."""
    return [
        _Check("warning", c.summary, [Evidence(c.metric, c.first_step, c.last_step, c.detail)], [c.change])
        for c in saturation_checks(history)
    ]


def doctor_config_for(run_dir: str | Path) -> DoctorConfig:
    """Default thresholds, with the vLLM gap allowance of the run's sampling settings (``resolved_config.yaml``)."""
    resolved = Path(run_dir) / "resolved_config.yaml"
    trainer = {}
    if resolved.is_file():
        trainer = (yaml.safe_load(resolved.read_text()) or {}).get("trainer") or {}
    allowance = logp_gap_allowance(
        float(trainer.get("top_p", 1.0)),
        int(trainer.get("top_k") or 0),
        float(trainer.get("min_p") or 0.0),
        float(trainer.get("repetition_penalty", 1.0)),
    )
    return DoctorConfig(logp_gap_allowance=allowance)


def diagnose(history: History, config: DoctorConfig | None = None) -> list[Finding]:
    """One Finding per failure mode found (in MODES order); an empty list means healthy."""
    config = config or DoctorConfig()
    by_mode: dict[str, list[_Check]] = {
        "hard_crash": [
            *_nonfinite_checks(history, config),
            *filter(None, [_spike_check(history, config)]),
            *_precursor_checks(history, config),
        ],
        "entropy_collapse": list(filter(None, [_collapse_check(history, config)])),
        "reward_hacking": _hacking_checks(history, config),
        "off_policy_rollouts": list(filter(None, [_off_policy_check(history, config)])),
        "saturated_controller": _saturation_checks(history),
    }
    findings = []
    for mode in MODES:
        checks = sorted(by_mode[mode], key=lambda c: c.severity != "problem")
        if not checks:
            continue
        changes = list(dict.fromkeys(change for c in checks for change in c.changes))
        findings.append(
            Finding(
                mode=mode,
                severity=checks[0].severity,
                summary="; ".join(c.summary for c in checks),
                evidence=[e for c in checks for e in c.evidence],
                changes=changes,
            )
        )
    return findings


def checked_metrics(history: History) -> list[str]:
    """The metrics the doctor reads that this history has."""
    return [m for m in CHECKED if history.has(m)] + history.matching(QUATRO_FILTERED_PREFIX)


def format_findings(findings: list[Finding], history: History) -> str:
    """Plain text for a terminal: a headline per finding, its evidence, what to change; or the healthy line."""
    source = f"{history.source or 'history'} ({history.status()})"
    if not findings:
        checked = ", ".join(checked_metrics(history)) or "none"
        return f"healthy: no failure mode found ({history.last_step} steps, metrics checked: {checked})\n{source}\n"
    lines = [source, ""]
    for f in findings:
        lines.append(f.headline)
        lines.append(f"  {f.summary}")
        lines.append("  evidence:")
        lines.extend(f"    - {e}" for e in f.evidence)
        lines.append("  what to change:")
        lines.extend(f"    - {c}" for c in f.changes)
        lines.append("")
    return "\n".join(lines)
