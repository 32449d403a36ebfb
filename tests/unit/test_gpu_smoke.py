"""scripts/gpu_smoke.py: the checks that decide a GPU stage passed, on hand-written run folders (no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_smoke.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, losses: dict[int, object], skips: tuple[int, ...] = (), fired: bool = True,
         end_bad: int | None = None, runtime: float = 5.0) -> None:  # fmt: skip
    """A run folder as steadyrl writes it: metrics.jsonl rows (and skip events), faults.jsonl, the final row."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for step, loss in losses.items():
        rows.append(
            {"step": step, "loss": loss, "grad_norm": loss, "gepo/skipped_steps": sum(s <= step for s in skips)}
        )
        if step in skips:
            rows.append({"step": step, "event": "skip", "reason": "nonfinite"})
    rows.append({"step": max(losses), "train_runtime": runtime})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    faults = [{"fault": "nan_loss", "step": 3, "rank": 0}] if fired else []
    if end_bad is not None:
        faults.append({"fault": "train_end", "step": max(losses), "rank": 0, "nonfinite_state_entries": end_bad})
    (folder / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in faults))


def _stage(g, **kw):
    base = dict(name="s", group="tiny", variant="all", config="c.yaml", overrides=[], steps=10)
    return g.Stage(**{**base, **kw})


NAN = {"STEADYRL_FAULT_STEP": "3"}
INF = {"STEADYRL_FAULT_STEP": "3", "STEADYRL_FAULT_VALUE": "inf"}


def test_a_guarded_nan_run_passes_only_if_the_nan_step_was_skipped_and_every_other_step_is_finite(tmp_path):
    g = _script()
    stage = _stage(g, env=NAN)
    clean = {s: 0.1 * s for s in range(1, 11)}
    _run(tmp_path / "s", {**clean, 3: "nan"}, skips=(3,))
    row = g.inspect(stage, tmp_path, 0, 12.0)
    assert row["failures"] == [] and row["skipped_steps"] == 1 and row["last_step"] == 10
    assert row["s_per_step"] == 0.5 and row["fault_fired"] is True

    _run(tmp_path / "s", {**clean, 3: "nan", 5: "nan"}, skips=(3,))  # a later step's loss is NaN too: weights hurt
    assert g.inspect(stage, tmp_path, 0, 1.0)["failures"] == [
        "a logged loss or grad_norm is not finite (or nothing was logged)"
    ]
    _run(tmp_path / "s", {**clean, 3: "nan"})  # the NaN step went through (no skip)
    assert (
        "the NaN step was not skipped (gepo/skipped_steps stayed 0)" in g.inspect(stage, tmp_path, 0, 1.0)["failures"]
    )
    _run(tmp_path / "s", clean, fired=False)
    assert g.inspect(stage, tmp_path, 0, 1.0)["failures"] == [
        "the fault never fired",
        "the NaN step was not skipped (gepo/skipped_steps stayed 0)",
    ]
    _run(tmp_path / "s", {s: clean[s] for s in range(1, 8)})
    assert g.inspect(_stage(g), tmp_path, 1, 1.0)["failures"] == ["exit status 1", "reached step 7 of 10"]


def test_an_inf_moment_left_in_adam_fails_a_guarded_run_and_counts_as_hurt_for_plain_trl(tmp_path):
    g = _script()
    _run(tmp_path / "s", {s: 0.1 for s in range(1, 11)}, end_bad=1)
    guarded = g.inspect(_stage(g, env=INF), tmp_path, 0, 1.0)
    assert guarded["failures"] == ["1 non-finite optimizer-state entries left at the end"]
    plain = g.inspect(_stage(g, env=INF, variant="plain", expect="plain-fault"), tmp_path, 0, 1.0)
    assert plain["failures"] == [] and "note" not in plain  # the fault hurt plain TRL: what the stage shows
    _run(tmp_path / "s", {s: 0.1 for s in range(1, 11)}, end_bad=0)
    plain = g.inspect(_stage(g, env=INF, variant="plain", expect="plain-fault"), tmp_path, 0, 1.0)
    assert plain["failures"] == [] and plain["note"].startswith("plain TRL finished with a finite state")
    assert g.inspect(_stage(g, env=INF), tmp_path, 0, 1.0)["failures"] == []


