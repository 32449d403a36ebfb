"""Controllers at a bound: the doctor's ``saturated_controller`` checks (no controller may sit at a bound silently).
Each reads counters the guards log over the late window (KL coefficient at an end of ``beta_range``, the entropy
floor's control at 1, the quality filters' drop share, spike-skip streaks and rebases, GRADE's tail-clip share) and
names the key to change.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from steadyrl import metrics as M
from steadyrl.evidence.history import History


@dataclass
class SaturationConfig:
    share: float = 0.5  # a bound counts as saturated when hit on at least this share of the late window's steps
    window: int = 20  # late window, in logged rows
    max_filter_share: float = 0.3  # quality filters dropping more than this share of rows (late-window mean)
    min_skip_streak: int = 3  # consecutive skipped optimizer steps worth reporting
    max_clip_share: float = 0.15  # GRADE's tail clip above this share of rows (late mean; by design ~2 tau = 6%)


@dataclass
class SaturationCheck:
    """One saturated controller: what it saw (metric, steps, detail) and the key to change."""

    summary: str
    metric: str
    first_step: int
    last_step: int
    detail: str
    change: str


def _late(history: History, name: str, window: int) -> tuple[np.ndarray, np.ndarray]:
    steps, values = history.finite(name)
    return steps[-window:], values[-window:]


def _last_mean(history: History, name: str, window: int) -> float:
    _, values = _late(history, name, window)
    return float(values.mean()) if len(values) else float("nan")


KL_CHANGE = {
    "upper": "guards.quatro.kl.beta_range: raise its high end (default [1, 4] x trainer.beta) if the drift is wanted; "
    "otherwise lower trainer.learning_rate, or set guards.quatro.kl.target to a number above the run's KL",
    "lower": "guards.quatro.kl.target: the run's KL stays far below it, so the anchor is loose; use target: auto "
    "(calibrated from this run) or a value near the logged quatro/kl_mean, or raise beta_range's low end",
}


def _kl_checks(history: History, c: SaturationConfig) -> list[SaturationCheck]:
    out = []
    for name, side in ((M.QUATRO_KL_AT_MAX, "upper"), (M.QUATRO_KL_AT_MIN, "lower")):
        steps, values = _late(history, name, c.window + 1)  # increments of the cumulative counter
        if len(values) < 2 or (hits := int(np.count_nonzero(np.diff(values) > 0))) < c.share * (len(values) - 1):
            continue
        coef, target = _last_mean(history, M.QUATRO_KL_COEF, 1), _last_mean(history, M.QUATRO_KL_TARGET, 1)
        kl = _last_mean(history, M.QUATRO_KL_MEAN, c.window)
        detail = f"the KL controller wanted beta past its {side} bound on {hits} of the last {len(values) - 1} steps "
        detail += f"(beta {coef:.4g}, target {target:.4g}, KL {kl:.4g})"
        summary = f"KL coefficient held at its {side} bound"
        out.append(SaturationCheck(summary, name, int(steps[1]), int(steps[-1]), detail, KL_CHANGE[side]))
    return out


def _entropy_check(history: History, c: SaturationConfig) -> SaturationCheck | None:
    name = M.QUATRO_ENTROPY_CONTROL if history.series(M.QUATRO_ENTROPY_CONTROL)[1].size else M.QUATRO_ENTROPY_BONUS
    steps, control = _late(history, name, c.window)
    _, active = _late(history, M.QUATRO_FLOOR_ACTIVE, c.window)
    _, every = history.series(name)
    cap = 1.0 if name == M.QUATRO_ENTROPY_CONTROL else (float(np.nanmax(every)) if every.size else 0.0)
    if len(control) < 2 or cap <= 0 or not len(active):
        return None
    at_cap = int(np.count_nonzero(np.isclose(control, cap)))
    if at_cap < c.share * len(control) or active.mean() < c.share:
        return None
    what = "control" if name == M.QUATRO_ENTROPY_CONTROL else "bonus"
    detail = f"the floor stayed active and its {what} sat at {cap:.4g} on {at_cap} of the last {len(control)} steps"
    change = (
        "guards.quatro.entropy.coef_max: raise it (at the cap the floor's levers do not hold entropy), or lower "
        "guards.quatro.entropy.floor_ratio if the falling entropy is the task being learned; while the control sits at "
        "1, pg_brake (1) leaves no reward gradient and brake_moments (0.01) lets the bonus and the KL term act at full "
        "speed (0 for both: the floor's bonus and clip only)"
    )
    summary = f"entropy floor's {what} held at its cap"
    return SaturationCheck(summary, name, int(steps[0]), int(steps[-1]), detail, change)


def _filter_check(history: History, c: SaturationConfig) -> SaturationCheck | None:
    steps, share = _late(history, M.QUATRO_FILTERED_SHARE, c.window)
    if len(share) < 2:
        return None
    per_reason = {}
    for name in history.matching(M.QUATRO_FILTERED_PREFIX):
        per_reason[name.removeprefix(M.QUATRO_FILTERED_PREFIX)] = float(_late(history, name, c.window)[1].sum())
    total = sum(per_reason.values())
    quality = {r: v for r, v in per_reason.items() if r != "zero_variance"}  # its rows carry no signal anyway
    if total <= 0 or (quality_share := float(share.mean()) * sum(quality.values()) / total) <= c.max_filter_share:
        return None
    worst = max(quality, key=quality.__getitem__)
    detail = f"quality filters dropped {quality_share:.0%} of rows over the last {len(share)} steps, most by {worst} "
    detail += f"({quality[worst]:.0f} rows)"
    change = f"guards.quatro.filters.{worst}: loosen its threshold or set guards.quatro.filters.{worst}.enabled=false "
    change += "(a filter that drops this much shapes the task rather than cleaning it)"
    summary, first, last = "rollout filters drop a large share of rows", int(steps[0]), int(steps[-1])
    return SaturationCheck(summary, M.QUATRO_FILTERED_SHARE, first, last, detail, change)


def _grade_check(history: History, c: SaturationConfig) -> SaturationCheck | None:
    steps, low = _late(history, M.GRADE_CLIP_FRAC_LOW, c.window)
    _, high = _late(history, M.GRADE_CLIP_FRAC_HIGH, c.window)
    if len(low) < 2 or len(high) != len(low):
        return None
    low_share, high_share = float(low.mean()), float(high.mean())
    if low_share + high_share <= c.max_clip_share:
        return None
    metric = M.GRADE_CLIP_FRAC_LOW if low_share >= high_share else M.GRADE_CLIP_FRAC_HIGH
    detail = f"the tail clip touched {low_share:.0%} (low) + {high_share:.0%} (high) of rows over the last {len(low)} "
    detail += "steps, where the quantile bounds expect about 2 x tau"
    change = "guards.grade.quantile_every: refresh the bounds more often if the rewards drift; raise guards.grade.tau "
    change += "above the share of the reward mass beyond the bound, or set guards.grade.clip=false"
    summary = "GRADE's tail clip touches a large share of rows"
    return SaturationCheck(summary, metric, int(steps[0]), int(steps[-1]), detail, change)


def _spike_checks(history: History, c: SaturationConfig) -> list[SaturationCheck]:
    out = []
    skipped = np.array(sorted(set(history.skipped_steps.tolist())), dtype=np.int64)
    if len(skipped) >= c.min_skip_streak:
        best, start, run_start, run = 1, int(skipped[0]), int(skipped[0]), 1
        for prev, cur in itertools.pairwise(skipped):
            run, run_start = (run + 1, run_start) if cur == prev + 1 else (1, int(cur))
            if run > best:
                best, start = run, run_start
        if best >= c.min_skip_streak:
            change = "guards.gepo.spike.rebase_after (4): a streak this long is a level shift the guard should take as "
            change += "the new normal; check guards.gepo.spike.min_ratio against grad_norm / gepo/spike_median"
            detail, summary = f"{best} optimizer steps in a row were skipped", "spike guard skipped steps in a row"
            out.append(SaturationCheck(summary, M.GEPO_SKIPPED_STEPS, start, start + best - 1, detail, change))
    steps, rebases = _late(history, M.GEPO_SPIKE_REBASES, 10**9)
    if len(rebases) and rebases[-1] > 0:
        first, summary = int(steps[np.argmax(rebases > 0)]), "spike guard re-anchored its baseline"
        detail = f"{rebases[-1]:.0f} streak(s) of spikes were a level shift (the guard took them as the new normal)"
        change = "guards.gepo.spike.min_ratio / z_threshold: set them from the grad_norm of a calm stretch "
        change += "(steadyrl preflight measures the margin)"
        out.append(SaturationCheck(summary, M.GEPO_SPIKE_REBASES, first, int(steps[-1]), detail, change))
    return out


def saturation_checks(history: History, config: SaturationConfig | None = None) -> list[SaturationCheck]:
    """Every saturated controller found in a run's history (none: no controller sat at a bound)."""
    c = config or SaturationConfig()
    checks = [_entropy_check(history, c), _filter_check(history, c), _grade_check(history, c)]
    return [*_kl_checks(history, c), *filter(None, checks), *_spike_checks(history, c)]
