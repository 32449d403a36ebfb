"""steadyrl doctor on synthetic histories: each failure mode is named with its step range; noisy healthy runs pass."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from steadyrl.cli import main
from steadyrl.evidence import DoctorConfig, History, diagnose, format_findings

N = 200


def healthy_rows(seed: int = 0, n: int = N) -> list[dict[str, Any]]:
    """A run that learns: reward up with noise, entropy down 25%, KL settling, heavy-tailed grad norms, two GEPO
    skips, a NaN reward now and then, eval accuracy up every 20 steps, then the Trainer's final summary row."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for t in range(1, n + 1):
        rows.append(
            {
                "step": t,
                "loss": float(rng.normal(0, 0.05)),
                "grad_norm": float(np.exp(rng.normal(-0.5, 1.0))),
                "reward": float(0.2 + 0.4 * (1 - np.exp(-t / 80)) + rng.normal(0, 0.08)),
                "reward_std": float(abs(rng.normal(0.3, 0.05))),
                "entropy": float(1.0 - 0.25 * t / n + rng.normal(0, 0.1)),
                "kl": float(0.02 * (1 - np.exp(-t / 30)) + abs(rng.normal(0, 0.004))),
                "gepo/adv_std": float(0.9 + rng.normal(0, 0.06)),
                "gepo/skipped_steps": int(t >= 57) + int(t >= 131),
                "gepo/nonfinite_rewards": float(rng.poisson(0.3)),
                "completions/mean_length": float(50 + 5 * t / n + rng.normal(0, 4)),
                "completions/clipped_ratio": float(max(0.0, 0.05 + rng.normal(0, 0.03))),
            }
        )
        if t % 20 == 0:
            rows.append({"step": t, "eval/accuracy": float(0.2 + 0.3 * t / n + rng.normal(0, 0.03))})
    rows.append({"step": n, "train_runtime": 100.0, "train_loss": 0.01, "epoch": 1.0})
    return rows


def hard_crash_rows() -> list[dict[str, Any]]:
    """Healthy for 60 steps, a 1000x grad-norm jump at 61, NaN loss and grad norm at 63-65, then nothing."""
    rows = [r for r in healthy_rows(1) if r["step"] <= 62 and "train_runtime" not in r]
    for r in rows:
        if r["step"] == 61 and "grad_norm" in r:
            r["grad_norm"] = 1000.0 * float(np.median([x["grad_norm"] for x in rows[:60] if "grad_norm" in x]))
    for t in (63, 64, 65):
        rows.append({"step": t, "loss": float("nan"), "grad_norm": float("nan"), "reward": 0.4, "entropy": 0.9})
    return rows


