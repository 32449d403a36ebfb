"""``steadyrl report RUN_DIR``: PNG plots of a run's logs and a ``report.md`` that embeds them.

Output goes to ``RUN_DIR/report/``: one PNG per panel and ``report.md`` with a summary table (steps, first/last/
best values, GEPO skips, OPEFO rollbacks, whether the run finished) and the doctor's diagnosis. A panel whose
metrics were never logged is skipped with a note (QUATRO/OPEFO/GRADE panels appear when those layers log).

Matplotlib draws through the Agg canvas directly (no pyplot, no global backend switch), so it works without a
display and leaves the caller's matplotlib state alone. Non-finite values are drawn as red crosses along the
top edge of the axis at their step instead of breaking the line.
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

from steadyrl.evidence.doctor import diagnose, doctor_config_for, format_findings
from steadyrl.evidence.history import History, load_history
from steadyrl.metrics import (
    COMPLETIONS_CLIPPED_RATIO,
    COMPLETIONS_MAX_LENGTH,
    COMPLETIONS_MEAN_LENGTH,
    COMPLETIONS_MIN_LENGTH,
    ENTROPY,
    EVAL_ACCURACY,
    EVAL_MEAN_LENGTH,
    EVAL_REWARD,
    EVENT_ROLLBACK,
    EVENT_SKIP,
    GEPO_ADV_STD,
    GEPO_SKIPPED_STEPS,
    GRAD_NORM,
    GRADE_CLIP_FRAC_HIGH,
    GRADE_CLIP_FRAC_LOW,
    GRADE_RAW_STD,
    GRADE_SCALED_STD,
    KL,
    LOSS,
    OPEFO_ROLLBACKS,
    QUATRO_ENTROPY,
    QUATRO_ENTROPY_BONUS,
    QUATRO_ENTROPY_FLOOR,
    QUATRO_FILTERED_PREFIX,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_KL_COEF,
    QUATRO_KL_MEAN,
    QUATRO_KL_TARGET,
    QUATRO_REPLAY_FRAC,
    REWARD,
    REWARD_STD,
    REWARDS_PREFIX,
    SAMPLING_LOGP_GAP,
    SAMPLING_LOGP_GAP_MAX,
)

STEP = "optimizer step"
NONFINITE = "non-finite (NaN/inf)"
MAXIMISE = (REWARD, REWARD_STD, EVAL_REWARD, EVAL_ACCURACY)  # the "best" column is the max for these
SUMMARY = (
    REWARD,
    EVAL_ACCURACY,
    EVAL_REWARD,
    LOSS,
    GRAD_NORM,
    ENTROPY,
    KL,
    COMPLETIONS_MEAN_LENGTH,
    COMPLETIONS_CLIPPED_RATIO,
    GEPO_ADV_STD,
    GRADE_SCALED_STD,
    QUATRO_KL_COEF,
)


# ----------------------------------------------------------------------------------------------- drawing


def _mark_nonfinite(ax: Axes, steps: np.ndarray) -> None:
    """Red crosses at the top edge of the axis (x in data, y in axes coordinates) at each step given."""
    if not len(steps):
        return
    label = "_nolegend_" if NONFINITE in ax.get_legend_handles_labels()[1] else NONFINITE
    ax.scatter(
        steps,
        np.full(len(steps), 0.97),
        marker="x",
        color="red",
        transform=ax.get_xaxis_transform(),
        label=label,
        zorder=5,
        clip_on=False,
    )


def _line(ax: Axes, history: History, name: str, label: str | None = None, positive: bool = False, **kw) -> bool:
    """Plot one metric's finite values (only > 0 ones when ``positive``, for log axes); mark the non-finite ones."""
    steps, values = history.series(name)
    if not len(steps):
        return False
    finite = np.isfinite(values)
    ok = finite & (values > 0) if positive else finite
    style = {"marker": "." if ok.sum() <= 50 else None, **kw}
    ax.plot(steps[ok], values[ok], label=label or name, **style)
    _mark_nonfinite(ax, steps[~finite])
    return True


