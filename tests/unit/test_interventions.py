"""The interventions ledger: per-step flags from the metrics a step logged, by hand; the run summary from the live
counts and from metrics.jsonl agree; observe mode counts under ``would``; the doctor prints the table."""

from __future__ import annotations

import json

import pytest

from steadyrl import metrics as M
from steadyrl.evidence.history import History
from steadyrl.evidence.interventions import Ledger, format_table, from_history, load_summary, summary_from_counts


def _steps(ledger: Ledger, steps: list[dict[str, list[float]]]) -> list[dict[str, float]]:
    out = []
    for seen in steps:
        for name, values in seen.items():
            for v in values:
                ledger.see(name, v)
        out.append(ledger.close())
    return out


HEALTHY = {
    M.GEPO_SKIPPED_STEPS: [0.0],
    M.QUATRO_BETA: [0.04],
    M.QUATRO_PG_SCALE: [1.0, 1.0],
    M.QUATRO_ENTROPY_BONUS: [0.0],
    M.quatro_filtered("length"): [0.0],
    M.quatro_filtered("zero_variance"): [40.0],
    M.QUATRO_ROWS: [64.0],
    M.GRADE_CLIP_FRAC_LOW: [0.0],
    M.GRADE_CLIP_FRAC_HIGH: [0.0],
}


def test_flags_by_hand():
    counters: dict[str, float] = {}
    ledger = Ledger(counters, beta0=0.04)
    steps = [
        HEALTHY,
        {**HEALTHY, M.GEPO_SKIPPED_STEPS: [1.0], M.QUATRO_BETA: [0.0481]},  # a skip; beta 1.2025x: moved
        {**HEALTHY, M.GEPO_SKIPPED_STEPS: [1.0], M.QUATRO_BETA: [0.0479]},  # counter flat; 1.1975x: within 20 %
        {**HEALTHY, M.QUATRO_PG_SCALE: [1.0, 0.97], M.quatro_filtered("length"): [2.0]},  # brake, 2 rows dropped
        {**HEALTHY, M.GRADE_CLIP_FRAC_HIGH: [0.05], M.QUATRO_ENTROPY_BONUS: [1e-4]},
    ]
    flags = _steps(ledger, steps)
    fired = [{k.removeprefix(M.LEDGER_PREFIX) for k, v in f.items() if v} for f in flags]
    assert fired == [set(), {"skipped_step", "beta_moved"}, set(), {"brake", "filtered_rows"},
                     {"reward_clip", "entropy_bonus"}]  # fmt: skip
    # only the kinds whose metrics this run logs get a flag (no OPEFO here)
    assert set(flags[0]) == {M.ledger(k) for k in ("skipped_step", "beta_moved", "brake", "entropy_bonus",
                                                    "filtered_rows", "reward_clip")}  # fmt: skip
    doc = ledger.summary()
    assert doc["steps"] == 5 and doc["kinds"]["skipped_step"] == {"layer": "gepo", "steps": 1, "share": 0.2}
    assert doc["layers"] == {"gepo": 0.2, "quatro": 0.2, "grade": 0.2}
    assert doc["filtered_rows"] == {"rows": 320, "dropped": 2, "share": 2 / 320}  # zero-variance rows not counted
    assert doc["intervention_share_max"] == 0.2


def test_counts_survive_a_restart_through_the_counters():
    """The counts and each counter's last value live in the checkpointed counters: a restarted ledger neither
    loses them nor reads the restored cumulative counter as a new skip."""
    counters: dict[str, float] = {}
    _steps(Ledger(counters, 0.04), [{**HEALTHY, M.GEPO_SKIPPED_STEPS: [2.0]}])
    restored = dict(counters)
    again = Ledger(restored, 0.04)
    flags = _steps(again, [{**HEALTHY, M.GEPO_SKIPPED_STEPS: [2.0]}, {**HEALTHY, M.GEPO_SKIPPED_STEPS: [3.0]}])
    assert [f[M.ledger("skipped_step")] for f in flags] == [0.0, 1.0]
    assert again.summary()["kinds"]["skipped_step"]["steps"] == 2 and again.summary()["steps"] == 3


