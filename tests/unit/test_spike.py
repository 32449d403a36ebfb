"""GEPO spike detector: the robust baseline by hand, the ratio floor and the z-score, warm-up, non-finite, the
consecutive-skip stop, level shifts, state."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl.guards.spike import SpikeConfig, SpikeGuard, SpikeSkipError


def norm(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_baseline_and_threshold_by_hand():
    g = SpikeGuard(SpikeConfig(window=5, warmup_steps=3, min_ratio=10.0, z_threshold=2.0))
    for i, x in enumerate([1.0, math.e, math.e**2]):  # log norms 0, 1, 2
        assert not g.decide(norm(x), i).skip
    # median log norm 1, MAD 1 -> spread 1.4826; margin max(log 10 = 2.303, 2 x 1.4826 = 2.965)
    assert g.baseline == pytest.approx(math.e)
    assert g.threshold() == pytest.approx(math.exp(1 + 2 * 1.4826))
    assert not g.decide(norm(math.exp(1 + 2.9)), 3).skip  # ratio e^2.9 = 18 > 10, but z = 1.96 < 2
    assert g.last_z == pytest.approx(2.9 / 1.4826)
    # the log norms are now 0, 1, 2, 3.9: median 1.5, MAD 1
    assert g.threshold() == pytest.approx(math.exp(1.5 + 2 * 1.4826))
    d = g.decide(norm(math.exp(1.5 + 2 * 1.4826) * 1.01), 4)
    assert d.skip and d.reason == "spike"
    assert list(g.window) == pytest.approx([0.0, 1.0, 2.0, 3.9])  # the spike stayed out of the window
    assert (g.skipped, g.reasons, g.accepted) == (1, {"spike": 1}, 4)


def test_the_ratio_floor_holds_where_the_spread_is_tiny():
    g = SpikeGuard(SpikeConfig(warmup_steps=2, min_ratio=100.0, z_threshold=10.0))
    for i in range(20):
        g.decide(norm(1.0 + 1e-6 * i), i)  # almost constant: z of a 2x step is huge
    assert not g.decide(norm(50.0), 20).skip  # z >> 10 but 50 < 100 x the median
    assert g.decide(norm(200.0), 21).skip


def test_warm_up_has_the_ratio_floor_only_from_the_first_norm():
    g = SpikeGuard(SpikeConfig(warmup_steps=10, min_ratio=100.0))
    assert not g.decide(norm(1e6), 0).skip  # no baseline yet: nothing to compare with
    g = SpikeGuard(SpikeConfig(warmup_steps=10, min_ratio=100.0))
    g.decide(norm(1.0), 0)
    assert not g.decide(norm(90.0), 1).skip and math.isnan(g.last_z)  # in warm-up: no z-score, under the floor
    assert g.decide(norm(1e4), 2).skip  # a x1e4 gradient at the third step is caught: 1e4 > 100 x median(1, 90)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_skipped_even_before_any_baseline(bad):
    g = SpikeGuard()
    d = g.decide(norm(bad), 0)
    assert d.skip and d.reason == "nonfinite" and g.baseline is None and g.accepted == 0


def test_the_nonfinite_only_guard_has_no_spike_test():
    g = SpikeGuard(SpikeConfig(min_ratio=math.inf))
    g.decide(norm(1.0), 0)
    assert not g.decide(norm(1e30), 1).skip and g.metrics() == {} and not g.window
    assert g.decide(norm(float("nan")), 2).skip


def test_consecutive_skips_stop_with_a_clear_error():
    g = SpikeGuard(SpikeConfig(max_consecutive_skips=3))
    g.decide(norm(float("nan")), 7)
    g.decide(norm(float("nan")), 8)
    with pytest.raises(SpikeSkipError, match=r"step 9: 3 optimizer steps in a row were skipped \(last: nonfinite"):
        g.decide(norm(float("nan")), 9)


def test_an_accepted_step_resets_the_consecutive_count():
    g = SpikeGuard(SpikeConfig(max_consecutive_skips=2))
    g.decide(norm(float("nan")), 0)
    g.decide(norm(1.0), 1)
    g.decide(norm(float("nan")), 2)  # would raise if the count had not been reset
    assert g.consecutive == 1


def test_state_round_trip_gives_identical_decisions():
    stream = [1.0, 2.0, 1.5, float("nan"), 300.0, 1.2, 400.0, 1.1]
    a = SpikeGuard(SpikeConfig(warmup_steps=2))
    for i, x in enumerate(stream[:4]):
        a.decide(norm(x), i)
    b = SpikeGuard(SpikeConfig(warmup_steps=2))
    b.load_state_dict(a.state_dict())
    rest = [(a.decide(norm(x), i), b.decide(norm(x), i)) for i, x in enumerate(stream[4:], start=4)]
    assert all(x == y for x, y in rest)
    assert a.state_dict() == b.state_dict()
    assert [d.skip for d, _ in rest] == [True, False, True, False]


def test_an_old_checkpoint_format_is_refused_by_name():
    with pytest.raises(ValueError, match="the GEPO spike guard: the checkpoint's state has format version 1"):
        SpikeGuard().load_state_dict({"ema": 1.0, "accepted": 3})


@pytest.mark.parametrize(("key", "value"), [("window", 1), ("min_ratio", 1.0), ("z_threshold", 0.0)])
def test_invalid_settings_are_refused(key, value):
    with pytest.raises(ValueError, match=key):
        SpikeConfig(**{key: value})


def test_zero_gradient_stretch_does_not_lock_out_healthy_steps():
    # 100 zero-gradient steps (every group zero-variance) and then healthy norms of 8
    g = SpikeGuard(SpikeConfig(warmup_steps=10))
    for i in range(10):
        g.decide(norm(8.0), i)
    window = list(g.window)
    for i in range(10, 110):
        assert not g.decide(norm(0.0), i).skip  # no signal: proceeds
    assert list(g.window) == window and g.accepted == 10 and g.zero_steps == 100  # and stays out of the baseline
    assert not any(g.decide(norm(8.0), i).skip for i in range(110, 130))
    assert g.skipped == 0 and g.metrics()["gepo/zero_grad_steps"] == 100.0


def test_a_level_shift_rebases_after_rebase_after_spikes_in_a_row():
    g = SpikeGuard(SpikeConfig(warmup_steps=1, min_ratio=10.0, z_threshold=1.0, rebase_after=3))
    g.decide(norm(0.5), 0)  # median 0.5: every norm above 5 is now a spike
    assert g.decide(norm(40.0), 1).skip
    assert g.decide(norm(20.0), 2).skip
    d = g.decide(norm(30.0), 3)  # 3rd in a row: a new level, not a spike
    assert not d.skip and g.baseline == pytest.approx(30.0) and g.rebases == 1  # the window is 40, 20, 30
    assert (g.skipped, g.consecutive) == (2, 0)
    assert not g.decide(norm(25.0), 4).skip  # the new normal
    m = g.metrics()
    assert m["gepo/spike_rebases"] == 1.0 and m["gepo/spike_median"] == pytest.approx(math.sqrt(25 * 30))


def test_a_streak_above_max_ratio_is_never_a_level_shift_and_stops_the_run():
    # x1e4 on every step from step 10 on (a poisoned data shard): always skipped, never the new baseline
    cfg = SpikeConfig(warmup_steps=1, min_ratio=10.0, max_ratio=1000.0, rebase_after=3, max_consecutive_skips=6)
    g = SpikeGuard(cfg)
    for i in range(10):
        g.decide(norm(1.0), i)
    assert all(g.decide(norm(1e4), i).skip for i in range(10, 15)) and g.rebases == 0
    with pytest.raises(SpikeSkipError, match="6 optimizer steps in a row were skipped"):
        g.decide(norm(1e4), 15)
    # a level shift is read from the last rebase_after (3) spikes: 2000 (above 1000 x the median) is never one of them
    g = SpikeGuard(SpikeConfig(warmup_steps=1, min_ratio=10.0, max_ratio=1000.0, rebase_after=3))
    g.decide(norm(1.0), 0)
    assert [g.decide(norm(x), i).skip for i, x in enumerate([999.0, 2000.0, 500.0, 600.0, 700.0], 1)] == [
        True,
        True,
        True,
        True,
        False,  # the 3 in a row from 500 on: a level shift
    ]
    assert g.rebases == 1 and g.baseline == pytest.approx(600.0)


def test_a_single_spike_between_healthy_steps_is_still_skipped_and_streaks_reset():
    g = SpikeGuard(SpikeConfig(warmup_steps=1, min_ratio=10.0, rebase_after=2))
    g.decide(norm(1.0), 0)
    assert g.decide(norm(100.0), 1).skip
    assert not g.decide(norm(1.0), 2).skip  # healthy: the spike streak restarts
    assert g.decide(norm(100.0), 3).skip and g.rebases == 0
    assert g.decide(norm(float("nan")), 4).skip  # a non-finite norm breaks a spike streak too
    assert g.decide(norm(100.0), 5).skip and g.rebases == 0
    off = SpikeGuard(SpikeConfig(warmup_steps=1, min_ratio=10.0, rebase_after=0, max_consecutive_skips=50))
    off.decide(norm(1.0), 0)
    assert all(off.decide(norm(100.0), i).skip for i in range(1, 30)) and off.rebases == 0


def test_rebase_state_round_trip_mid_streak():
    cfg = SpikeConfig(warmup_steps=1, min_ratio=10.0, rebase_after=3)
    a = SpikeGuard(cfg)
    for i, x in enumerate([1.0, 50.0, 60.0]):
        a.decide(norm(x), i)
    b = SpikeGuard(cfg)
    b.load_state_dict(a.state_dict())
    assert not a.decide(norm(70.0), 3).skip and not b.decide(norm(70.0), 3).skip
    assert a.state_dict() == b.state_dict() and b.baseline == pytest.approx(60.0)


def test_invalid_rebase():
    with pytest.raises(ValueError, match=r"rebase_after=1 must be 0 \(off\) or >= 2"):
        SpikeConfig(rebase_after=1)


def test_a_noisy_window_never_lifts_the_threshold_past_max_ratio():
    g = SpikeGuard(SpikeConfig(warmup_steps=4, min_ratio=10.0, z_threshold=6.0, max_ratio=1000.0))
    for i, x in enumerate([1.0, 5.0, 0.2, 1.0, 5.0, 0.2, 1.0]):  # spread 1.4826 x log 5 = 2.39: z x spread = 14.3
        assert not g.decide(norm(x), i).skip
    assert g.baseline == 1.0 and g.threshold() == pytest.approx(1000.0)  # e^14.3 capped at 1000
    assert g.decide(norm(1001.0), 7).skip
    with pytest.raises(ValueError, match=r"max_ratio=50.0 must be >= min_ratio=100.0"):
        SpikeConfig(max_ratio=50.0)
