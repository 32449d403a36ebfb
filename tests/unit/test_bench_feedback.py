"""The error-feedback bench's run plan and table: three arms per seed resume from one healthy base checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_feedback as B


def plan() -> list:
    args = argparse.Namespace(
        model="small", sft=None, seeds=[0, 1], steps=[35, 65], lead=5, after=15, out="/tmp/fb", threads=2
    )
    return B.jobs(args)[0]


def test_three_arms_per_seed_and_step_resume_from_the_base_checkpoint_lead_steps_before() -> None:
    jobs = plan()
    assert [(j.scenario, j.seed) for j in jobs if j.scenario == "base"] == [("base", 0), ("base", 1)]
    base = " ".join(jobs[0].cmd)
    assert "trainer.max_steps=60" in base and "trainer.save_steps=30" in base and "max_grad_norm" not in base
    arms = {(j.scenario, j.variant, j.seed): j for j in jobs if j.scenario != "base"}
    assert len(arms) == 2 * 2 * 3
    for (scenario, variant, seed), job in arms.items():
        cmd, env = " ".join(job.cmd), dict(job.env)
        step = int(scenario.rsplit("-", 1)[1])
        assert f"resume_from_checkpoint=/tmp/fb/base/all-s{seed}/checkpoint-{step - 5}" in cmd
        assert f"trainer.max_steps={step + 15}" in cmd and "trainer.max_grad_norm=1e9" in cmd
        assert env["STEADYRL_FAULT_STEP"] == str(step)
        assert env["STEADYRL_FAULT_SCALE"] == ("1" if scenario.startswith("control") else "1e4")
        assert (B.NO_FEEDBACK in job.cmd) == (variant == "all-minus-feedback")


def run(acc: float, concise: float, feedback: int = 0) -> dict:
    return {"accuracy": acc, "eval": {"eval/math_answer": acc, "eval/concise_answer": concise},
            "skipped_steps": int(feedback > 0), "feedback_steps": feedback}  # fmt: skip


def test_the_table_pairs_each_arm_with_its_seeds_control() -> None:
    results = {
        ("all", "control-65", 0): run(0.8, 1.0), ("all", "control-65", 1): run(0.6, 1.0),
        ("all", "grad_spike-65", 0): run(0.5, 0.9, 4), ("all", "grad_spike-65", 1): run(0.7, 1.0, 4),
        ("all-minus-feedback", "grad_spike-65", 0): run(0.8, 1.0, 0),
    }  # fmt: skip
    rows = B.table(results, [65]).splitlines()[2:]
    assert rows[0] == "| 65 | no spike | 0.700; 0.800, 0.600 | (control) | (control) | 0/0 | 0/0 |"
    assert rows[1] == (
        "| 65 | all | 0.600; 0.500, 0.700 | -10.0; -30.0 | eval/concise_answer -5.0, eval/math_answer -10.0 "
        "| 1/1 | 4/4 |"
    )
    assert rows[2].startswith("| 65 | all-minus-feedback | 0.800; 0.800 | +0.0; +0.0 |")