def test_observe_mode_counts_would_kinds_from_the_would_names():
    ledger = Ledger({}, 0.04, observe=frozenset({"gepo", "quatro"}))
    steps = [
        {M.GEPO_WOULD_SKIP: [0.0], M.QUATRO_KL_COEF_WOULD: [0.04], M.GRADE_CLIP_FRAC_LOW: [0.0]},
        {M.GEPO_WOULD_SKIP: [1.0], M.QUATRO_KL_COEF_WOULD: [0.1], M.GRADE_CLIP_FRAC_LOW: [0.1]},
    ]
    flags = _steps(ledger, steps)
    assert flags[1] == {
        M.ledger_would("skipped_step"): 1.0,
        M.ledger_would("beta_moved"): 1.0,
        M.ledger("reward_clip"): 1.0,
    }  # fmt: skip  (GRADE acts: counted as acted)
    doc = ledger.summary()
    assert doc["would"]["skipped_step"]["steps"] == 1 and "skipped_step" not in doc["kinds"]


def test_a_robust_advantage_group_is_an_intervention_and_observe_mode_counts_it_as_would():
    steps = [{M.GEPO_ROBUST_GROUPS: [0.0]}, {M.GEPO_ROBUST_GROUPS: [2.0]}, {M.GEPO_ROBUST_GROUPS: [0.0]}]
    flags = _steps(Ledger({}, 0.04), steps)
    assert [f[M.ledger("robust_advantage")] for f in flags] == [0.0, 1.0, 0.0]
    would = _steps(Ledger({}, 0.04, observe=frozenset({"gepo"})), [{M.GEPO_WOULD_ROBUST_GROUPS: [1.0]}])
    assert would == [{M.ledger_would("robust_advantage"): 1.0}]


def test_no_beta_kind_without_a_kl_term():
    flags = _steps(Ledger({}, 0.0), [{M.QUATRO_BETA: [0.0]}])
    assert flags == [{M.ledger("beta_moved"): 0.0}]


def test_the_summary_rebuilt_from_logged_rows_matches_the_live_one():
    counters: dict[str, float] = {}
    ledger = Ledger(counters, 0.04)
    pattern = [HEALTHY] * 3 + [{**HEALTHY, M.QUATRO_PG_SCALE: [0.5]}] + [HEALTHY] * 6
    flags = _steps(ledger, pattern * 2)  # 20 steps, brake on steps 4 and 14
    rows = []
    for start in (0, 10):  # logging_steps=10: each row holds the window's means, as TRL averages them
        window = flags[start : start + 10]
        row = {"step": start + 10, M.QUATRO_ROWS: 64.0, M.quatro_filtered("length"): 0.0}
        row.update({k: sum(f[k] for f in window) / 10 for k in window[0]})
        rows.append(row)
    rebuilt = from_history(History(rows))
    live = ledger.summary()
    assert rebuilt["kinds"] == live["kinds"] and rebuilt["steps"] == live["steps"] == 20
    assert rebuilt["kinds"]["brake"] == {"layer": "quatro", "steps": 2, "share": 0.1}


def test_load_summary_prefers_the_written_file(tmp_path):
    doc = summary_from_counts({"ledger/steps": 10.0, "ledger/rollback": 1.0})
    (tmp_path / "interventions.json").write_text(json.dumps(doc))
    assert load_summary(tmp_path) == doc
    assert load_summary(tmp_path / "none") is None
    assert "opefo  rollback" in format_table(doc) and "10.00 %" in format_table(doc)
    assert "none: no layer changed this run" in format_table(summary_from_counts({"ledger/steps": 5.0}))


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_values_never_fire(value):
    flags = _steps(Ledger({}, 0.04), [{M.QUATRO_PG_SCALE: [value], M.GRADE_CLIP_FRAC_LOW: [value]}])
    assert not any(flags[0].values())