def _legend(*axes: Axes) -> None:
    """One legend for an axis and its twin; below the plot when there is a twin ("best" sees one axis only)."""
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    if not handles:
        return
    unique = dict(zip(labels, handles, strict=True))  # "non-finite" may come from both axes
    labels, handles = list(unique), list(unique.values())
    if len(axes) == 1:
        axes[0].legend(handles, labels, loc="best", fontsize="small")
    else:
        axes[0].legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3, fontsize="small")


def _finish(ax: Axes, history: History, title: str, ylabel: str, twin: Axes | None = None) -> None:
    """Title, labels, grid, legend; x spans every logged step (crosses at the top edge do not widen it)."""
    first, last = int(history.steps[0]), int(history.steps[-1])
    pad = max(0.5, 0.02 * (last - first))
    ax.set_xlim(first - pad, last + pad)
    ax.set_title(title)
    ax.set_xlabel(STEP)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    _legend(ax, *([twin] if twin is not None and twin.get_legend_handles_labels()[0] else []))


def _twin(ax: Axes, history: History, names: list[tuple[str, str]], ylabel: str, **kw) -> Axes | None:
    present = [(n, label) for n, label in names if history.has(n)]
    if not present:
        return None
    twin = ax.twinx()
    for i, (name, label) in enumerate(present):
        _line(twin, history, name, label, color=f"C{6 + i}", **kw)
    twin.set_ylabel(ylabel)
    return twin