def collapse_rows(seed: int = 2) -> list[dict[str, Any]]:
    """Entropy decays to 5% from step 50, KL climbs, reward stays flat, the repetition filter fires more and more."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(1, N + 1):
        decay = np.exp(-max(0, t - 50) / 30)
        rows.append(
            {
                "step": t,
                "loss": float(rng.normal(0, 0.05)),
                "grad_norm": float(np.exp(rng.normal(-0.5, 0.4))),
                "reward": float(0.3 + rng.normal(0, 0.05)),
                "entropy": float(0.05 + 0.95 * decay + rng.normal(0, 0.02)),
                "kl": float(0.01 + 0.2 * (1 - decay) + abs(rng.normal(0, 0.005))),
                "quatro/filtered/repetition": float(rng.poisson(0.2 + 8 * (1 - decay))),
                "completions/mean_length": float(40 + rng.normal(0, 3)),
            }
        )
    rows.append({"step": N, "train_runtime": 100.0, "train_loss": 0.01})
    return rows


def hacking_rows(seed: int = 3) -> list[dict[str, Any]]:
    """Reward climbs all run; eval accuracy peaks at step 80 and falls to 0.25; completions grow 3x long."""
    rng = np.random.default_rng(seed)
    rows = []
    for t in range(1, N + 1):
        rows.append(
            {
                "step": t,
                "reward": float(0.1 + 0.8 * t / N + rng.normal(0, 0.05)),
                "entropy": float(0.9 + rng.normal(0, 0.05)),
                "grad_norm": float(np.exp(rng.normal(-0.5, 0.4))),
                "completions/mean_length": float(40 * (1 + 2 * t / N) + rng.normal(0, 3)),
            }
        )
        if t % 20 == 0:
            accuracy = 0.3 + 0.25 * t / 80 if t <= 80 else 0.55 - 0.3 * (t - 80) / 120
            rows.append({"step": t, "eval/accuracy": float(accuracy)})
    rows.append({"step": N, "train_runtime": 100.0, "train_loss": 0.01})
    return rows


def only(findings, mode):
    found = [f for f in findings if f.mode == mode]
    assert len(found) == 1, [f.headline for f in findings]
    return found[0]


def evidence_for(finding, metric):
    matches = [e for e in finding.evidence if e.metric == metric]
    assert matches, [str(e) for e in finding.evidence]
    return matches[0]


@pytest.mark.parametrize("seed", range(20))
def test_noisy_healthy_run_has_no_finding(seed):
    history = History(rows=healthy_rows(seed))
    assert diagnose(history) == []


def test_healthy_text_names_steps_and_metrics():
    text = format_findings([], History(rows=healthy_rows()))
    assert text.startswith(f"healthy: no failure mode found ({N} steps, metrics checked: loss, grad_norm, reward,")
    assert "finished at step 200" in text


def test_hard_crash_is_named_with_the_spike_and_the_nan_steps():
    history = History(rows=hard_crash_rows())
    findings = diagnose(history)
    assert [f.mode for f in findings] == ["hard_crash"]
    crash = findings[0]
    assert crash.severity == "problem"
    assert "died at step 65" in crash.summary
    loss = evidence_for(crash, "loss")
    assert (loss.first_step, loss.last_step) == (63, 65)
    assert "3 non-finite of 65 logged" in loss.detail
    spike = evidence_for(crash, "grad_norm")
    jump = [e for e in crash.evidence if e.metric == "grad_norm" and "jump" in e.detail]
    assert spike and (jump[0].first_step, jump[0].last_step) == (61, 61)
    assert any(c.startswith("guards.gepo.enabled: true and guards.gepo.spike.enabled: true") for c in crash.changes)
    assert any(c.startswith("trainer.learning_rate") for c in crash.changes)
    text = format_findings(findings, history)
    assert "PROBLEM [hard_crash] hard crash" in text and "grad_norm, step 61:" in text and "loss, steps 63-65:" in text


def test_nonfinite_step_that_was_skipped_is_only_a_warning():
    rows = [r for r in healthy_rows(4) if "train_runtime" not in r]
    for r in rows:
        if r["step"] == 90 and "loss" in r:
            r["loss"], r["grad_norm"], r["gepo/skipped_steps"] = float("nan"), float("inf"), 3
        elif r["step"] > 90 and "gepo/skipped_steps" in r:
            r["gepo/skipped_steps"] += 1
    finding = only(diagnose(History(rows=rows)), "hard_crash")
    assert finding.severity == "warning"
    grad = evidence_for(finding, "grad_norm")
    assert (grad.first_step, grad.last_step) == (90, 90) and "every one a skipped step" in grad.detail


def test_advantage_std_rising_steadily_is_a_crash_precursor():
    rows = healthy_rows(5)
    for r in rows:
        if "gepo/adv_std" in r and r["step"] > 160:
            r["gepo/adv_std"] *= 1 + 3 * (r["step"] - 160) / 40  # 0.9 -> 3.6 over the last 40 steps
    finding = only(diagnose(History(rows=rows)), "hard_crash")
    adv = evidence_for(finding, "gepo/adv_std")
    assert finding.severity == "warning" and (adv.first_step, adv.last_step) == (161, 200)


def test_rollbacks_from_counter_and_events():
    rows = healthy_rows(6)
    for r in rows:
        if "loss" in r:
            r["opefo/rollbacks"] = int(r["step"] >= 70) + int(r["step"] >= 120) + int(r["step"] >= 150)
    events = [{"step": 70, "event": "rollback", "cause": "nonfinite loss"}]
    finding = only(diagnose(History(rows=rows, events=events)), "hard_crash")
    roll = evidence_for(finding, "opefo/rollbacks")
    assert finding.severity == "problem"  # 3 rollbacks = DoctorConfig.rollbacks_problem
    assert (roll.first_step, roll.last_step) == (70, 150) and "causes: nonfinite loss" in roll.detail


def test_an_in_place_repair_is_reported_with_its_entries():
    rows = healthy_rows(6)
    for r in rows:
        if "loss" in r:
            r["opefo/repairs"] = int(r["step"] >= 40)
    events = [{"step": 40, "event": "state_repair", "cause": "non-finite optimizer state", "entries": 3}]
    finding = only(diagnose(History(rows=rows, events=events)), "hard_crash")
    repair = evidence_for(finding, "opefo/repairs")
    assert finding.severity == "warning" and (repair.first_step, repair.last_step) == (40, 40)
    assert "1 repair(s) of 3 non-finite Adam moment entries" in repair.detail


def test_entropy_collapse_is_named_with_kl_repetition_and_flat_reward():
    findings = diagnose(History(rows=collapse_rows()))
    assert [f.mode for f in findings] == ["entropy_collapse"]
    collapse = findings[0]
    assert collapse.severity == "problem"
    assert "KL rising" in collapse.summary and "repetition filter counts rising" in collapse.summary
    assert "reward flat" in collapse.summary
    entropy = evidence_for(collapse, "entropy")
    assert (entropy.first_step, entropy.last_step) == (1, N)
    assert evidence_for(collapse, "quatro/filtered/repetition")
    assert any(c.startswith("guards.quatro.entropy: turn the entropy floor on") for c in collapse.changes)
    assert any("trainer.beta" in c and "guards.quatro.kl.target" in c for c in collapse.changes)
    # the same run with the floor already on: the advice is its cap, not "turn it on"
    rows = [{**r, "quatro/floor_active": 1.0} if "entropy" in r and r["step"] > N // 2 else r for r in collapse_rows()]
    changes = diagnose(History(rows=rows))[0].changes
    assert any(c.startswith("guards.quatro.entropy.coef_max: the floor is on") for c in changes)
    assert not any("turn the entropy floor on" in c for c in changes)
    assert not any("gate_reward" in c for c in changes)  # the gate never held it off
    # the gate held the floor off at steps 41-60: the reward the gate reads is named as the thing to change
    held = [{**r, "quatro/floor_held_off": float(40 < r["step"] <= 60)} if "entropy" in r else r for r in rows]
    finding = diagnose(History(rows=held))[0]
    gate = evidence_for(finding, "quatro/floor_held_off")
    assert (gate.first_step, gate.last_step) == (41, 60) and "held the floor off at 20 logged step(s)" in gate.detail
    assert finding.changes[1].startswith("guards.quatro.entropy.gate_reward: the learning gate held the floor off")
    # a floor that followed entropy down does not make a collapse with flat reward and rising KL an all-clear
    followed = [{**r, "quatro/entropy_floor": 0.9 if r["step"] <= 10 else 0.0} if "entropy" in r else r for r in rows]
    finding = diagnose(History(rows=followed))[0]
    assert finding.severity == "problem" and evidence_for(finding, "quatro/entropy_floor")
    assert not any(c.startswith("nothing, if the held-out accuracy holds") for c in finding.changes)


def test_entropy_falling_to_a_tenth_while_reward_rises_is_a_run_that_learns():
    rows = healthy_rows(7)
    for r in rows:
        if "entropy" in r:  # SmolLM2 learning its short format: entropy to ~10 % of its start, reward up
            r["entropy"] = float(0.1 + 0.9 * np.exp(-r["step"] / 20))
    assert [f.mode for f in diagnose(History(rows=rows))] == []
    # the same fall with the repetition filter's counts rising: a warning again
    repeating = [{**r, "quatro/filtered/repetition": float(r["step"] > 100) * r["step"] / 20} for r in rows]
    finding = only(diagnose(History(rows=repeating)), "entropy_collapse")
    assert finding.severity == "warning" and "repetition filter counts rising" in finding.summary


def test_entropy_falling_while_reward_rises_is_only_a_warning():
    rows = healthy_rows(7)
    for r in rows:
        if "entropy" in r:
            r["entropy"] = float(np.exp(-r["step"] / 60))  # 1.0 -> 0.04
    finding = only(diagnose(History(rows=rows)), "entropy_collapse")
    assert finding.severity == "warning" and "while reward still rises" in finding.summary
    assert not any(c.startswith("nothing, if the held-out accuracy holds") for c in finding.changes)
    # follow_learning lowered the floor at steps 61 and 121 (0.8 -> 0.3 -> 0.03): the fall was accepted as learning,
    # and the first thing said is that nothing needs changing if the held-out accuracy holds
    followed = [
        {**r, "quatro/entropy_floor": 0.8 if r["step"] <= 60 else 0.3 if r["step"] <= 120 else 0.03}
        if "entropy" in r
        else r
        for r in rows
    ]
    finding = only(diagnose(History(rows=followed)), "entropy_collapse")
    floor = evidence_for(finding, "quatro/entropy_floor")
    assert (floor.first_step, floor.last_step) == (61, 121) and "followed entropy down 0.8 -> 0.03" in floor.detail
    assert finding.changes[0].startswith("nothing, if the held-out accuracy holds: the floor followed entropy down")
    # a floor that followed, with entropy now under it: the fall was not all accepted, no all-clear
    under = [{**r, "quatro/entropy_floor": 0.8 if r["step"] <= 60 else 0.3} if "entropy" in r else r for r in rows]
    finding = only(diagnose(History(rows=under)), "entropy_collapse")
    assert evidence_for(finding, "quatro/entropy_floor") and not finding.changes[0].startswith("nothing")


def test_reward_hacking_is_named_with_the_eval_peak():
    findings = diagnose(History(rows=hacking_rows()))
    assert [f.mode for f in findings] == ["reward_hacking"]
    hacking = findings[0]
    assert hacking.severity == "problem"
    accuracy = evidence_for(hacking, "eval/accuracy")
    assert (accuracy.first_step, accuracy.last_step) == (80, 200)
    assert "best 0.55 at step 80 -> 0.25" in accuracy.detail
    assert "completion length grew" in hacking.summary
    assert any("checkpoint nearest step 80" in c for c in hacking.changes)


def test_thresholds_come_from_the_config():
    history = History(rows=[r for r in hard_crash_rows() if r["step"] <= 60])  # healthy prefix only
    assert diagnose(history) == []
    rows = [r for r in hard_crash_rows() if r["step"] <= 61]  # the 1000x jump at 61, no NaN yet
    assert only(diagnose(History(rows=rows)), "hard_crash").severity == "warning"
    assert diagnose(History(rows=rows), DoctorConfig(spike_ratio=10_000.0)) == []


# ----------------------------------------------------------------------------------------------- cli


def write_jsonl(folder: Path, rows: list[dict[str, Any]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(
        json.dumps({k: (str(v) if isinstance(v, float) and not np.isfinite(v) else v) for k, v in r.items()}) + "\n"
        for r in rows
    )
    (folder / "metrics.jsonl").write_text(text)
    return folder


def test_cli_doctor_exit_codes(tmp_path, capsys):
    assert main(["doctor", str(write_jsonl(tmp_path / "ok", healthy_rows()))]) == 0
    assert capsys.readouterr().out.startswith("healthy: no failure mode found (200 steps")

    assert main(["doctor", str(write_jsonl(tmp_path / "crash", hard_crash_rows()))]) == 1
    out = capsys.readouterr().out
    assert "PROBLEM [hard_crash]" in out and "no final row: still running or died at step 65" in out

    (tmp_path / "empty").mkdir()
    assert main(["doctor", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "no training logs" in err and "metrics.jsonl" in err and "trainer_state.json" in err
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert not (tmp_path / "empty" / "report").exists()


def test_off_policy_vllm_rollouts_are_named_and_in_sync_runs_pass():
    gap = "sampling/sampling_logp_difference/mean"
    in_sync = healthy_rows(3)
    for r in in_sync:
        if "reward" in r:
            r[gap] = 0.002 + 0.01 * (r["step"] % 7 == 0)  # float noise, a bump now and then
    assert diagnose(History(in_sync)) == []
    stale = [dict(r) for r in in_sync]
    for r in stale:
        if gap in r and r["step"] >= 150:
            r[gap] = 1.0 + 0.01 * r["step"]  # the sync stopped reaching vLLM after step 149
    (finding,) = diagnose(History(stale))
    assert finding.mode == "off_policy_rollouts" and finding.severity == "problem"
    assert str(finding.evidence[0]).startswith(f"{gap}, steps 1-200: median 2.955 nats per token over steps 191-200")
    assert "first above it at step 150" in str(finding.evidence[0])
    (drift,) = diagnose(History(stale), DoctorConfig(logp_gap_max=5.0))  # below the bar: still 1400x its start
    assert drift.severity == "warning" and "1477.5x the median 0.002" in str(drift.evidence[0])


def test_off_policy_drift_below_the_threshold_is_a_warning():
    gap = "sampling/sampling_logp_difference/mean"
    rows = healthy_rows(4)
    for r in rows:
        if "reward" in r:
            r[gap] = 0.002 if r["step"] < 100 else 0.02  # stale at a small learning rate: 10x, never above 0.1
    (finding,) = diagnose(History(rows))
    assert finding.mode == "off_policy_rollouts" and finding.severity == "warning"
    assert str(finding.evidence[0]) == (
        f"{gap}, steps 1-200: median 0.02 nats per token over steps 191-200, 10.0x the median 0.002 over steps 1-10"
    )
    assert diagnose(History(rows), DoctorConfig(logp_gap_floor=0.05)) == []


def test_doctor_reads_the_runs_sampling_settings(tmp_path):
    from steadyrl.evidence.doctor import doctor_config_for

    assert doctor_config_for(tmp_path).logp_gap_allowance == 0.0  # no resolved config: exact sampling assumed
    (tmp_path / "resolved_config.yaml").write_text("trainer:\n  top_p: 0.95\n  top_k: 0\n")
    assert doctor_config_for(tmp_path).logp_gap_allowance == pytest.approx(0.0513, abs=1e-4)
    (tmp_path / "resolved_config.yaml").write_text("trainer:\n  top_p: 1.0\n  top_k: 50\n")
    assert doctor_config_for(tmp_path).logp_gap_allowance is None
    gap = "sampling/sampling_logp_difference/mean"
    rows = healthy_rows(5)
    for r in rows:
        if "reward" in r:
            r[gap] = 3.0  # with top-k sampling the gap says nothing about the sync
    assert diagnose(History(rows), doctor_config_for(tmp_path)) == []
    assert diagnose(History(rows))[0].mode == "off_policy_rollouts"


# ------------------------------------------------------------------------------------ saturated controllers


def _saturation(rows: list[dict[str, Any]]) -> list[str]:
    findings = [f for f in diagnose(History(rows)) if f.mode == "saturated_controller"]
    return [c for f in findings for c in f.changes]


def test_a_healthy_run_with_idle_controllers_has_no_saturation_finding():
    rows = healthy_rows()
    for r in rows:  # KL controller resting at trainer.beta, floor never active, a few zero-variance drops
        if "loss" in r:
            r.update({"quatro/kl_coef": 0.04, "quatro/kl_at_max": 0.0, "quatro/kl_at_min": 0.0})
            r.update({"quatro/entropy_bonus": 0.0, "quatro/floor_active": 0.0, "gepo/spike_rebases": 0.0})
            r.update({"quatro/filtered_share": 0.4, "quatro/filtered/zero_variance": 25.0})
    assert _saturation(rows) == []


def test_the_entropy_floor_is_at_its_cap_when_its_control_is_at_1_not_at_the_largest_bonus_logged():
    """With ``quatro/entropy_control`` logged the cap is control 1: a floor that settled at control 0.6 (bonus 0.006,
    the largest it logged) is holding, not saturated; one at control 1 is reported with both levers' keys."""

    def rows(control: float) -> list[dict]:
        out = [{"step": t, "loss": 0.0, "quatro/floor_active": 1.0} for t in range(1, 61)]
        for r in out:
            r["quatro/entropy_control"] = min(0.1 * r["step"], control)
            r["quatro/entropy_bonus"] = 0.01 * r["quatro/entropy_control"]
        return out

    assert _saturation(rows(0.6)) == []
    changes = _saturation(rows(1.0))
    assert len(changes) == 1 and changes[0].startswith("guards.quatro.entropy.coef_max: raise it")


