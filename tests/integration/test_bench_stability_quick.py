"""scripts/bench_stability.py --quick end to end on a tiny random model: only what must always hold.

All guards on never ends with non-finite weights when a NaN loss or an inf Adam moment is injected; plain TRL in
the NaN-loss scenario dies or ends with NaN weights (TRL applies the NaN step, then fails sampling from NaN
logits). Guards off == trl.GRPOTrainer is tests/integration/test_equivalence.py's job, not repeated here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from steadyrl.evidence.history import load_history

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
FAULT_STEP = 3  # --quick: faults at step 3 of 6


def test_bench_stability_quick(tiny_model_dir, tmp_path):
    runs, md, png = tmp_path / "runs", tmp_path / "stability.md", tmp_path / "stability.png"
    cmd = [sys.executable, "scripts/bench_stability.py", "--sft", str(tiny_model_dir), "--quick", "--out", str(runs)]
    proc = subprocess.run(
        [*cmd, "--out-md", str(md), "--png", str(png)], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {tuple(key.split("|")): run for key, run in json.loads((runs / "results.json").read_text()).items()}
    variants, scenarios = ("plain TRL", "GEPO", "all on"), ("nan_loss", "inf_exp_avg_sq")
    assert set(results) == {*((v, "nan_loss", "0") for v in variants), ("all on", "inf_exp_avg_sq", "0")}

    for scenario in scenarios:  # the fault really happened, and all-on came through it with finite weights
        guarded = results[("all on", scenario, "0")]
        assert guarded["status"] == "ok" and guarded["fault_fired_at"] == FAULT_STEP, (scenario, guarded)
    plain = results[("plain TRL", "nan_loss", "0")]
    assert plain["fault_fired_at"] == FAULT_STEP and plain["status"] in ("died", "nonfinite_weights")

    # the NaN hit one micro-batch only: one non-finite loss, at the fault step (GEPO alone; with all on, QUATRO's
    # zero-variance filter masks every row of this random model, so TRL's masked loss reads 0 while the gradient
    # is still NaN) ...
    steps, nonfinite = load_history(runs / "gepo-nan_loss-s0").series("gepo/nonfinite_loss")
    assert steps.tolist() == [1, 2, 3, 4, 5, 6]
    assert nonfinite.tolist() == [float(s == FAULT_STEP) for s in range(1, 7)]
    # ... and exactly that step was skipped, with every layer on too
    for variant in ("GEPO", "all on"):
        name = variant.replace(" ", "_").lower()
        steps, skipped = load_history(runs / f"{name}-nan_loss-s0").series("gepo/skipped_steps")
        assert skipped.tolist() == [float(s >= FAULT_STEP) for s in range(1, 7)], variant
        assert results[(variant, "nan_loss", "0")]["skipped"] == 1
    # OPEFO found the inf moment (one entry) and repaired it in place: no rollback, a finite Adam state at the end
    inf_run = results[("all on", "inf_exp_avg_sq", "0")]
    assert inf_run["repairs"] == 1 and inf_run["rollbacks"] == 0 and inf_run["nonfinite_state_at_end"] == 0

    text = md.read_text()
    assert text.startswith("```\npython scripts/bench_stability.py ")
    outcomes, controllers = text.split("Controller state at the end of each run")
    assert sum(line.startswith(("| nan_loss |", "| inf_exp_avg_sq |")) for line in outcomes.splitlines()) == 4
    # the controller table: the runs with a spike guard or QUATRO (GEPO and all on under nan_loss, all on under inf)
    rows = [line for line in controllers.splitlines() if line.startswith(("| nan_loss |", "| inf_exp_avg_sq |"))]
    assert sorted(row.split(" | ")[1] for row in rows) == ["GEPO", "all on", "all on"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
