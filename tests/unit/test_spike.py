"""GEPO spike detector: EMA by hand, warmup, both thresholds, non-finite, consecutive-skip stop, state."""

from __future__ import annotations

import pytest
import torch

from steadyrl.guards.spike import SpikeConfig, SpikeGuard, SpikeSkipError


def norm(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_ema_by_hand_and_skipped_norms_stay_out():
    g = SpikeGuard(SpikeConfig(ema_decay=0.5, warmup_steps=2, spike_factor=5.0, abs_threshold=5.0))
    assert not g.decide(norm(2.0), 0).skip  # ema = 2
    assert not g.decide(norm(4.0), 1).skip  # ema = 0.5*2 + 0.5*4 = 3
    assert g.ema == 3.0
    d = g.decide(norm(16.0), 2)  # 16 > 5*3 and 16 > 5
    assert d.skip and d.reason == "spike"
    assert g.ema == 3.0  # the spike did not enter the EMA
    assert not g.decide(norm(14.0), 3).skip  # 14 < 15: accepted, ema = 8.5
    assert g.ema == 8.5
    assert (g.skipped, g.reasons) == (1, {"spike": 1})


def test_no_relative_skip_during_warmup_or_below_the_absolute_threshold():
    g = SpikeGuard(SpikeConfig(ema_decay=0.9, warmup_steps=3, spike_factor=5.0, abs_threshold=5.0))
    assert not g.decide(norm(0.1), 0).skip
    assert not g.decide(norm(100.0), 1).skip  # still in warmup: accepted
    g = SpikeGuard(SpikeConfig(ema_decay=0.9, warmup_steps=1, spike_factor=5.0, abs_threshold=5.0))
    g.decide(norm(0.1), 0)
    assert not g.decide(norm(4.0), 1).skip  # 40x the EMA but under abs_threshold


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_skipped_even_in_warmup(bad):
    g = SpikeGuard()
    d = g.decide(norm(bad), 0)
    assert d.skip and d.reason == "nonfinite" and g.ema is None and g.accepted == 0


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
    stream = [1.0, 2.0, 1.5, float("nan"), 30.0, 1.2, 40.0, 1.1]
    a = SpikeGuard(SpikeConfig(warmup_steps=2))
    for i, x in enumerate(stream[:4]):
        a.decide(norm(x), i)
    b = SpikeGuard(SpikeConfig(warmup_steps=2))
    b.load_state_dict(a.state_dict())
    rest = [(a.decide(norm(x), i), b.decide(norm(x), i)) for i, x in enumerate(stream[4:], start=4)]
    assert all(x == y for x, y in rest)
    assert a.state_dict() == b.state_dict()
    assert [d.skip for d, _ in rest] == [True, False, True, False]


def test_invalid_decay():
    with pytest.raises(ValueError, match=r"ema_decay=1.0 must be in \(0, 1\)"):
        SpikeGuard(SpikeConfig(ema_decay=1.0))


def test_zero_gradient_stretch_does_not_lock_out_healthy_steps():
    # the reproduction: 100 zero-gradient steps (every group zero-variance) and then healthy norms of 8
    g = SpikeGuard(SpikeConfig(ema_decay=0.98, warmup_steps=10, spike_factor=5.0, abs_threshold=5.0))
    for i in range(10):
        g.decide(norm(8.0), i)
    ema = g.ema
    for i in range(10, 110):
        assert not g.decide(norm(0.0), i).skip  # no signal: proceeds
    assert g.ema == ema and g.accepted == 10 and g.zero_steps == 100  # and stays out of the baseline
    assert not any(g.decide(norm(8.0), i).skip for i in range(110, 130))
    assert g.skipped == 0 and g.metrics()["gepo/zero_grad_steps"] == 100.0


def test_a_level_shift_rebases_after_rebase_after_spikes_in_a_row():
    g = SpikeGuard(SpikeConfig(ema_decay=0.5, warmup_steps=1, spike_factor=5.0, abs_threshold=5.0, rebase_after=3))
    g.decide(norm(0.5), 0)  # ema 0.5: every norm above 5 is now a spike
    assert g.decide(norm(40.0), 1).skip
    assert g.decide(norm(20.0), 2).skip
    d = g.decide(norm(30.0), 3)  # 3rd in a row: a new level, not a spike
    assert not d.skip and g.ema == 30.0 and g.rebases == 1  # median of 40, 20, 30
    assert (g.skipped, g.consecutive) == (2, 0)
    assert not g.decide(norm(25.0), 4).skip  # the new normal
    assert g.metrics() == {"gepo/zero_grad_steps": 0.0, "gepo/spike_rebases": 1.0, "gepo/spike_ema": 27.5}


def test_a_single_spike_between_healthy_steps_is_still_skipped_and_streaks_reset():
    g = SpikeGuard(SpikeConfig(ema_decay=0.5, warmup_steps=1, rebase_after=2))
    g.decide(norm(1.0), 0)
    assert g.decide(norm(100.0), 1).skip
    assert not g.decide(norm(1.0), 2).skip  # healthy: the spike streak restarts
    assert g.decide(norm(100.0), 3).skip and g.rebases == 0
    assert g.decide(norm(float("nan")), 4).skip  # a non-finite norm breaks a spike streak too
    assert g.decide(norm(100.0), 5).skip and g.rebases == 0
    off = SpikeGuard(SpikeConfig(ema_decay=0.5, warmup_steps=1, rebase_after=0, max_consecutive_skips=50))
    off.decide(norm(1.0), 0)
    assert all(off.decide(norm(100.0), i).skip for i in range(1, 30)) and off.rebases == 0


def test_rebase_state_round_trip_mid_streak():
    cfg = SpikeConfig(ema_decay=0.5, warmup_steps=1, rebase_after=3)
    a = SpikeGuard(cfg)
    for i, x in enumerate([1.0, 50.0, 60.0]):
        a.decide(norm(x), i)
    b = SpikeGuard(cfg)
    b.load_state_dict(a.state_dict())
    assert not a.decide(norm(70.0), 3).skip and not b.decide(norm(70.0), 3).skip
    assert a.state_dict() == b.state_dict() and b.ema == 60.0


def test_invalid_rebase():
    with pytest.raises(ValueError, match=r"rebase_after=1 must be 0 \(off\) or >= 2"):
        SpikeGuard(SpikeConfig(rebase_after=1))