def test_kl_at_its_cap_entropy_bonus_at_its_cap_and_heavy_filtering_are_each_reported_with_the_key():
    rows = [{"step": t, "loss": 0.0} for t in range(1, 61)]
    for r in rows:
        t = r["step"]
        r["quatro/kl_at_max"] = float(max(0, t - 30))  # pinned at the cap from step 31 on
        r["quatro/kl_coef"], r["quatro/kl_target"], r["quatro/kl_mean"] = 0.16, 0.02, 0.3
        r["quatro/entropy_bonus"] = min(0.001 * t, 0.01)  # at its cap from step 10
        r["quatro/floor_active"] = 1.0
        r["quatro/filtered_share"] = 0.6
        r["quatro/filtered/repetition"], r["quatro/filtered/zero_variance"] = 30.0, 8.0
    changes = _saturation(rows)
    assert any(c.startswith("guards.quatro.kl.beta_range") for c in changes)
    assert any(c.startswith("guards.quatro.entropy.coef_max: raise it") for c in changes)  # a run without control
    assert any(c.startswith("guards.quatro.filters.repetition:") for c in changes)
    text = format_findings(diagnose(History(rows)), History(rows))
    assert "WARNING [saturated_controller]" in text
    assert "wanted beta past its upper bound on 20 of the last 20 steps (beta 0.16, target 0.02, KL 0.3)" in text
    assert "quality filters dropped 47% of rows" in text  # 0.6 x 30 / 38: zero-variance rows are not counted


