"""``steadyrl report RUN_DIR``: PNG plots of a run's logs and a ``report.md`` that embeds them.

Output goes to ``RUN_DIR/report/``: one PNG per panel (a panel whose metrics were never logged is skipped with a
note) and ``report.md`` with a summary table and the doctor's diagnosis. Drawn through the Agg canvas (no pyplot).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from steadyrl import metrics as M
from steadyrl.evidence.doctor import DoctorConfig, diagnose, doctor_config_for, format_findings
from steadyrl.evidence.history import History, load_history
from steadyrl.evidence.interventions import format_table, load_summary

STEP = "optimizer step"
NONFINITE = "non-finite (NaN/inf)"
MAXIMISE = (M.REWARD, M.REWARD_STD, M.EVAL_REWARD, M.EVAL_ACCURACY)  # the "best" column is the max for these
SUMMARY = (M.REWARD, M.EVAL_ACCURACY, M.EVAL_REWARD, M.LOSS, M.GRAD_NORM, M.ENTROPY, M.KL, M.COMPLETIONS_MEAN_LENGTH)
SUMMARY += (M.COMPLETIONS_CLIPPED_RATIO, M.GEPO_ADV_STD, M.GRADE_SCALED_STD, M.QUATRO_KL_COEF)


# ----------------------------------------------------------------------------------------------- drawing


def _marks(ax: Axes, steps: np.ndarray, y: float, label: str, **kw) -> None:
    """Markers at ``steps`` (x in data) at height ``y`` in axes coordinates."""
    ax.scatter(steps, np.full(len(steps), y), transform=ax.get_xaxis_transform(), label=label, **kw)


def _line(ax: Axes, history: History, name: str, label: str | None = None, positive: bool = False, **kw) -> None:
    """One metric's finite values (> 0 only when ``positive``: log axes); red crosses mark the non-finite ones."""
    steps, values = history.series(name)
    if not len(steps):
        return
    finite = np.isfinite(values)
    ok = finite & (values > 0) if positive else finite
    ax.plot(steps[ok], values[ok], label=label or name, **{"marker": "." if ok.sum() <= 50 else None, **kw})
    if len(bad := steps[~finite]):
        label = "_nolegend_" if NONFINITE in ax.get_legend_handles_labels()[1] else NONFINITE
        _marks(ax, bad, 0.97, label, marker="x", color="red", zorder=5, clip_on=False)