def _draw_reward(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    if history.has(REWARD):
        _line(ax, history, REWARD, "train reward (mean)", color="C0")
        steps, mean = history.series(REWARD)
        s2, std = history.series(REWARD_STD)
        if len(s2) == len(steps) and np.array_equal(s2, steps):
            ok = np.isfinite(mean) & np.isfinite(std)
            ax.fill_between(steps[ok], (mean - std)[ok], (mean + std)[ok], color="C0", alpha=0.15, label="± reward std")
    per_func = history.matching(REWARDS_PREFIX)
    if len(per_func) > 2 or not history.has(REWARD):  # one function's mean is the reward itself
        for name in (n for n in per_func if n.endswith("/mean")):
            _line(ax, history, name, f"{name.split('/')[1]} (mean)", linewidth=0.8)
    if history.has(EVAL_REWARD):
        _line(ax, history, EVAL_REWARD, "eval reward", linestyle="none", marker="o", color="C2")
    twin = _twin(ax, history, [(EVAL_ACCURACY, "eval accuracy")], "eval accuracy (fraction correct)", marker="s")
    _finish(ax, history, "Reward (train) and eval accuracy", "reward (reward-function units)", twin)


def _draw_kl(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, history, KL, "KL to reference (logged)")
    _line(ax, history, QUATRO_KL_MEAN, "KL mean (QUATRO)")
    _line(ax, history, QUATRO_KL_TARGET, "KL target", linestyle="--", color="gray", marker=None)
    twin = _twin(ax, history, [(QUATRO_KL_COEF, "KL coefficient β")], "KL coefficient β (dimensionless)")
    _finish(ax, history, "KL to the reference policy and its coefficient", "KL (nats per token)", twin)


def _draw_entropy(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, history, ENTROPY, "policy entropy")
    _line(ax, history, QUATRO_ENTROPY, "entropy (QUATRO window)")
    _line(ax, history, QUATRO_ENTROPY_FLOOR, "entropy floor", linestyle="--", color="red", marker=None)
    steps, active = history.series(QUATRO_FLOOR_ACTIVE)
    on = steps[np.isfinite(active) & (active > 0)]
    if len(on):
        ax.scatter(
            on, np.full(len(on), 0.03), marker="|", color="C2", transform=ax.get_xaxis_transform(), label="floor active"
        )
    twin = _twin(ax, history, [(QUATRO_ENTROPY_BONUS, "entropy bonus")], "entropy bonus coefficient")
    _finish(ax, history, "Policy entropy and the entropy floor", "entropy (nats per token)", twin)


def _draw_grad_norm(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _, values = history.series(GRAD_NORM)
    if (np.isfinite(values) & (values > 0)).any():
        ax.set_yscale("log")
    _line(ax, history, GRAD_NORM, "gradient norm (before clipping)", positive=True)
    skipped = history.skipped_steps
    if len(skipped):
        ax.scatter(
            skipped,
            np.full(len(skipped), 0.90),
            marker="v",
            color="orange",
            transform=ax.get_xaxis_transform(),
            label=f"skipped step ({len(skipped)})",
            zorder=4,
        )
    for i, step in enumerate(history.rollback_steps):
        ax.axvline(step, color="red", linewidth=1.2, label="rollback" if i == 0 else "_nolegend_")
    scale = " (log scale)" if ax.get_yscale() == "log" else ""
    _finish(ax, history, "Gradient norm, GEPO skips and OPEFO rollbacks", "gradient L2 norm" + scale)


def _draw_grade(history: History, fig: Figure) -> None:
    left, right = fig.subplots(1, 2)
    _line(left, history, GRADE_RAW_STD, "raw reward std")
    _line(left, history, GRADE_SCALED_STD, "scaled reward std")
    _finish(left, history, "GRADE: reward std before/after", "std (reward units)")
    _line(right, history, GRADE_CLIP_FRAC_LOW, "clipped low")
    _line(right, history, GRADE_CLIP_FRAC_HIGH, "clipped high")
    _finish(right, history, "GRADE: tail clip", "fraction of rewards clipped")


def _draw_filters(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    for name in history.matching(QUATRO_FILTERED_PREFIX):
        _line(ax, history, name, name.removeprefix(QUATRO_FILTERED_PREFIX))
    twin = _twin(ax, history, [(QUATRO_REPLAY_FRAC, "replay fraction")], "replayed fraction of the batch")
    _finish(ax, history, "QUATRO rollout filters, per reason", "rollouts filtered per logged step (count)", twin)


def _draw_length(history: History, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, history, COMPLETIONS_MEAN_LENGTH, "mean length", color="C0")
    s_min, lo = history.series(COMPLETIONS_MIN_LENGTH)
    s_max, hi = history.series(COMPLETIONS_MAX_LENGTH)
    if len(s_min) and np.array_equal(s_min, s_max):
        ok = np.isfinite(lo) & np.isfinite(hi)
        ax.fill_between(s_min[ok], lo[ok], hi[ok], color="C0", alpha=0.15, label="min-max")
    if history.has(EVAL_MEAN_LENGTH):
        _line(ax, history, EVAL_MEAN_LENGTH, "eval mean length", linestyle="none", marker="o", color="C2")
    twin = _twin(ax, history, [(COMPLETIONS_CLIPPED_RATIO, "clipped ratio")], "fraction cut at max length")
    _finish(ax, history, "Completion length", "completion length (tokens)", twin)


def _draw_vllm(history: History, fig: Figure) -> None:
    from steadyrl.evidence.doctor import LOGP_GAP, DoctorConfig

    ax = fig.add_subplot()
    ax.set_yscale("log")
    _line(ax, history, LOGP_GAP, "mean over tokens", positive=True)
    _line(ax, history, SAMPLING_LOGP_GAP_MAX, "max over tokens", positive=True, alpha=0.5)
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

    def available(self, history: History) -> bool:
        return any(history.matching(n) if n.endswith("/") else history.has(n) for n in self.needs)


PANELS = (
    Panel("reward", "Reward", (REWARD, REWARDS_PREFIX, EVAL_REWARD, EVAL_ACCURACY), _draw_reward),
    Panel("kl", "KL and KL coefficient", (KL, QUATRO_KL_MEAN, QUATRO_KL_COEF), _draw_kl),
    Panel("entropy", "Entropy and entropy floor", (ENTROPY, QUATRO_ENTROPY), _draw_entropy),
    Panel("grad_norm", "Gradient norm, skips, rollbacks", (GRAD_NORM,), _draw_grad_norm),
    Panel(
        "grade",
        "GRADE reward scaler",
        (GRADE_RAW_STD, GRADE_SCALED_STD, GRADE_CLIP_FRAC_HIGH),
        _draw_grade,
        (11.0, 4.5),
    ),
    Panel("filters", "QUATRO filters", (QUATRO_FILTERED_PREFIX,), _draw_filters),
    Panel("length", "Completion length", (COMPLETIONS_MEAN_LENGTH,), _draw_length),
    Panel("vllm", "vLLM-policy log-prob gap", (SAMPLING_LOGP_GAP,), _draw_vllm),
)


# ----------------------------------------------------------------------------------------------- markdown


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _summary_rows(history: History) -> list[str]:
    rows = ["| metric | first | last | min | max | best (step) | non-finite |", "|---|---|---|---|---|---|---|"]
    names = [n for n in SUMMARY if history.has(n)] + [
        n for n in history.matching(REWARDS_PREFIX) if n.endswith("/mean")
    ]
    for name in names:
        steps, values = history.series(name)
        finite = np.isfinite(values)
        if not finite.any():
            rows.append(f"| {name} | — | {_fmt(values[-1])} | — | — | — | {len(values)} |")
            continue
        fs, fv = steps[finite], values[finite]
        best = "—"
        if name in MAXIMISE or name.startswith(REWARDS_PREFIX):
            i = int(np.argmax(fv))
            best = f"{_fmt(fv[i])} ({fs[i]})"
        rows.append(
            f"| {name} | {_fmt(values[0])} | {_fmt(values[-1])} | {_fmt(fv.min())} | {_fmt(fv.max())} | {best} "
            f"| {int((~finite).sum())} |"
        )
    return rows


def _steps_text(steps: np.ndarray, limit: int = 10) -> str:
    shown = ", ".join(map(str, steps[:limit].tolist()))
    return f" (steps {shown}{', ...' if len(steps) > limit else ''})" if len(steps) else ""


def _markdown(run_dir: Path, history: History, drawn: dict[str, str | None]) -> str:
    steps = history.steps
    skipped, rollbacks = history.skipped_steps, history.rollback_steps
    n_skipped = history.count(GEPO_SKIPPED_STEPS, EVENT_SKIP)
    n_rollbacks = history.count(OPEFO_ROLLBACKS, EVENT_ROLLBACK)
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
        "## Diagnosis (`steadyrl doctor`)",
        "",
        "```text",
        format_findings(diagnose(history, doctor_config_for(run_dir)), history).rstrip(),
        "```",
    ]
    for panel in PANELS:
        lines += ["", f"## {panel.title}", ""]
        image = drawn[panel.name]
        if image:
            lines.append(f"![{panel.title}]({image})")
        else:
            wanted = " or ".join(f"`{n}*`" if n.endswith("/") else f"`{n}`" for n in panel.needs)
            lines.append(f"_Skipped: none of {wanted} was logged._")
    return "\n".join(lines) + "\n"


def write_report(run_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Plot a run's logs into ``out_dir`` (default ``RUN_DIR/report``); returns the path of ``report.md``.

    Raises HistoryNotFoundError when the run folder has no logs.
    """
    run_dir = Path(run_dir)
    history = load_history(run_dir)
    out = Path(out_dir) if out_dir is not None else (run_dir if run_dir.is_dir() else run_dir.parent) / "report"
    out.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, str | None] = {}
    for panel in PANELS:
        path = out / f"{panel.name}.png"
        if not panel.available(history):
            path.unlink(missing_ok=True)  # a stale plot from an earlier report would contradict the note
            drawn[panel.name] = None
            continue
        fig = Figure(figsize=panel.size, layout="constrained")
        FigureCanvasAgg(fig)
        panel.draw(history, fig)
        fig.savefig(path, dpi=100)
        drawn[panel.name] = path.name
    report = out / "report.md"
    report.write_text(_markdown(run_dir, history, drawn), encoding="utf-8")
    return report
