"""Every metric name the readers (doctor, report, monitor) use is declared in ``steadyrl.metrics``, and no module
spells a namespaced metric name as a string literal (so renaming one cannot silently blind a reader)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import steadyrl
from steadyrl import metrics
from steadyrl.callbacks.monitor import SUMMARY_KEYS
from steadyrl.evidence import doctor

PACKAGE = Path(steadyrl.__file__).parent
NAMESPACED = re.compile(r"^(gepo|grade|quatro|opefo|ppo|eval|steadyrl|completions|sampling|rewards)/")


def _reader_names() -> list[str]:
    from steadyrl.evidence import observe, report

    needs = [name for panel in report.PANELS for name in panel.needs]
    return [
        *doctor.CHECKED,
        *doctor.NONFINITE_COUNTERS,
        *observe.READS,
        *observe.READ_PREFIXES,
        *report.SUMMARY,
        *report.MAXIMISE,
        *needs,
        *SUMMARY_KEYS,
    ]


def test_every_name_the_readers_use_is_declared() -> None:
    missing = sorted({n for n in _reader_names() if not (metrics.is_declared(n) or n in metrics.PREFIXES)})
    assert missing == []


def test_registry_holds_the_names_and_the_templates() -> None:
    assert metrics.GEPO_SKIPPED_STEPS in metrics.NAMES
    assert metrics.gepo_skipped("spike") == "gepo/skipped_spike"
    assert metrics.is_declared(metrics.quatro_filtered("repetition"))
    assert metrics.is_declared(metrics.opefo_floor_value(1))
    assert metrics.is_declared(metrics.eval_reward("exact_match"))
    assert not metrics.is_declared("gepo/no_such_metric")
    assert not metrics.is_declared(metrics.QUATRO_FILTERED_PREFIX)  # a prefix alone names nothing
    assert metrics.EVENTS == {
        "skip", "micro_batch_drop", "rollback", "state_repair", "gold_rollback", "entropy_floor_warning",
        "filter_warning",
    }  # fmt: skip


def _literals(path: Path) -> list[tuple[int, str]]:
    """String constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if p.name != "metrics.py"),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_no_metric_name_is_spelled_out(path: Path) -> None:
    found = [(line, text) for line, text in _literals(path) if NAMESPACED.match(text) and " " not in text]
    assert found == [], f"use the constants of steadyrl.metrics instead of {found}"
