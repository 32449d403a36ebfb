"""``steadyrl doctor``'s observe-mode summary: what each layer in ``mode: observe`` would have done, in counts.

Which layers observed comes from ``RUN_DIR/resolved_config.yaml``, else from the ``would`` metrics (GRADE logs
none). Per-step counts are reported as means per logged step, cumulative counters as their last value.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from steadyrl import metrics as M
from steadyrl.evidence.history import History

LAYERS = ("gepo", "opefo", "quatro", "grade")
# the names whose presence shows that a layer observed (GRADE has none: its statistics are the same in both modes)
MARKERS = {
    "gepo": (M.GEPO_WOULD_SKIP, M.GEPO_WOULD_ADV_DIFF_MEAN, M.GEPO_WOULD_CLAMP_LOGPROBS),
    "opefo": (M.OPEFO_WOULD_ROLLBACK, M.OPEFO_WOULD_REPAIR, M.OPEFO_WOULD_FLOOR_ENTRIES, M.OPEFO_WOULD_FEED_BACK),
    "quatro": (M.QUATRO_KL_COEF_WOULD, M.QUATRO_ENTROPY_BONUS_WOULD, M.QUATRO_WOULD_FILTER_SHARE),
}
READS = (*(name for names in MARKERS.values() for name in names), M.GEPO_WOULD_STOP, M.GEPO_WOULD_CLIP_ROWS)
READS += (M.QUATRO_BETA, M.QUATRO_CLIP_SCALE_WOULD, M.QUATRO_FLOOR_ACTIVE_WOULD, M.GRADE_CLIP_FRAC_LOW)
READS += (M.GRADE_CLIP_FRAC_HIGH, M.GRADE_KL_FACTOR_WOULD, M.GRADE_RAW_STD, M.GRADE_SCALED_STD)
READ_PREFIXES = (M.GEPO_WOULD_SKIP_PREFIX, M.QUATRO_WOULD_FILTER_PREFIX)


def observing_layers(run_dir: str | Path) -> tuple[list[str] | None, float | None]:
    """(observing layers, ``trainer.beta``) from ``resolved_config.yaml``; (None, None) without the file."""
    resolved = Path(run_dir) / "resolved_config.yaml"
    if not resolved.is_file():
        return None, None
    tree = yaml.safe_load(resolved.read_text()) or {}
    guards = tree.get("guards") or {}
    layers = [n for n in LAYERS if (g := guards.get(n) or {}).get("enabled") and g.get("mode") == "observe"]
    beta = (tree.get("trainer") or {}).get("beta")
    return layers, float(beta) if isinstance(beta, int | float) else None


def _last(history: History, name: str) -> float | None:
    return float(values[-1]) if len(values := history.finite(name)[1]) else None


def _mean(history: History, name: str) -> float | None:
    return float(values.mean()) if len(values := history.finite(name)[1]) else None


Summary = tuple[list[str], bool]  # what a layer would have done, and whether any of it is an intervention


def _gepo(history: History, beta: float | None) -> Summary:
    facts = []
    skips = round(_last(history, M.GEPO_WOULD_SKIP) or 0)
    names = [n for n in history.matching(M.GEPO_WOULD_SKIP_PREFIX) if n != M.GEPO_WOULD_SKIP]  # (total: same prefix)
    counts = [(n.removeprefix(M.GEPO_WOULD_SKIP_PREFIX), round(_last(history, n) or 0)) for n in names]
    detail = ", ".join(f"{r} {k}" for r, k in counts if k)
    if history.has(M.GEPO_WOULD_SKIP):
        detail = f" ({detail})" if detail else ""
        facts.append(f"spike guard: would have skipped {skips} of {history.last_step} optimizer steps{detail}")
    if stops := round(_last(history, M.GEPO_WOULD_STOP) or 0):
        facts.append(
            f"{stops} of those would-skips were past max_consecutive_skips: act mode would have stopped the run"
        )
    clip, diff = _mean(history, M.GEPO_WOULD_CLIP_ROWS), _mean(history, M.GEPO_WOULD_ADV_DIFF_MEAN)
    if diff is not None:
        part = f"{clip:.3g} rows per batch shrunk > 10 % by the tanh clip, " if clip is not None else ""
        facts.append(f"robust advantages: {part}mean |GEPO - trained advantage| {diff:.3g}")
    clamp = _mean(history, M.GEPO_WOULD_CLAMP_LOGPROBS)
    if clamp is not None:
        facts.append(f"log-prob floor: {clamp:.3g} log-probs below logprob_min per logged step")
    return facts, bool(skips or (clamp or 0) > 0 or (clip or 0) > 0)


OPEFO_COUNTS = (
    (M.OPEFO_WOULD_ROLLBACK, "finiteness checks found non-finite weights or moments (would roll back)"),
    (M.OPEFO_WOULD_REPAIR, "finiteness checks found a few non-finite Adam moments (would repair in place)"),
    (M.OPEFO_WOULD_FLOOR_ENTRIES, "exp_avg_sq entries the second-moment floor would have raised"),
    (M.OPEFO_WOULD_FEED_BACK, "skipped steps whose gradient error feedback would have kept"),
)


def _opefo(history: History, beta: float | None) -> Summary:
    found = [(round(_last(history, name) or 0), text) for name, text in OPEFO_COUNTS if history.has(name)]
    return [f"{n} {text}" for n, text in found], any(n for n, _ in found)


def _quatro(history: History, beta: float | None) -> Summary:
    facts, intervene, coef = [], False, history.finite(M.QUATRO_KL_COEF_WOULD)[1]
    if len(coef):
        base = beta if beta is not None else _last(history, M.QUATRO_BETA)
        lo, hi = float(coef.min()), float(coef.max())
        where = f" (trainer.beta {base:.4g} stayed)" if base is not None else ""
        facts.append(f"KL controller: coefficient would end at {coef[-1]:.4g}, range [{lo:.4g}, {hi:.4g}]{where}")
        intervene |= base is None or not np.isclose(coef[-1], base, rtol=0.1)
    bonus = history.series(M.QUATRO_ENTROPY_BONUS_WOULD)[1]
    if len(bonus):
        n_active = int(np.count_nonzero(history.finite(M.QUATRO_FLOOR_ACTIVE_WOULD)[1] > 0))
        clip = _last(history, M.QUATRO_CLIP_SCALE_WOULD)
        extra = f", clip scale down to {clip:g} while active" if clip is not None and n_active else ""
        if len(braked := history.finite(M.QUATRO_PG_SCALE_WOULD)[1]) and n_active:
            extra += f", policy gradient scaled down to {float(braked.min()):.3g}x by the brake"
        what = f"entropy floor: would be active at {n_active} logged step(s), bonus up to {np.nanmax(bonus):.4g}"
        facts.append(what + extra)
        intervene |= n_active > 0
    share = _mean(history, M.QUATRO_WOULD_FILTER_SHARE)
    if share is not None:
        prefix = M.QUATRO_WOULD_FILTER_PREFIX
        reasons = {name.removeprefix(prefix): _mean(history, name) or 0.0 for name in history.matching(prefix)}
        detail = ", ".join(f"{r} {v:.3g}" for r, v in reasons.items() if v)
        detail = f" (rows per batch: {detail})" if detail else ""
        facts.append(f"rollout filters: would drop {share:.1%} of rows on average{detail}")
        intervene |= share > 0
    return facts, intervene


def _grade(history: History, beta: float | None) -> Summary:
    facts = []
    low, high = _mean(history, M.GRADE_CLIP_FRAC_LOW), _mean(history, M.GRADE_CLIP_FRAC_HIGH)
    if low is not None or high is not None:
        facts.append(f"tail clip: would soften {low or 0:.1%} (low) and {high or 0:.1%} (high) of the rewards")
    raw, scaled = _mean(history, M.GRADE_RAW_STD), _mean(history, M.GRADE_SCALED_STD)
    if raw is not None and scaled is not None:
        facts.append(f"reward std: raw {raw:.4g}, scaled {scaled:.4g} (mean per batch)")
    factor = history.series(M.GRADE_KL_FACTOR_WOULD)[1]
    if len(factor):
        facts.append(f"KL compensation: factor would range over [{np.nanmin(factor):.3g}, {np.nanmax(factor):.3g}]")
    # under GRPO's group std scaling only the tail clip changes advantages (docs/DESIGN.md, "GRADE: reward scaler")
    return facts, bool((low or 0) > 0 or (high or 0) > 0)


def format_observe_summary(history: History, run_dir: str | Path | None = None) -> str:
    """The doctor's observe-mode block, one part per observing layer in the order data meets them; "" when none."""
    layers, beta = observing_layers(run_dir) if run_dir is not None else (None, None)
    if layers is None:  # the layers whose observe-only metrics the history holds
        layers = [n for n, names in MARKERS.items() if any(history.has(m) for m in names)]
    if not layers:
        return ""
    lines = ["observe mode: what the observing layers would have done (none of it was applied)"]
    for layer, summarize in (("grade", _grade), ("quatro", _quatro), ("gepo", _gepo), ("opefo", _opefo)):
        if layer in layers:
            facts, intervene = summarize(history, beta)
            lines.append(f"  {layer.upper()} (guards.{layer}.mode: observe):")
            lines.extend(f"    - {fact}" for fact in facts or ["no decision logged"])
            act = f"it would have intervened: guards.{layer}.mode=act applies it"
            lines.append(f"    -> {act if intervene else 'it would not have intervened in this run'}")
    return "\n".join(lines) + "\n"
