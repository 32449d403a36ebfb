"""Early warnings on synthetic log histories."""

from __future__ import annotations

import pytest

from steadyrl.evidence.early_warnings import MonitorConfig, early_warnings, recent

CFG = MonitorConfig(window=5, adv_std_rise_ratio=1.5, entropy_drop_ratio=0.5)
W2 = MonitorConfig(window=2)  # entropy windows of 2 values: means and standard errors by hand


def history(key, values, start=1):
    return [{"step": start + i, key: v, "loss": 0.0} for i, v in enumerate(values)]


def test_healthy_run_has_no_warning():
    rows = history("gepo/adv_std", [1.0, 1.1, 0.9, 1.0, 1.05]) + history("entropy", [1.0, 0.95, 0.97, 0.9, 0.92])
    assert early_warnings(rows, CFG) == []
    # a plateau's entropy scatters step to step (a healthy tiny run: 0.03-0.28): single low steps are not a fall
    plateau = [0.25, 0.1, 0.2, 0.05, 0.18, 0.22, 0.04, 0.15, 0.2, 0.08] * 3
    assert early_warnings(history("entropy", plateau), CFG) == []


def test_rising_advantage_std_is_named_with_steps_and_values():
    rows = history("gepo/adv_std", [1.0, 1.2, 1.4, 1.3, 1.5, 1.6], start=10)  # 4 of 5 pairs up, 1.6 >= 1.5 x 1.0
    (warning,) = early_warnings(rows, MonitorConfig(window=6))
    assert warning.startswith("advantage std rising steadily: gepo/adv_std 1 -> 1.6 over steps 10-15 (80% of steps up)")
    assert early_warnings(history("gepo/adv_std", [1.0, 1.2, 1.4, 1.3, 1.6]), CFG) == []  # 3 of 4: below 0.8


def test_rise_needs_both_steadiness_and_size():
    assert early_warnings(history("gepo/adv_std", [1.0, 1.1, 1.2, 1.3, 1.4]), CFG) == []  # steady but only 1.4x
    assert early_warnings(history("gepo/adv_std", [1.0, 2.0, 1.0, 2.0, 1.6]), CFG) == []  # big but not steady


def test_entropy_drop_compares_window_means():
    (warning,) = early_warnings(history("entropy", [1.0, 1.0, 0.2, 0.2], start=3), W2)
    assert warning.startswith("entropy falling fast: mean entropy 1 over steps 3-4 -> 0.2 over steps 5-6")
    assert early_warnings(history("entropy", [1.0, 1.0, 0.5, 0.5]), W2) == []  # 0.5 is not below 0.5 x 1.0
    assert early_warnings(history("entropy", [1.0, 1.0, 0.2]), W2) == []  # fewer than 2 windows


def test_entropy_drop_within_the_noise_does_not_warn():
    # windows [1.0, 0.6] (mean 0.8, var 0.04) and [0.6, 0.0] (mean 0.3, var 0.09): 0.3 < 0.5 x 0.8, but the fall 0.5
    # is within 2 standard errors of the difference, 2 x sqrt((0.04 + 0.09) / 2) = 0.51. Single points (1.0 -> 0.0,
    # the rule before) called it a collapse.
    assert early_warnings(history("entropy", [1.0, 0.6, 0.6, 0.0]), W2) == []
    # [0.55, 0.0] (mean 0.275, var 0.0756): 0.525 > 2 x sqrt((0.04 + 0.0756) / 2) = 0.48
    (warning,) = early_warnings(history("entropy", [1.0, 0.6, 0.55, 0.0]), W2)
    assert "mean entropy 0.8 over steps 1-2 -> 0.275 over steps 3-4" in warning


def test_entropy_drop_reads_the_highest_earlier_window_of_the_lookback():
    # the highest window is steps 1-2 (1.0), not the one just before the last (0.6): 0.4 < 0.5 x 1.0
    (warning,) = early_warnings(history("entropy", [1.0, 1.0, 0.6, 0.6, 0.4, 0.4]), W2)
    assert "mean entropy 1 over steps 1-2 -> 0.4 over steps 5-6" in warning
    # older than ENTROPY_LOOKBACK (5) windows of values: the 1.0s are out of reach, 0.4 >= 0.5 x 0.45
    assert early_warnings(history("entropy", [1.0, 1.0] + [0.45] * 8 + [0.4, 0.4]), W2) == []


def test_short_history_and_none_values():
    assert early_warnings(history("entropy", [2.0, 0.1]), CFG) == []
    rows = [{"step": 1, "entropy": None}, {"step": 2, "entropy": 1.0}]
    assert recent(rows, "entropy", 5) == [(2, 1.0)]


def test_config_checks():
    with pytest.raises(ValueError, match="window must be >= 2, got 1"):
        MonitorConfig(window=1)


