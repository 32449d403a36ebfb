"""scripts/bench_mismatch.py: what one vLLM run's metrics say (late medians, would-be gate skips, the doctor)."""

from __future__ import annotations

from pathlib import Path

from steadyrl.evidence.history import History
from steadyrl.experiments import Job, Outcome
from tests.unit.test_bench_hacking import _script


def test_a_stale_run_is_summarised_by_hand(tmp_path: Path):
    bench = _script("bench_mismatch")
    ess = [1.0, 1.0, 0.995, 0.98, 0.95, 0.97, 0.96, 0.94]  # the sync stops after step 2
    rows = [
        {"step": s, "reward": 0.5, "mismatch/ess": e, "mismatch/kl": (1 - e) / 10,
         "sampling/sampling_logp_difference/mean": 0.0005 if s <= 2 else 0.05}
        for s, e in enumerate(ess, start=1)
    ]  # fmt: skip
    job = Job("all", "stale", 0, tmp_path, ())
    out = bench.summarise(job, Outcome("ok", 0, 10.0, history=History(rows), last_step=8), stale_after=2)
    assert out["ess_median_late"] == 0.965  # steps 3-8 sorted: 0.94 0.95 0.96 0.97 0.98 0.995
    assert out["ess_min"] == 0.94 and out["gap_median_late"] == 0.05
    assert [out[f"gate_{g:g}_would_skip"] for g in bench.GATES] == [0, 0, 5, 6]  # ess_min 0.5, 0.9, 0.99, 0.999
    assert out["off_policy_found"] and any("effective sample size" in d for d in out["doctor"])
    healthy = [{**r, "mismatch/ess": 0.999999, "mismatch/kl": 1e-7} for r in rows[:2]] * 4
    for step, row in enumerate(healthy, start=1):
        row["step"], row["sampling/sampling_logp_difference/mean"] = step, 0.0005
    out = bench.summarise(job, Outcome("ok", 0, 10.0, history=History(healthy), last_step=8), stale_after=2)
    assert out["doctor"] == [] and [out[f"gate_{g:g}_would_skip"] for g in bench.GATES] == [0, 0, 0, 0]
