"""The precision/recall bench's run plan: late fault runs resume from one healthy run's checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_precision as B


def plan(**overrides: object) -> list:
    args = argparse.Namespace(
        seeds=[0, 1], plain_fault_seeds=1, settings=["smollm2"], faults=["nan_loss", "nan_micro_batch"],
        fault_steps=None, only="faults", variants=["plain", "all"], steps=None, out="/tmp/pr", threads=2,
        resume_lead=5, sft=None,
    )  # fmt: skip
    vars(args).update(overrides)
    return B.jobs_and_summaries(args)[0]


def test_late_faults_resume_from_a_base_checkpoint_saved_lead_steps_before() -> None:
    jobs = plan()
    bases = [j for j in jobs if j.scenario == B.BASE]
    assert [(j.variant, j.seed) for j in bases] == [("plain", 0), ("all", 0), ("all", 1)]
    assert jobs[: len(bases)] == bases  # trained before any run that resumes from them
    base = " ".join(bases[1].cmd)
    assert "trainer.max_steps=60" in base and "trainer.save_steps=30" in base and "save_total_limit=null" in base
    by_key = {(j.scenario, j.variant, j.seed): " ".join(j.cmd) for j in jobs}
    late = by_key["fault-nan_loss-65", "all", 1]
    assert "trainer.resume_from_checkpoint=/tmp/pr/base/all-s1/checkpoint-60" in late
    assert "trainer.max_steps=80" in late
    assert "checkpoint-30" in by_key["fault-nan_loss-35", "plain", 0]
    early = by_key["fault-nan_loss-3", "all", 0]  # inside the lead: trained from step 0
    assert "trainer.resume_from_checkpoint=/" not in early and "trainer.max_steps=18" in early


def test_smollm2_micro_batch_fault_keeps_the_configs_completions_per_step() -> None:
    cmd = " ".join(next(j for j in plan() if j.scenario == "fault-nan_micro_batch-3").cmd)
    assert "per_device_train_batch_size=4" in cmd and "gradient_accumulation_steps=4" in cmd  # 16 = the config's


def test_without_a_lead_every_fault_run_starts_at_step_0() -> None:
    jobs = plan(resume_lead=0)
    assert not [j for j in jobs if j.scenario == B.BASE]
    assert not [j for j in jobs if any("checkpoint-" in a for a in j.cmd)]


def test_the_table_of_a_merged_file_counts_every_cell_per_model() -> None:
    fault = {"caught": [True, False], "steps_to_action": [0, 7], "interventions": [{}, {}]}
    cells = [
        {"scenario": "fault-nan_loss-3", "variant": "all", "seeds": [0, 1], "died": [False, True],
         "accuracy": [0.5, None], "metrics": fault, "model": "small"},
        {"scenario": "fault-nan_loss-3", "variant": "plain", "seeds": [0], "died": [True], "accuracy": [None],
         "metrics": {k: v[:1] for k, v in fault.items()}, "model": "small"},
        {"scenario": "fault-nan_loss-5", "variant": "all", "seeds": [0], "died": [False], "accuracy": [0.7],
         "metrics": {k: v[:1] for k, v in fault.items()}, "model": "tiny"},
    ]  # fmt: skip
    rows = [line for line in B.tables(B.results_from_cells(cells)).splitlines() if line.startswith("| fault-")]
    assert rows == [
        "| fault-nan_loss-3 | small | 1/2 | 7 | 1/2 | 1/1 |",
        "| fault-nan_loss-5 | tiny | 1/1 | 0 | 0/1 | 0/0 |",
    ]


def test_the_healthy_table_counts_interventions_per_100_steps_and_the_runs_with_any_per_layer() -> None:
    healthy = {
        "skipped_steps": [0, 1],
        "rollbacks": [0, 0],
        "repairs": [0, 0],
        "intervention_share_max": [0.0, 0.03],
        "filtered_row_share": [0.0, 0.002],
        "own_controller_warning": [False, False],
        "steps": [50, 50],
        "interventions": [{}, {"filtered_rows": 2, "skipped_step": 1}],
        "eval": [{}, {}],
    }
    cells = [{"scenario": "healthy-x", "variant": "all", "seeds": [0, 1], "died": [False, False],
              "accuracy": [0.5, 0.6], "metrics": healthy}]  # fmt: skip
    row = next(line for line in B.tables(B.results_from_cells(cells)).splitlines() if line.startswith("| healthy-x |"))
    # 1 skip in 100 steps (GEPO, one run), 2 filtered rows (QUATRO, one run); no plain run to pair with
    assert row == (
        "| healthy-x | 1/2 | 3.00 % | GEPO 1.00 (1/2), OPEFO 0.00 (0/2), QUATRO 2.00 (1/2), GRADE 0.00 (0/2) | "
        "0.20 % max | 0/2 | - |"
    )


def test_a_reward_burst_fired_where_its_window_logged_a_nonfinite_reward_or_a_masked_one() -> None:
    """The burst writes no faults.jsonl: plain TRL's NaN reward (null in metrics.jsonl) or steadyrl's count of
    masked rewards inside the burst's steps shows it fired; the same outside them, or finite rewards, do not."""
    from steadyrl.evidence.history import History

    def rows(*extra: dict) -> History:
        return History([{"step": s, "reward": 0.5} for s in range(1, 12)] + list(extra))

    assert B.burst_fired(History([{"step": 3, "reward": None}]), 3)  # plain TRL: NaN at the burst's first step
    assert B.burst_fired(rows({"step": 3 + B.BURST_STEPS - 1, "reward": "nan"}), 3)
    assert B.burst_fired(rows({"step": 4, "reward": 0.5, "gepo/nonfinite_rewards": 2.0}), 3)  # steadyrl masked them
    assert not B.burst_fired(rows(), 3)
    assert not B.burst_fired(rows({"step": 3 + B.BURST_STEPS, "reward": None}, {"step": 2, "reward": None}), 3)
    assert not B.burst_fired(rows({"step": 4, "gepo/nonfinite_rewards": 0.0}), 3)
    jobs = plan(faults=["nonfinite_rewards"], variants=["all"], seeds=[1])
    assert f"steps: {B.BURST_STEPS}, seed: 1" in " ".join(jobs[-1].cmd)