def test_vllm_logp_gap_warns_on_a_sustained_gap_only():
    key = "sampling/sampling_logp_difference/mean"
    in_sync = history(key, [0.002, 0.003, 0.002, 0.004, 0.002])
    assert early_warnings(in_sync, CFG) == []
    one_spike = history(key, [0.002, 0.003, 0.9, 0.004, 0.002])  # median 0.003
    assert early_warnings(one_spike, CFG) == []
    assert early_warnings(history(key, [0.5, 0.6]), CFG) == []  # fewer than 3 values: no median yet
    stale = history(key, [0.01, 0.08, 0.15, 0.3, 0.45], start=20)  # median 0.15 > 0.1
    (warning,) = early_warnings(stale, CFG)
    assert warning.startswith(f"vLLM and the policy disagree: median {key} 0.15 nats per token over steps 20-24 > 0.1")
    assert early_warnings(stale, MonitorConfig(window=5, logp_gap_max=0.2)) == []


def test_vllm_logp_gap_growing_from_its_start_warns_below_the_absolute_threshold():
    key = "sampling/sampling_logp_difference/mean"
    # stale after step 5 at a small learning rate: 0.002 -> ~0.02, never above 0.1
    rows = history(key, [0.002, 0.001, 0.003, 0.002, 0.002, 0.006, 0.01, 0.02, 0.015, 0.03])
    (warning,) = early_warnings(rows, CFG)
    assert warning.startswith(f"vLLM and the policy drift apart: median {key} 0.015 nats per token over steps 6-10, ")
    assert "7.5x the median 0.002 of steps 1-5" in warning
    assert early_warnings(rows[:9], CFG) == []  # fewer than 2 windows: no start to compare with
    quiet = history(key, [0.0002, 0.0001, 0.0003, 0.0002, 0.0002, 0.001, 0.002, 0.003, 0.002, 0.003])
    assert early_warnings(quiet, CFG) == []  # 10x, but below logp_gap_floor (0.005): float noise
    in_sync = history(key, [0.002, 0.001, 0.003, 0.002, 0.002, 0.003, 0.002, 0.004, 0.002, 0.003])
    assert early_warnings(in_sync, CFG) == []


def test_sampling_settings_set_the_gap_allowance():
    from steadyrl.evidence.early_warnings import logp_gap_allowance

    assert logp_gap_allowance() == 0.0
    assert logp_gap_allowance(top_p=0.95) == pytest.approx(0.051293, abs=1e-6)  # -log(0.95)
    assert logp_gap_allowance(top_k=50) is None
    assert logp_gap_allowance(min_p=0.05) is None
    assert logp_gap_allowance(repetition_penalty=1.1) is None


def test_truncated_sampling_raises_the_bar_and_turns_the_rise_rule_off():
    key = "sampling/sampling_logp_difference/mean"
    rising = history(key, [0.002, 0.001, 0.003, 0.002, 0.002, 0.006, 0.01, 0.02, 0.015, 0.03])
    assert early_warnings(rising, CFG, gap_allowance=0.0)  # exact sampling: 7.5x its start warns
    assert early_warnings(rising, CFG, gap_allowance=0.0513) == []  # top_p 0.95: the gap moves with the entropy
    high = history(key, [0.12, 0.13, 0.14, 0.13, 0.12])
    assert early_warnings(high, CFG, gap_allowance=0.0513) == []  # under 0.1 + 0.0513
    (warning,) = early_warnings(history(key, [0.2, 0.2, 0.2]), CFG, gap_allowance=0.0513)
    assert "0.2 nats per token over steps 1-3 > 0.1513" in warning
    assert early_warnings(history(key, [5.0, 5.0, 5.0]), CFG, gap_allowance=None) == []  # top-k: no gap check


def test_two_value_window_never_warns_on_one_step():
    key = "sampling/sampling_logp_difference/mean"
    assert early_warnings(history(key, [0.002, 0.3]), MonitorConfig(window=2)) == []


def test_recent_reads_from_the_end_and_matches_a_full_scan():
    rows = [{"step": s, "entropy": None if s % 3 == 0 else s / 10} for s in range(1, 40)] + [{"loss": 1.0}]
    full = [(r["step"], r["entropy"]) for r in rows if r.get("entropy") is not None]
    for window in (1, 2, 5, len(full), len(full) + 3):
        assert recent(rows, "entropy", window) == full[-window:]


