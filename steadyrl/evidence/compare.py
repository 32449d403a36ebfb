"""``steadyrl compare RUN_A RUN_B ...``: several runs' logs overlaid, one PNG per metric, and a table of final values.

Each run is a ``trainer.output_dir``, labelled by its folder name. A metric is drawn when any run logged it
(non-finite values as red crosses along the top). Output: ``<metric>.png`` per drawn metric and ``compare.md``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from steadyrl import metrics as M
from steadyrl.evidence.history import History, load_history

METRICS = (
    (M.EVAL_ACCURACY, "Eval accuracy (greedy, held out)"),
    (M.REWARD, "Training reward"),
    (M.KL, "KL to the reference"),
    (M.ENTROPY, "Entropy"),
    (M.GRAD_NORM, "Gradient norm (pre-clip)"),
    (M.COMPLETIONS_MEAN_LENGTH, "Completion length"),
    (M.GEPO_ADV_STD, "GEPO advantage std"),
    (M.QUATRO_KL_COEF, "QUATRO KL coefficient"),
    (M.QUATRO_FILTERED_SHARE, "QUATRO filtered share"),
    (M.GRADE_SCALED_STD, "GRADE scaled reward std"),
)


def _file_name(metric: str) -> str:
    return metric.replace("/", "_") + ".png"


def _draw(metric: str, title: str, histories: dict[str, History], path: Path) -> None:
    fig = Figure(figsize=(8.0, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    crosses = False
    for i, (label, history) in enumerate(histories.items()):
        steps, values = history.series(metric)
        if not len(steps):
            continue
        finite = np.isfinite(values)
        ax.plot(steps[finite], values[finite], label=label, color=f"C{i}", marker="." if finite.sum() <= 50 else None)
        if len(bad := steps[~finite]):
            label = "_nolegend_" if crosses else "non-finite (NaN/inf)"
            ax.scatter(bad, np.full(len(bad), 0.97), marker="x", color="red", clip_on=False,
                       transform=ax.get_xaxis_transform(), label=label)  # fmt: skip
            crosses = True
    ax.set(title=title, xlabel="optimizer step", ylabel=metric)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _last(history: History, metric: str, best: bool = False) -> str:
    """The last value (the largest finite one when ``best``) formatted, or "—"."""
    values = history.series(metric)[1]
    values = values[np.isfinite(values)] if best else values
    return "—" if not len(values) else f"{float(values.max() if best else values[-1]):.4g}"


def summary_rows(histories: dict[str, History], metrics: list[str]) -> list[str]:
    head = ["run", "steps", "finished", "eval acc (last)", "eval acc (best)", "GEPO skips", "OPEFO rollbacks"]
    head += [f"{m} (last)" for m in metrics if m != M.EVAL_ACCURACY]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, h in histories.items():
        skips, rollbacks = h.count(M.GEPO_SKIPPED_STEPS, M.EVENT_SKIP), h.count(M.OPEFO_ROLLBACKS, M.EVENT_ROLLBACK)
        cells = [label, str(int(h.steps[-1])) if len(h.steps) else "0", "yes" if h.finished else "no",
                 _last(h, M.EVAL_ACCURACY), _last(h, M.EVAL_ACCURACY, best=True),
                 str(skips), str(rollbacks)]  # fmt: skip
        cells += [_last(h, m) for m in metrics if m != M.EVAL_ACCURACY]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def write_comparison(run_dirs: list[str | os.PathLike[str]], out_dir: str | os.PathLike[str] = "compare") -> Path:
    """Overlay the runs' metrics; returns the path of ``compare.md``. Raises HistoryNotFoundError for a run without
    logs (naming it), ValueError for fewer than two runs."""
    paths = [Path(p) for p in run_dirs]
    if len(paths) < 2:
        raise ValueError(f"compare needs at least two runs, got {len(paths)}")
    names = [p.resolve().name for p in paths]  # the folder's name, with its parent's where two runs share one
    labels = [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(paths, names, strict=True)]
    histories = {label: load_history(p) for label, p in zip(labels, paths, strict=True)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = []
    for metric, title in METRICS:
        if any(h.has(metric) for h in histories.values()):
            _draw(metric, title, histories, out / _file_name(metric))
            drawn.append(metric)
    lines = ["# steadyrl compare", "", "Runs: " + ", ".join(f"`{p}`" for p in paths), ""]
    lines += [*summary_rows(histories, drawn), ""]
    lines += [f"![{metric}]({_file_name(metric)})" for metric in drawn]
    report = out / "compare.md"
    report.write_text("\n".join(lines) + "\n")
    return report