def test_grade_clipping_far_more_than_its_tails_is_reported_and_tails_alone_are_not():
    rows = [{"step": t, "loss": 0.0, "grade/clip_frac_low": 0.03, "grade/clip_frac_high": 0.03} for t in range(1, 61)]
    assert _saturation(rows) == []  # 2 x tau: the design's share
    for r in rows[40:]:
        r["grade/clip_frac_low"] = 0.3  # the last 20 rows: a stale low bound under every failing row
    changes = _saturation(rows)
    assert len(changes) == 1 and changes[0].startswith("guards.grade.quantile_every")
    text = format_findings(diagnose(History(rows)), History(rows))
    assert "grade/clip_frac_low, steps 41-60: the tail clip touched 30% (low) + 3% (high) of rows" in text


def test_spike_streaks_and_rebases_are_reported():
    rows = [
        {"step": t, "loss": 0.0, "grad_norm": 1.0, "gepo/skipped_steps": float(min(max(0, t - 40), 3))}
        for t in range(1, 61)
    ]
    for r in rows:
        r["gepo/spike_rebases"] = float(r["step"] >= 44)
    changes = _saturation(rows)
    assert any(c.startswith("guards.gepo.spike.rebase_after") for c in changes)
    assert any(c.startswith("guards.gepo.spike.min_ratio") for c in changes)
    text = format_findings(diagnose(History(rows)), History(rows))
    assert "gepo/skipped_steps, steps 41-43: 3 optimizer steps in a row were skipped" in text


