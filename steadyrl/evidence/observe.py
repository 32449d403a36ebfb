"""``steadyrl doctor``'s observe-mode summary: what each layer in ``mode: observe`` would have done, in counts.

A run with a layer in observe mode (docs/DESIGN.md, "Observe mode") trains as if the layer were off and logs its
decisions under ``would`` names. This module reads them back and says, per observing layer, what it would have
done and whether that is an intervention, so that whoever reads the doctor output knows which layer to switch to
``act``.

Which layers observed comes from ``RUN_DIR/resolved_config.yaml`` (``guards.<layer>.enabled`` and ``.mode``); without
it, from the metrics (GEPO, OPEFO and QUATRO log names that only observe mode logs; GRADE's statistics look the same
in both modes, so an observing GRADE is only found through the config). Per-step counts are means over a logging
interval when ``logging_steps > 1``, so they are reported as means per logged step; cumulative counters as their
last value.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from steadyrl.evidence.history import History
from steadyrl.metrics import (
    GEPO_WOULD_ADV_DIFF_MEAN,
    GEPO_WOULD_CLAMP_LOGPROBS,
    GEPO_WOULD_CLIP_ROWS,
    GEPO_WOULD_SKIP,
    GEPO_WOULD_SKIP_PREFIX,
    GEPO_WOULD_STOP,
    GRADE_CLIP_FRAC_HIGH,
    GRADE_CLIP_FRAC_LOW,
    GRADE_KL_FACTOR_WOULD,
    GRADE_RAW_STD,
    GRADE_SCALED_STD,
    OPEFO_WOULD_FEED_BACK,
    OPEFO_WOULD_FLOOR_ENTRIES,
    OPEFO_WOULD_REPAIR,
    OPEFO_WOULD_ROLLBACK,
    QUATRO_BETA,
    QUATRO_CLIP_SCALE_WOULD,
    QUATRO_ENTROPY_BONUS_WOULD,
    QUATRO_FLOOR_ACTIVE_WOULD,
    QUATRO_KL_COEF_WOULD,
    QUATRO_PG_SCALE_WOULD,
    QUATRO_WOULD_FILTER_PREFIX,
    QUATRO_WOULD_FILTER_SHARE,
)

LAYERS = ("gepo", "opefo", "quatro", "grade")
TITLES = {"gepo": "GEPO", "opefo": "OPEFO", "quatro": "QUATRO", "grade": "GRADE"}
# the names whose presence shows that a layer observed (GRADE has none: its statistics are the same in both modes)
MARKERS = {
    "gepo": (GEPO_WOULD_SKIP, GEPO_WOULD_ADV_DIFF_MEAN, GEPO_WOULD_CLAMP_LOGPROBS),
    "opefo": (OPEFO_WOULD_ROLLBACK, OPEFO_WOULD_REPAIR, OPEFO_WOULD_FLOOR_ENTRIES, OPEFO_WOULD_FEED_BACK),
    "quatro": (QUATRO_KL_COEF_WOULD, QUATRO_ENTROPY_BONUS_WOULD, QUATRO_WOULD_FILTER_SHARE),
}
READS = (
    *(name for names in MARKERS.values() for name in names),
    GEPO_WOULD_STOP,
    GEPO_WOULD_CLIP_ROWS,
    QUATRO_BETA,
    QUATRO_CLIP_SCALE_WOULD,
    QUATRO_FLOOR_ACTIVE_WOULD,
    GRADE_CLIP_FRAC_LOW,
    GRADE_CLIP_FRAC_HIGH,
    GRADE_KL_FACTOR_WOULD,
    GRADE_RAW_STD,
    GRADE_SCALED_STD,
)
READ_PREFIXES = (GEPO_WOULD_SKIP_PREFIX, QUATRO_WOULD_FILTER_PREFIX)


@dataclass
class LayerSummary:
    """One observing layer: what it would have done (``facts``), and whether any of it is an intervention."""

    layer: str
    facts: list[str] = field(default_factory=list)
    would_intervene: bool = False

    def lines(self) -> list[str]:
        head = f"{TITLES[self.layer]} (guards.{self.layer}.mode: observe)"
        verdict = (
            f"it would have intervened: guards.{self.layer}.mode=act applies it"
            if self.would_intervene
            else "it would not have intervened in this run"
        )
        return [f"  {head}:", *(f"    - {fact}" for fact in self.facts or ["no decision logged"]), f"    -> {verdict}"]


def observing_layers(run_dir: str | Path) -> tuple[list[str] | None, float | None]:
    """(layers with ``enabled`` and ``mode: observe``, ``trainer.beta``) from ``resolved_config.yaml``; (None,
    None) without the file."""
    resolved = Path(run_dir) / "resolved_config.yaml"
    if not resolved.is_file():
        return None, None
    tree = yaml.safe_load(resolved.read_text()) or {}
    guards = tree.get("guards") or {}
    layers = [
        n for n in LAYERS if (guards.get(n) or {}).get("enabled") and (guards.get(n) or {}).get("mode") == "observe"
    ]
    beta = (tree.get("trainer") or {}).get("beta")
    return layers, float(beta) if isinstance(beta, int | float) else None


def inferred_layers(history: History) -> list[str]:
    """Layers whose observe-only metrics the history holds."""
    return [n for n, names in MARKERS.items() if any(history.has(m) for m in names)]


def _last(history: History, name: str) -> float | None:
    _, values = history.series(name)
    values = values[np.isfinite(values)]
    return float(values[-1]) if len(values) else None


def _mean(history: History, name: str) -> float | None:
    _, values = history.series(name)
    values = values[np.isfinite(values)]
    return float(values.mean()) if len(values) else None


def _gepo(history: History) -> LayerSummary:
    s = LayerSummary("gepo")
    skips = round(_last(history, GEPO_WOULD_SKIP) or 0)
    reasons = {
        name.removeprefix(GEPO_WOULD_SKIP_PREFIX): round(_last(history, name) or 0)
        for name in history.matching(GEPO_WOULD_SKIP_PREFIX)
        if name != GEPO_WOULD_SKIP  # the total shares the per-reason prefix
    }
    detail = ", ".join(f"{r} {n}" for r, n in reasons.items() if n)
    if history.has(GEPO_WOULD_SKIP):
        s.facts.append(
            f"spike guard: would have skipped {skips} of {history.last_step} optimizer steps"
            + (f" ({detail})" if detail else "")
        )
    stops = round(_last(history, GEPO_WOULD_STOP) or 0)
    if stops:
        s.facts.append(
            f"{stops} of those would-skips were past max_consecutive_skips: act mode would have stopped the run"
        )
    clip, diff = _mean(history, GEPO_WOULD_CLIP_ROWS), _mean(history, GEPO_WOULD_ADV_DIFF_MEAN)
    if diff is not None:
        part = f"{clip:.3g} rows per batch shrunk > 10 % by the tanh clip, " if clip is not None else ""
        s.facts.append(f"robust advantages: {part}mean |GEPO - trained advantage| {diff:.3g}")
    clamp = _mean(history, GEPO_WOULD_CLAMP_LOGPROBS)
    if clamp is not None:
        s.facts.append(f"log-prob floor: {clamp:.3g} log-probs below logprob_min per logged step")
    s.would_intervene = bool(skips or (clamp or 0) > 0 or (clip or 0) > 0)
    return s


def _opefo(history: History) -> LayerSummary:
    s = LayerSummary("opefo")
    counts = {
        "rollback": (OPEFO_WOULD_ROLLBACK, "finiteness checks found non-finite weights or moments (would roll back)"),
        "repair": (OPEFO_WOULD_REPAIR, "finiteness checks found a few non-finite Adam moments (would repair in place)"),
        "floor": (OPEFO_WOULD_FLOOR_ENTRIES, "exp_avg_sq entries the second-moment floor would have raised"),
        "feedback": (OPEFO_WOULD_FEED_BACK, "skipped steps whose gradient error feedback would have kept"),
    }
    found = {}
    for key, (name, text) in counts.items():
        if history.has(name):
            found[key] = round(_last(history, name) or 0)
            s.facts.append(f"{found[key]} {text}")
    s.would_intervene = any(found.values())
    return s


def _quatro(history: History, beta: float | None) -> LayerSummary:
    s = LayerSummary("quatro")
    coef = history.series(QUATRO_KL_COEF_WOULD)[1]
    coef = coef[np.isfinite(coef)]
    intervene = False
    if len(coef):
        base = beta if beta is not None else _last(history, QUATRO_BETA)
        lo, hi = float(coef.min()), float(coef.max())
        where = f" (trainer.beta {base:.4g} stayed)" if base is not None else ""
        s.facts.append(f"KL controller: coefficient would end at {coef[-1]:.4g}, range [{lo:.4g}, {hi:.4g}]{where}")
        intervene |= base is None or not np.isclose(coef[-1], base, rtol=0.1)
    bonus = history.series(QUATRO_ENTROPY_BONUS_WOULD)[1]
    active = history.series(QUATRO_FLOOR_ACTIVE_WOULD)[1]
    if len(bonus):
        n_active = int(np.count_nonzero(active[np.isfinite(active)] > 0))
        clip = _last(history, QUATRO_CLIP_SCALE_WOULD)
        extra = f", clip scale down to {clip:g} while active" if clip is not None and n_active else ""
        braked = history.series(QUATRO_PG_SCALE_WOULD)[1]
        braked = braked[np.isfinite(braked)]
        if len(braked) and n_active:
            extra += f", policy gradient scaled down to {float(braked.min()):.3g}x by the brake"
        s.facts.append(
            f"entropy floor: would be active at {n_active} logged step(s), bonus up to {np.nanmax(bonus):.4g}{extra}"
        )
        intervene |= n_active > 0
    share = _mean(history, QUATRO_WOULD_FILTER_SHARE)
    if share is not None:
        reasons = {
            name.removeprefix(QUATRO_WOULD_FILTER_PREFIX): _mean(history, name) or 0.0
            for name in history.matching(QUATRO_WOULD_FILTER_PREFIX)
        }
        detail = ", ".join(f"{r} {v:.3g}" for r, v in reasons.items() if v)
        s.facts.append(
            f"rollout filters: would drop {share:.1%} of rows on average"
            + (f" (rows per batch: {detail})" if detail else "")
        )
        intervene |= share > 0
    s.would_intervene = intervene
    return s


def _grade(history: History) -> LayerSummary:
    s = LayerSummary("grade")
    low, high = _mean(history, GRADE_CLIP_FRAC_LOW), _mean(history, GRADE_CLIP_FRAC_HIGH)
    if low is not None or high is not None:
        s.facts.append(f"tail clip: would soften {low or 0:.1%} (low) and {high or 0:.1%} (high) of the rewards")
    raw, scaled = _mean(history, GRADE_RAW_STD), _mean(history, GRADE_SCALED_STD)
    if raw is not None and scaled is not None:
        s.facts.append(f"reward std: raw {raw:.4g}, scaled {scaled:.4g} (mean per batch)")
    factor = history.series(GRADE_KL_FACTOR_WOULD)[1]
    if len(factor):
        s.facts.append(f"KL compensation: factor would range over [{np.nanmin(factor):.3g}, {np.nanmax(factor):.3g}]")
    # under GRPO's group std scaling only the tail clip changes advantages (docs/DESIGN.md, "GRADE: reward scaler")
    s.would_intervene = bool((low or 0) > 0 or (high or 0) > 0)
    return s


def summarize(history: History, layers: Iterable[str], beta: float | None = None) -> list[LayerSummary]:
    """One summary per observing layer, in the order data meets them."""
    makers = {"gepo": _gepo, "opefo": _opefo, "quatro": lambda h: _quatro(h, beta), "grade": _grade}
    chosen = set(layers)
    return [makers[n](history) for n in ("grade", "quatro", "gepo", "opefo") if n in chosen]


def format_observe_summary(history: History, run_dir: str | Path | None = None) -> str:
    """The doctor's observe-mode block, or "" when no layer observed."""
    layers, beta = observing_layers(run_dir) if run_dir is not None else (None, None)
    if layers is None:
        layers = inferred_layers(history)
    if not layers:
        return ""
    lines = ["observe mode: what the observing layers would have done (none of it was applied)"]
    for summary in summarize(history, layers, beta):
        lines.extend(summary.lines())
    return "\n".join(lines) + "\n"