def test_monitor_summary_reads_only_new_rows_and_restarts_on_a_new_history(caplog):
    import logging
    from types import SimpleNamespace

    from steadyrl.callbacks.monitor import SignalMonitor

    monitor = SignalMonitor(MonitorConfig(every=2))
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
    args = SimpleNamespace()
    with caplog.at_level(logging.INFO, logger="steadyrl.monitor"):
        for step, reward in ((1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)):
            state.global_step = step
            state.log_history.append({"step": step, "reward": reward, **({"kl": 0.5} if step == 1 else {})})
            monitor.on_log(args, state, None)
        assert monitor._rows_read == 4
        state.log_history, state.global_step = [{"step": 2, "reward": 0.9}], 2  # another train() call
        monitor._last_step = -1
        monitor.on_log(args, state, None)
    lines = [r.getMessage() for r in caplog.records if r.name == "steadyrl.monitor"]
    assert lines[0] == "step 2: reward=0.2, kl=0.5" and lines[1] == "step 4: reward=0.4, kl=0.5"  # kl from step 1
    assert lines[2] == "step 2: reward=0.9"


def _rollouts(steps: int, length, clipped, reward) -> list[dict]:
    return [{"step": s, "completions/mean_length": length(s), "completions/clipped_ratio": clipped(s),
             "reward": reward(s), "loss": 0.0} for s in range(1, steps + 1)]  # fmt: skip


def test_monitor_warns_once_per_rollout_hacking_rule_while_the_reward_rises(caplog):
    import logging
    from types import SimpleNamespace

    from steadyrl.callbacks.monitor import SignalMonitor

    # the tiny hacking scenario's shape: length 3 -> 9 (the cap), 40% of the completions truncated, reward up
    ramp = lambda s: min(s, 40) / 40  # noqa: E731
    gamed = _rollouts(60, lambda s: 3.0 + 6.0 * ramp(s), lambda s: 0.4 * ramp(s), lambda s: 0.5 + s / 100)
    monitor = SignalMonitor(MonitorConfig(every=20))
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
    with caplog.at_level(logging.WARNING, logger="steadyrl.monitor"):
        for row in gamed:
            state.global_step = row["step"]
            state.log_history.append(row)
            monitor.on_log(SimpleNamespace(), state, None)
    hacking = [(step, w) for step, w in monitor.warnings if w.startswith("reward hacking suspected")]
    assert [step for step, _ in hacking] == [40, 40]  # both rules, each once (not again at step 60)
    assert "completion length grew 2.2x while reward rises" in hacking[0][1]  # 8.3 over the first 10 steps' 3.8
    assert "more completions hit max_completion_length while reward rises" in hacking[1][1]
    assert len([r for r in caplog.records if "reward hacking suspected" in r.getMessage()]) == 2


def test_no_rollout_hacking_warning_on_a_run_that_learns_shorter_answers_or_whose_reward_falls():
    from steadyrl.evidence.doctor import rollout_hacking
    from steadyrl.evidence.history import history_of

    # SmolLM2 learning its concise format: length 24 -> 10, truncation down, reward up
    learns = _rollouts(60, lambda s: 24.0 - 14.0 * min(s, 30) / 30, lambda s: 0.3 * (1 - min(s, 30) / 30),
                       lambda s: 0.3 + s / 100)  # fmt: skip
    assert rollout_hacking(history_of(learns)) == []
    # longer and truncated, but the reward falls with it: a collapse, not gaming
    falls = _rollouts(60, lambda s: 4.0 + s / 10, lambda s: s / 100, lambda s: 1.0 - s / 100)
    assert rollout_hacking(history_of(falls)) == []
    # length within the 2x band (4 -> 6), truncation up by less than 0.2: no rule fires
    mild = _rollouts(60, lambda s: 4.0 + s / 30, lambda s: s / 400, lambda s: 0.5 + s / 100)
    assert rollout_hacking(history_of(mild)) == []


def test_monitor_warns_once_when_the_vllm_rollouts_ess_falls():
    from types import SimpleNamespace

    from steadyrl.callbacks.monitor import SignalMonitor

    monitor = SignalMonitor(MonitorConfig(every=10))
    state = SimpleNamespace(global_step=0, is_world_process_zero=True, log_history=[])
    for step in range(1, 41):  # in sync until step 15 (ESS 1 - 1e-6), then a sync that stopped: ESS 0.9
        state.global_step = step
        state.log_history.append({"step": step, "reward": 0.5, "mismatch/ess": 1 - 1e-6 if step <= 15 else 0.9})
        monitor.on_log(SimpleNamespace(), state, None)
    off = [(step, w) for step, w in monitor.warnings if w.startswith("vLLM rollouts off-policy")]
    assert len(off) == 1 and off[0][0] == 20, monitor.warnings  # first read at step 20 (windows of 6: late all 0.9)
    assert "effective sample size is falling (0.9)" in off[0][1] and "mismatch/ess, steps 1-20" in off[0][1]
    healthy = SignalMonitor(MonitorConfig(every=10))
    state.log_history = [{**r, "mismatch/ess": 1 - 1e-6} for r in state.log_history]
    healthy.on_log(SimpleNamespace(), state, None)
    assert healthy.warnings == []