def test_a_falling_rollout_ess_is_named_with_the_keys_to_change():
    """mismatch/ess: float noise below 1 is healthy; a loss 1 - ESS that grows 5x past 0.01 is a warning (a stale sync
    the log-prob gap may not show yet), a median under 0.5 a problem."""
    ess = "mismatch/ess"
    rows = healthy_rows(5)
    for r in rows:
        if "reward" in r:
            r[ess] = 1 - 1e-6 * (1 + r["step"] % 3)  # a synced run: ESS 0.999999
    assert diagnose(History(rows)) == []
    for r in rows:
        if ess in r and r["step"] > 100:
            r[ess] = 0.97  # 1 - ESS 0.03: 15000x the early median, above the floor
    (finding,) = diagnose(History(rows))
    assert (finding.mode, finding.severity) == ("off_policy_rollouts", "warning")
    assert "effective sample size is falling (0.97)" in finding.summary
    assert str(finding.evidence[0]) == f"{ess}, steps 1-200: median 0.97 over steps 191-200 (highest 1 over steps 1-10)"
    assert any("guards.gepo.mismatch.ess_min" in fix for fix in finding.changes)
    assert diagnose(History(rows), DoctorConfig(ess_loss_floor=0.05)) == []
    for r in rows:
        if ess in r and r["step"] > 100:
            r[ess] = 0.3
    (finding,) = diagnose(History(rows))
    assert finding.severity == "problem" and "fell to 0.3" in finding.summary