def _finish(ax: Axes, history: History, title: str, ylabel: str, twin: Axes | None = None) -> None:
    """Title, labels, grid, one legend for ``ax`` and its twin (below the plot then); x spans every logged step."""
    first, last = int(history.steps[0]), int(history.steps[-1])
    pad = max(0.5, 0.02 * (last - first))
    ax.set(xlim=(first - pad, last + pad), title=title, xlabel=STEP, ylabel=ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    axes = [ax, *([twin] if twin is not None and twin.get_legend_handles_labels()[0] else [])]
    unique = {lab: h for a in axes for h, lab in zip(*a.get_legend_handles_labels(), strict=True)}
    if not unique:  # (a "non-finite" entry may come from both axes)
        return
    if len(axes) == 1:
        ax.legend(list(unique.values()), list(unique), loc="best", fontsize="small")
    else:
        where = {"loc": "upper center", "bbox_to_anchor": (0.5, -0.15), "ncol": 3}
        ax.legend(list(unique.values()), list(unique), fontsize="small", **where)


def _axis(ax: Axes, history: History, title: str, ylabel: str, lines=(), twin=None, **twin_kw) -> None:
    """``lines`` (metric, label, keywords) on ``ax``, ``twin`` (metric, label, axis label) on a right axis."""
    for name, label, kw in lines:
        _line(ax, history, name, label, **kw)
    right = None
    if twin is not None and history.has(twin[0]):
        right = ax.twinx()
        _line(right, history, twin[0], twin[1], color="C6", **twin_kw)
        right.set_ylabel(twin[2])
    _finish(ax, history, title, ylabel, right)


def _draw_reward(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, history, M.REWARD, "train reward (mean)", color="C0")
    steps, mean = history.series(M.REWARD)
    s2, std = history.series(M.REWARD_STD)
    if len(steps) and len(s2) == len(steps) and np.array_equal(s2, steps):
        ok = np.isfinite(mean) & np.isfinite(std)
        ax.fill_between(steps[ok], (mean - std)[ok], (mean + std)[ok], color="C0", alpha=0.15, label="± reward std")
    per_func = history.matching(M.REWARDS_PREFIX)
    if len(per_func) > 2 or not history.has(M.REWARD):  # one function's mean is the reward itself
        for name in (n for n in per_func if n.endswith("/mean")):
            _line(ax, history, name, f"{name.split('/')[1]} (mean)", linewidth=0.8)
    _line(ax, history, M.EVAL_REWARD, "eval reward", linestyle="none", marker="o", color="C2")
    twin = (M.EVAL_ACCURACY, "eval accuracy", "eval accuracy (fraction correct)")
    _axis(ax, history, "Reward (train) and eval accuracy", "reward (reward-function units)", (), twin, marker="s")


def _draw_kl(history: History, fig: Figure) -> None:
    lines = [(M.KL, "KL to reference (logged)", {}), (M.QUATRO_KL_MEAN, "KL mean (QUATRO)", {})]
    lines.append((M.QUATRO_KL_TARGET, "KL target", {"linestyle": "--", "color": "gray", "marker": None}))
    twin = (M.QUATRO_KL_COEF, "KL coefficient β", "KL coefficient β (dimensionless)")
    title = "KL to the reference policy and its coefficient"
    _axis(fig.add_subplot(), history, title, "KL (nats per token)", lines, twin)


def _draw_entropy(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, history, M.ENTROPY, "policy entropy")
    _line(ax, history, M.QUATRO_ENTROPY, "entropy (QUATRO window)")
    _line(ax, history, M.QUATRO_ENTROPY_FLOOR, "entropy floor", linestyle="--", color="red", marker=None)
    steps, active = history.series(M.QUATRO_FLOOR_ACTIVE)
    if len(on := steps[np.isfinite(active) & (active > 0)]):
        _marks(ax, on, 0.03, "floor active", marker="|", color="C2")
    twin = (M.QUATRO_ENTROPY_BONUS, "entropy bonus", "entropy bonus coefficient")
    _axis(ax, history, "Policy entropy and the entropy floor", "entropy (nats per token)", (), twin)


def _draw_grad_norm(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _, values = history.series(M.GRAD_NORM)
    if (np.isfinite(values) & (values > 0)).any():
        ax.set_yscale("log")
    _line(ax, history, M.GRAD_NORM, "gradient norm (before clipping)", positive=True)
    if len(skipped := history.skipped_steps):
        _marks(ax, skipped, 0.90, f"skipped step ({len(skipped)})", marker="v", color="orange", zorder=4)
    for i, step in enumerate(history.rollback_steps):
        ax.axvline(step, color="red", linewidth=1.2, label="rollback" if i == 0 else "_nolegend_")
    scale = " (log scale)" if ax.get_yscale() == "log" else ""
    _finish(ax, history, "Gradient norm, GEPO skips and OPEFO rollbacks", "gradient L2 norm" + scale)


def _draw_grade(history: History, fig: Figure) -> None:
    left, right = fig.subplots(1, 2)
    lines = [(M.GRADE_RAW_STD, "raw reward std", {}), (M.GRADE_SCALED_STD, "scaled reward std", {})]
    _axis(left, history, "GRADE: reward std before/after", "std (reward units)", lines)
    lines = [(M.GRADE_CLIP_FRAC_LOW, "clipped low", {}), (M.GRADE_CLIP_FRAC_HIGH, "clipped high", {})]
    _axis(right, history, "GRADE: tail clip", "fraction of rewards clipped", lines)


def _draw_filters(history: History, fig: Figure) -> None:
    lines = [(n, n.removeprefix(M.QUATRO_FILTERED_PREFIX), {}) for n in history.matching(M.QUATRO_FILTERED_PREFIX)]
    title, ylabel = "QUATRO rollout filters, per reason", "rollouts filtered per logged step (count)"
    twin = (M.QUATRO_REPLAY_FRAC, "replay fraction", "replayed fraction of the batch")
    _axis(fig.add_subplot(), history, title, ylabel, lines, twin)


def _draw_length(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, history, M.COMPLETIONS_MEAN_LENGTH, "mean length", color="C0")
    s_min, lo = history.series(M.COMPLETIONS_MIN_LENGTH)
    s_max, hi = history.series(M.COMPLETIONS_MAX_LENGTH)
    if len(s_min) and np.array_equal(s_min, s_max):
        ok = np.isfinite(lo) & np.isfinite(hi)
        ax.fill_between(s_min[ok], lo[ok], hi[ok], color="C0", alpha=0.15, label="min-max")
    _line(ax, history, M.EVAL_MEAN_LENGTH, "eval mean length", linestyle="none", marker="o", color="C2")
    twin = (M.COMPLETIONS_CLIPPED_RATIO, "clipped ratio", "fraction cut at max length")
    _axis(ax, history, "Completion length", "completion length (tokens)", (), twin)


def _draw_vllm(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    ax.set_yscale("log")
    _line(ax, history, M.SAMPLING_LOGP_GAP, "mean over tokens", positive=True)
    _line(ax, history, M.SAMPLING_LOGP_GAP_MAX, "max over tokens", positive=True, alpha=0.5)
    ax.axhline(DoctorConfig.logp_gap_max, color="red", linestyle="--", label="doctor's threshold (mean)")
    _finish(ax, history, "vLLM vs policy: |log-prob gap| of the sampled tokens", "nats per token (log scale)")


@dataclass
class Panel:
    """One PNG: drawn when any of ``needs`` was logged (a name ending in "/" is a prefix)."""

    name: str
    title: str
    needs: tuple[str, ...]
    draw: Callable[[History, Figure], None]
    size: tuple[float, float] = (8.0, 4.5)


GRADE = (M.GRADE_RAW_STD, M.GRADE_SCALED_STD, M.GRADE_CLIP_FRAC_HIGH)
PANELS = (
    Panel("reward", "Reward", (M.REWARD, M.REWARDS_PREFIX, M.EVAL_REWARD, M.EVAL_ACCURACY), _draw_reward),
    Panel("kl", "KL and KL coefficient", (M.KL, M.QUATRO_KL_MEAN, M.QUATRO_KL_COEF), _draw_kl),
    Panel("entropy", "Entropy and entropy floor", (M.ENTROPY, M.QUATRO_ENTROPY), _draw_entropy),
    Panel("grad_norm", "Gradient norm, skips, rollbacks", (M.GRAD_NORM,), _draw_grad_norm),
    Panel("grade", "GRADE reward scaler", GRADE, _draw_grade, (11.0, 4.5)),
    Panel("filters", "QUATRO filters", (M.QUATRO_FILTERED_PREFIX,), _draw_filters),
    Panel("length", "Completion length", (M.COMPLETIONS_MEAN_LENGTH,), _draw_length),
    Panel("vllm", "vLLM-policy log-prob gap", (M.SAMPLING_LOGP_GAP,), _draw_vllm),
)


# ----------------------------------------------------------------------------------------------- markdown


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _summary_rows(history: History) -> list[str]:
    rows = ["| metric | first | last | min | max | best (step) | non-finite |", "|---|---|---|---|---|---|---|"]
    names = [n for n in SUMMARY if history.has(n)]
    names += [n for n in history.matching(M.REWARDS_PREFIX) if n.endswith("/mean")]
    for name in names:
        steps, values = history.series(name)
        finite = np.isfinite(values)
        if not finite.any():
            rows.append(f"| {name} | — | {_fmt(values[-1])} | — | — | — | {len(values)} |")
            continue
        fs, fv = steps[finite], values[finite]
        i = int(np.argmax(fv))
        best = f"{_fmt(fv[i])} ({fs[i]})" if name in MAXIMISE or name.startswith(M.REWARDS_PREFIX) else "—"
        cells = [name, *map(_fmt, (values[0], values[-1], fv.min(), fv.max())), best, str(int((~finite).sum()))]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _steps_text(steps: np.ndarray, limit: int = 10) -> str:
    shown = ", ".join(map(str, steps[:limit].tolist()))
    return f" (steps {shown}{', ...' if len(steps) > limit else ''})" if len(steps) else ""


def _markdown(run_dir: Path, history: History, drawn: dict[str, str | None]) -> str:
    steps = history.steps
    skipped, rollbacks = history.skipped_steps, history.rollback_steps
    n_skipped = history.count(M.GEPO_SKIPPED_STEPS, M.EVENT_SKIP)
    n_rollbacks = history.count(M.OPEFO_ROLLBACKS, M.EVENT_ROLLBACK)
    source = f"`{history.source}`" + (f" ({history.bad_lines} unreadable line(s) skipped)" if history.bad_lines else "")
    lines = [
        f"# Run report: {run_dir.resolve().name}",
        "",
        "| run | |",
        "|---|---|",
        f"| logs | {source} |",
        f"| status | {history.status()} |",
        f"| logged steps | {len(steps)} rows, steps {steps[0] if len(steps) else 0}-{history.last_step} |",
        f"| skipped optimizer steps (GEPO) | {n_skipped}{_steps_text(skipped)} |",
        f"| rollbacks (OPEFO) | {n_rollbacks}{_steps_text(rollbacks)} |",
        f"| events | {len(history.events)} |",
        "",
        *_summary_rows(history),
        "",
        "## What steadyrl changed (interventions ledger)",
        "",
        "```text",
        format_table(ledger).rstrip() if (ledger := load_summary(run_dir, history)) else "no ledger in this run's logs",
        "```",
        "",
        "## Diagnosis (`steadyrl doctor`)",
        "",
        "```text",
        format_findings(diagnose(history, doctor_config_for(run_dir)), history).rstrip(),
        "```",
    ]
    for panel in PANELS:
        wanted = " or ".join(f"`{n}*`" if n.endswith("/") else f"`{n}`" for n in panel.needs)
        image = f"![{panel.title}]({drawn[panel.name]})" if drawn[panel.name] else None
        lines += ["", f"## {panel.title}", "", image or f"_Skipped: none of {wanted} was logged._"]
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Plot a run's logs into ``out_dir`` (default ``RUN_DIR/report``); returns the path of ``report.md``.
    Raises HistoryNotFoundError when the run folder has no logs."""
    run_dir = Path(run_dir)
    history = load_history(run_dir)
    out = Path(out_dir) if out_dir is not None else (run_dir if run_dir.is_dir() else run_dir.parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, str | None] = {}
    for panel in PANELS:
        path = out / f"{panel.name}.png"
        logged = (history.matching(n) if n.endswith("/") else history.has(n) for n in panel.needs)
        drawn[panel.name] = path.name if any(logged) else None
        if drawn[panel.name] is None:
            path.unlink(missing_ok=True)  # a stale plot from an earlier report would contradict the note
            continue
        fig = Figure(figsize=panel.size, layout="constrained")
        FigureCanvasAgg(fig)
        panel.draw(history, fig)
        fig.savefig(path, dpi=100)
    report = out / "report.md"
    report.write_text(_markdown(run_dir, history, drawn), encoding="utf-8")
    return report