def test_a_resume_that_restarted_from_step_0_fails(tmp_path):
    g = _script()
    stage = _stage(g, steps=14, after="first")
    _run(tmp_path / "s", {s: 0.1 for s in range(1, 15)})
    assert g.inspect(stage, tmp_path, 0, 1.0)["failures"] == []
    with open(tmp_path / "s" / "metrics.jsonl", "a") as f:  # the same run again from step 1: not a resume
        f.writelines(json.dumps({"step": s, "loss": 0.1, "grad_norm": 0.1}) + "\n" for s in range(1, 15))
    row = g.inspect(stage, tmp_path, 0, 1.0)
    assert row["step_1_logged"] == 2
    assert row["failures"] == ["step 1 logged 2 times: the resume did not start from the checkpoint"]


def test_ratios_are_every_layer_on_over_plain_per_stage():
    g = _script()
    cell = lambda scenario, variant, mem, sps: {  # noqa: E731
        "scenario": scenario, "variant": variant, "metrics": {"peak_allocated_gib": [mem], "s_per_step": [sps]}
    }  # fmt: skip
    cells = [cell("a", "plain", 2.0, 4.0), cell("a", "all", 2.5, 5.0), cell("b", "all", 1.0, 1.0)]
    assert g._ratios(cells) == [{"scenario": "a", "peak_allocated_ratio": 1.25, "step_time_ratio": 1.25}]


def test_a_stage_the_deadline_stopped_is_not_run_not_passed():
    """The H200 run of 7cd9895 wrote passed: true for the four stages its deadline kept from starting."""
    g = _script()
    not_run = g._cell(_stage(g), {"returncode": None, "died": False, "failures": [], "ran": False, "note": "x"})
    ran = g._cell(_stage(g), {"returncode": 0, "died": False, "failures": []})
    failed = g._cell(_stage(g), {"returncode": 1, "died": True, "failures": ["exit status 1"]})
    assert (not_run["passed"], ran["passed"], failed["passed"]) == (None, True, False)
    assert "ran" not in not_run["metrics"]
    assert g.summary([ran, failed, not_run]) == "1 passed, 1 failed, 1 not run"
    assert g.summary([ran, ran]) == "2 passed, 0 failed"


def test_cpu_mode_drops_half_precision_and_launches_zero2_over_gloo(tmp_path):
    g = _script()
    stage = next(s for s in g.tiny_stages(tmp_path / "m") if s.name == "fp16-zero2-nan")
    gpu = g.command(stage, tmp_path, 29601, cpu=False)
    cpu = g.command(stage, tmp_path, 29601, cpu=True)
    assert "trainer.fp16=true" in gpu and "trainer.fp16=true" not in cpu and "trainer.ddp_backend=gloo" in cpu
    assert gpu[gpu.index("--main_process_port") + 1] == "29601" and gpu[gpu.index("--num_processes") + 1] == "1"
    assert f"trainer.output_dir={tmp_path / 'fp16-zero2-nan'}" in gpu


@pytest.mark.parametrize("only", ["plain", "all"])
def test_every_fault_stage_has_both_variants_or_says_why(tmp_path, only):
    g = _script()
    stages = g.tiny_stages(tmp_path)
    first = [s for s in stages if s.after is None]
    assert len({s.output_name or s.name for s in first}) == len(first)  # run side by side: one folder each
    assert all(any((f.output_name or f.name) == s.output_dir(tmp_path).name for f in first) for s in stages if s.after)
    faults = {s.name for s in stages if s.env and s.variant == only}
    assert {"bf16-zero2-nan", "bf16-zero2-inf"} <= faults