# ----------------------------------------------------------------------------------------------- regression


def lr_collapse_rows(seed: int = 4) -> list[dict[str, Any]]:
    """A learning rate 30x too high (the tiny task, measured): the reward falls from ~0.5 to 0 in 10 steps and stays
    there, every group's rewards equal (no learning signal); the eval (200 samples, from step 0) 0.55 -> 0."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = [{"step": 0, "eval/accuracy": 0.55, "eval/accuracy_se": 0.035}]
    for t in range(1, N + 1):
        reward = max(0.0, 0.5 * (1 - t / 10)) + (float(abs(rng.normal(0, 0.03))) if t < 10 else 0.0)
        rows.append(
            {
                "step": t,
                "reward": reward,
                "frac_reward_zero_std": 0.3 if t < 10 else 1.0,
                "grad_norm": 0.5 if t < 10 else 0.0,
                "entropy": float(0.9 + rng.normal(0, 0.05)),
            }
        )
        if t % 25 == 0:
            rows.append({"step": t, "eval/accuracy": 0.0, "eval/accuracy_se": 0.0})
    rows.append({"step": N, "train_runtime": 100.0, "train_loss": 0.01})
    return rows


def sampled_plateau_rows(seed: int = 5) -> list[dict[str, Any]]:
    """A healthy run that stopped improving: flat reward, a sampled eval (n 200: se 0.035) around 0.5 every 20 steps,
    its luckiest eval 0.6 at step 40 and later ones 0.09-0.13 below it (inside the noise)."""
    rows = [r for r in healthy_rows(seed) if "eval/accuracy" not in r and "train_runtime" not in r]
    rng = np.random.default_rng(seed)
    for r in rows:
        if "reward" in r:
            r["reward"] = float(rng.normal(0.5, 0.08))
    for t, acc in zip(range(20, N + 1, 20), (0.52, 0.60, 0.50, 0.48, 0.51, 0.47, 0.49, 0.50, 0.47, 0.49), strict=True):
        rows.append({"step": t, "eval/accuracy": acc, "eval/accuracy_se": 0.035, "eval/num_samples": 200})
    return rows


def test_a_run_that_failed_by_itself_is_a_regression_with_no_learning_signal_never_healthy():
    findings = diagnose(History(rows=lr_collapse_rows()))
    regression = only(findings, "regression")
    assert regression.severity == "problem" and "no learning signal left" in regression.summary
    assert "reward" in [e.metric for e in regression.evidence]
    assert evidence_for(regression, "frac_reward_zero_std").detail.startswith("mean ")
    assert "best 0.55 at step 0 -> 0 at step 200" in evidence_for(regression, "eval/accuracy").detail
    assert regression.changes[0].startswith(
        "trainer.learning_rate: lower it 3-10x and resume from the checkpoint nearest step 0"
    )
    assert "healthy" not in format_findings(findings, History(rows=lr_collapse_rows()))


def test_a_reward_dip_over_windows_shorter_than_reward_fall_points_is_no_regression():
    # a healthy tiny run's first 10 steps (measured, seed 3): 0.68 over steps 1-3, 0.36 over steps 8-10, 2.3 pooled std
    rewards = [0.72, 0.66, 0.67, 0.5, 0.55, 0.45, 0.48, 0.36, 0.39, 0.34]
    rows = [{"step": t, "reward": r, "reward_std": 0.45, "loss": 0.0} for t, r in enumerate(rewards, 1)]
    assert diagnose(History(rows=rows)) == []  # windows of 3 (a third of 10) < reward_fall_points (10)
    assert only(diagnose(History(rows=rows), DoctorConfig(reward_fall_points=3)), "regression").severity == "problem"
    # the same fall held over windows of 10: a regression
    held = [{"step": t, "reward": 0.7 if t <= 10 else 0.35, "reward_std": 0.45, "loss": 0.0} for t in range(1, 31)]
    for r in held:
        r["reward"] += 0.02 * ((r["step"] * 7) % 5 - 2)  # spread so the windows have a std
    assert only(diagnose(History(rows=held)), "regression").severity == "problem"


def test_an_eval_fall_inside_its_noise_is_no_regression_and_outside_it_is():
    rows = sampled_plateau_rows()
    assert diagnose(History(rows=rows)) == []
    # no noise model (eval_z 0: eval_drop 0.05 alone): the plateau's lucky best reads as a regression
    assert only(diagnose(History(rows=rows), DoctorConfig(eval_z=0.0)), "regression").severity == "problem"
    # the binomial bound from eval/num_samples stands in for a missing se: still quiet
    bare = [{k: v for k, v in r.items() if k != "eval/accuracy_se"} for r in rows]
    assert diagnose(History(rows=bare)) == []
    # a real fall: the last two evals 0.3 (0.3 below the best, the margin 4 * sqrt(2) * 0.035 = 0.198)
    fallen = [{**r, "eval/accuracy": 0.3} if r.get("step", 0) >= 180 and "eval/accuracy" in r else r for r in rows]
    regression = only(diagnose(History(rows=fallen)), "regression")
    assert "best 0.6 at step 40 -> 0.3 at step 200 (0.198 allowed by its noise)" in regression.evidence[0].detail


def test_the_gold_watchs_rollbacks_are_named_by_what_it_saw():
    rows = healthy_rows()
    cause = "the eval metric (eval/accuracy) fell from 0.55 at step 0 to 0 at step 40 ..."
    events = [
        {"step": 40, "event": "gold_rollback", "cause": cause, "verdict": "regressed", "snapshot_step": 0},
        {"step": 80, "event": "gold_rollback", "cause": "...", "verdict": "regressed", "snapshot_step": 0},
        {"step": 200, "event": "gold_rollback", "cause": "the run ends ..."},  # the end-of-run swap: not counted
    ]
    findings = diagnose(History(rows=rows, events=events))
    regression = only(findings, "regression")
    assert regression.severity == "warning" and regression.summary.startswith("the gold watch rolled back 2 time(s)")
    assert "2 rollback(s) at step(s) 40, 80; first: the eval metric" in regression.evidence[0].detail
    assert "resume from the best policy the watch kept" in regression.changes[0]
    gamed = [{**e, "verdict": "diverged"} for e in events[:1]]
    assert only(diagnose(History(rows=rows, events=gamed)), "reward_hacking").severity == "warning"


def test_a_run_that_fell_and_partly_recovered_is_a_regression_by_the_gold_watchs_rule_replayed():
    # plain TRL at 10x the learning rate (tiny, seed 0, measured): the eval 0.55 before training, 0.12 at step 20,
    # then a slow partial recovery to 0.39; the reward fell from 0.53 at step 1 and stays noisy: the last eval alone
    # is within the noise margin of the best (0.16 < 0.198), the replayed rule confirms the fall at step 40
    golds = [0.55, 0.12, 0.175, 0.115, 0.115, 0.18, 0.215, 0.26, 0.24, 0.35, 0.39]
    rng = np.random.default_rng(6)
    rows: list[dict[str, Any]] = []
    for t in range(0, N + 1):
        if t:
            reward = 0.53 if t == 1 else float(np.clip(rng.normal(0.18, 0.12), 0, 1))
            rows.append({"step": t, "reward": reward, "frac_reward_zero_std": 0.75})
        if t % 20 == 0:
            gold = golds[t // 20]
            rows.append({"step": t, "eval/accuracy": gold, "eval/accuracy_se": (gold * (1 - gold) / 200) ** 0.5})
    regression = only(diagnose(History(rows=rows)), "regression")
    replayed = evidence_for(regression, "eval/accuracy")
    assert replayed.detail.startswith("the gold watch's rule, replayed: 0.55 at step 0 -> 0.175 at step 40, 2 evals")
    assert "the training reward fell with it" in replayed.detail
    # a run whose watch acted (a rollback event with its verdict): its rollbacks are the finding, not a replay
    acted = [{"step": 40, "event": "gold_rollback", "cause": "...", "verdict": "regressed", "snapshot_step": 0}]
    findings = diagnose(History(rows=rows, events=acted))
    assert [(f.mode, f.severity) for f in findings] == [("regression", "warning")]
