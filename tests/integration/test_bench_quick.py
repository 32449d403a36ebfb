"""scripts/bench_signal.py --quick runs end to end (the full matrix is too long for CI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_bench_signal_quick(tiny_model_dir, tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/bench_signal.py", "--sft", str(tiny_model_dir), "--quick", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| plain") or line.startswith("| GRADE")]
    assert len(rows) == 2 and all("| 0/1 |" in r for r in rows)  # both variants ran, none died
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["grad_norm_cv"] >= 0 for r in results.values())
