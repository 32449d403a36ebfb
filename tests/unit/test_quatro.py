"""QUATRO: adaptive KL, entropy floor, rollout filters, masked advantages, replay buffer (hand-made inputs)."""

from __future__ import annotations

import dataclasses
import io
import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_rollout_filters import ReferenceRolloutFilter, ngrams, parrot_share, repeat_share

from steadyrl.guards import entropy_floor, rollout_filters
from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.base import Stateful
from steadyrl.guards.entropy_floor import EntropyConfig, EntropyFloor
from steadyrl.guards.kl_controller import TARGET_MIN, AdaptiveKL, KLConfig
from steadyrl.guards.replay import ReplayBuffer, ReplayConfig, replay_importance_ratio_sum
from steadyrl.guards.robust_advantage import robust_group_advantages
from steadyrl.guards.rollout_filters import (
    FILTER_REASONS,
    FilterConfig,
    LengthConfig,
    ParrotConfig,
    RepetitionConfig,
    RolloutFilter,
    ZeroVarianceConfig,
    ZScoreConfig,
    masked_group_advantages,
)

NAN = float("nan")
finite_or_nan = st.one_of(st.floats(min_value=0.0, max_value=10.0), st.just(NAN))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ------------------------------------------------------------------------------------------------ adaptive KL


def test_kl_validation_names_the_fix():
    with pytest.raises(ValueError, match=r"Set trainer.beta > 0"):
        AdaptiveKL(KLConfig(enabled=True), 0.0)
    with pytest.raises(ValueError, match=r"up must be finite and > 1.*down must be in \(0, 1\)"):
        KLConfig(up=1.0, down=1.0)
    with pytest.raises(ValueError, match="update_every must be >= 1"):
        KLConfig(update_every=0)
    with pytest.raises(ValueError, match=r"target must be finite and > 0 \(or 'auto'\), got 'aut'"):
        KLConfig(target="aut")
    with pytest.raises(ValueError, match=r"beta_range must be \[low, high\] with low <= 1 <= high, got \[2.0, 4.0\]"):
        KLConfig(beta_range=[2.0, 4.0])
    assert isinstance(AdaptiveKL(None, 0.04), Stateful)


def test_kl_proportional_update_clamped_per_step():
    kl = AdaptiveKL(KLConfig(enabled=True, target=0.02, beta_range=[0.25, 4.0]), beta0=0.04)
    assert (kl.beta, kl.factor, kl.target) == (0.04, 1.0, 0.02)
    assert kl.observe(0.03)  # KL / target = 1.5 -> clamped to up = 1.2
    assert kl.beta == 0.04 * 1.2 and kl.factor == 0.04 * 1.2 / 0.04
    kl.observe(0.018)  # 0.9: proportional inside [down, up]
    assert kl.beta == pytest.approx(0.04 * 1.2 * 0.9, rel=1e-12)
    kl.observe(0.002)  # 0.1 -> clamped to down = 0.8
    assert kl.beta == pytest.approx(0.04 * 1.2 * 0.9 * 0.8, rel=1e-12)
    before = kl.beta
    kl.observe(0.02)  # on target: unchanged
    assert kl.beta == before
    assert kl.metrics() == {
        "quatro/kl_coef": before,
        "quatro/kl_factor": before / 0.04,
        "quatro/kl_mean": 0.02,
        "quatro/kl_target": 0.02,
        "quatro/kl_nan": 0.0,
        "quatro/kl_at_max": 0.0,
        "quatro/kl_at_min": 0.0,
        "quatro/kl_bound_run": 0.0,
    }


def test_kl_auto_target_is_calibrated_from_the_runs_own_kl_at_the_users_beta():
    kl = AdaptiveKL(KLConfig(enabled=True, calibration_steps=4, target_ratio=2.0), beta0=0.04)
    assert kl.calibrating and math.isnan(kl.metrics()["quatro/kl_target"])
    for value in (0.01, 0.02, 0.03):
        assert not kl.observe(value)  # calibrating: beta stays at trainer.beta
        assert kl.beta == 0.04
    assert not kl.observe(0.05)  # the 4th value ends the window: target = 2 x mean(0.03, 0.05) = 0.08
    assert kl.target == pytest.approx(0.08) and not kl.calibrating and kl.beta == 0.04
    assert kl.observe(0.096)  # 0.096 / 0.08 = 1.2
    assert kl.beta == pytest.approx(0.048)
    floor = AdaptiveKL(KLConfig(enabled=True, calibration_steps=2), beta0=0.04)
    floor.observe(0.0)
    floor.observe(0.0)
    assert floor.target == TARGET_MIN == 1e-4  # a run whose KL is still 0 gets TARGET_MIN, not 0


def test_kl_default_bounds_are_relative_to_trainer_beta_and_saturation_is_counted():
    kl = AdaptiveKL(KLConfig(enabled=True, target=0.02), beta0=0.04)  # beta_range [1, 4] -> [0.04, 0.16]
    assert (kl.beta_min, kl.beta_max) == (0.04, 0.16)
    for _ in range(3):
        kl.observe(0.001)  # far below target: would lower beta, but never below the user's (idle: not counted)
    assert kl.beta == 0.04 and kl.at_min == 0 and kl.bound_run == 0
    for _ in range(10):
        kl.observe(1.0)  # runaway KL: x 1.2 per update up to 4 x trainer.beta
    assert kl.beta == pytest.approx(0.16) and kl.at_min == 0
    # 0.04 x 1.2^k passes 0.16 at k = 8: updates 8, 9, 10 wanted more than beta_max
    assert kl.at_max == 3 and kl.bound_run == 3
    m = kl.metrics()
    assert (m["quatro/kl_at_max"], m["quatro/kl_at_min"], m["quatro/kl_bound_run"]) == (3.0, 0.0, 3.0)
    kl.observe(0.02)
    assert kl.bound_run == 0


def test_kl_window_mean_nan_and_clamps():
    kl = AdaptiveKL(KLConfig(enabled=True, target=0.02, update_every=3, beta_range=[0.5, 1.1]), beta0=0.045)
    assert not kl.observe(0.01) and not kl.observe(NAN)
    assert kl.observe(0.05)  # window mean of the finite values (0.01 + 0.05) / 2 = 0.03 > 0.02
    assert kl.last_mean == (0.01 + 0.05) / 2 and kl.nan_count == 1
    assert kl.beta == pytest.approx(0.0495, rel=1e-12)  # 0.045 x 1.2 = 0.054 clamped to 1.1 x 0.045
    for value in (NAN, NAN, NAN):  # a window without a finite value changes nothing
        assert not kl.observe(value)
    assert kl.beta == pytest.approx(0.0495, rel=1e-12) and kl.nan_count == 4
    kl = AdaptiveKL(KLConfig(enabled=True, target=0.02, beta_range=[0.9, 4.0]), beta0=0.011)
    kl.observe(0.0)
    assert kl.beta == pytest.approx(0.0099, rel=1e-12) and kl.at_min == 1  # 0.0088 clamped up to 0.9 x 0.011


def test_kl_disabled_only_measures():
    kl = AdaptiveKL(KLConfig(enabled=False, target=0.02), beta0=0.04)
    kl.observe(1.0)
    assert kl.beta == 0.04 and kl.metrics()["quatro/kl_mean"] == 1.0


def test_kl_state_round_trip_mid_window_and_mid_calibration():
    a = AdaptiveKL(KLConfig(enabled=True, update_every=2, calibration_steps=3, beta_range=[0.5, 2.0]), beta0=0.04)
    for value in (0.05, 0.01, 0.1):
        a.observe(value)
    assert a.calibrating
    b = AdaptiveKL(KLConfig(enabled=True, update_every=2, calibration_steps=3, beta_range=[0.5, 2.0]), beta0=0.04)
    b.load_state_dict(roundtrip(a.state_dict()))
    for value in (0.001, NAN, 0.3, 0.2, 0.5, 0.01, 0.0, 0.4, 0.9):
        assert a.observe(value) == b.observe(value)
        assert a.beta == b.beta and str(a.state_dict()) == str(b.state_dict())  # str: NaN != NaN
    assert not a.calibrating and a.beta != 0.04
    with pytest.raises(ValueError, match=r"the QUATRO KL controller: .* format version 1, .* reads version 2 only"):
        b.load_state_dict({**a.state_dict(), "version": 1})


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=0.0, max_value=5.0), st.just(NAN)), max_size=60))
def test_kl_beta_stays_in_bounds(values):
    kl = AdaptiveKL(KLConfig(enabled=True, calibration_steps=3, beta_range=[0.25, 4.0]), beta0=0.04)
    for value in values:
        kl.observe(value)
        assert 0.01 - 1e-15 <= kl.beta <= 0.16 + 1e-15 and kl.factor == kl.beta / 0.04


# ---------------------------------------------------------------------------------------------- entropy floor


def test_entropy_floor_by_hand(monkeypatch):
    """The control u follows the gap in [0, 1]; the bonus is u x coef_max (hysteresis 1.1 here)."""
    monkeypatch.setattr(entropy_floor, "HYSTERESIS", 1.1)
    cfg = EntropyConfig(baseline_steps=2, floor_ratio=0.8, window=2, ki=2.4, kp=0.0, coef_max=0.03)
    f = EntropyFloor(cfg)
    assert isinstance(f, Stateful)
    f.observe(1.0)
    assert math.isnan(f.metrics()["quatro/entropy_floor"]) and f.baseline is None
    f.observe(1.0)
    assert (f.baseline, f.floor) == (1.0, 0.8)
    expected = [  # (entropy, window mean, active, control, at_cap)
        (0.6, 0.8, False, 0.0, 0),  # mean == floor: not below it; the integral has not started
        (0.6, 0.6, True, 0.6, 0),  # below: on; gap (0.8 - 0.6) / 0.8 = 0.25 -> 2.4 x 0.25
        (0.7, 0.65, True, 1.0, 1),  # + 2.4 x 0.1875 = 1.05 -> capped at 1, still below: counted
        (0.9, 0.8, True, 1.0, 1),  # at the floor: gap 0, the control holds; not above floor x 1.1: still on
        (0.95, 0.925, False, 0.625, 1),  # above 0.88: off; gap -0.15625 -> the control gives back 0.375
        (1.0, 0.975, False, 0.1, 1),  # gap -0.21875: -0.525
        (1.0, 1.0, False, 0.0, 1),  # gap -0.25: back to 0 (not below)
        (1.0, 1.0, False, 0.0, 1),  # off and at 0: the integral rests
    ]
    for value, mean, active, control, at_cap in expected:
        assert f.observe(value) is None
        assert f.window_mean() == pytest.approx(mean, abs=1e-12)
        assert (f.active, f.clip_scale(), f.at_cap) == (active, 0.5 if active else 1.0, at_cap)
        assert f.control == pytest.approx(control, abs=1e-12)
        assert f.bonus == pytest.approx(0.03 * control, abs=1e-12)
    assert f.metrics() == {
        "quatro/entropy": 1.0,
        "quatro/entropy_floor": 0.8,
        "quatro/entropy_bonus": 0.0,
        "quatro/entropy_control": 0.0,
        "quatro/floor_active": 0.0,
        "quatro/floor_held_off": 0.0,  # no reward observed: the learning gate never holds it off
        "quatro/moment_scale": 1.0,  # brake_moments (on by default): nobody asked for a rescale here
    }
    assert f.activations == 1


def _gated(monkeypatch, gate_z: float = 1.0, **extra) -> EntropyFloor:
    """Baseline 1.0 after one step, floor 0.8, window 1, gate over 4 steps (two halves of 2) at ``gate_z``."""
    monkeypatch.setattr(entropy_floor, "GATE_WINDOW", 4)
    monkeypatch.setattr(entropy_floor, "GATE_Z", gate_z)
    return EntropyFloor(EntropyConfig(floor_ratio=0.8, baseline_steps=1, window=1, **extra))


def test_learning_gate_by_hand(monkeypatch):
    """Halves (0.1, 0.2) and (0.5, 0.6): difference 0.4, unbiased variances 0.005 each, standard error
    sqrt(0.01 / 2) = 0.0707: rising. Halves (0.5, 0.6) and (0.5, 0.7): difference 0.05 < sqrt((0.005 + 0.02) / 2)."""
    f = _gated(monkeypatch)
    for r in (0.1, 0.2, 0.5):
        f.observe(1.0, r)
        assert not f.reward_rising()  # fewer than GATE_WINDOW rewards: no evidence
    f.observe(1.0, 0.6)
    assert f.reward_rising()
    for r in (0.5, 0.7):
        f.observe(1.0, r)
    assert not f.reward_rising()
    f.observe(1.0, math.nan)  # a step without a training reward keeps the window
    assert list(f._rewards) == [0.5, 0.6, 0.5, 0.7]
    assert not _gated(monkeypatch, learning_gate=False).reward_rising()


def test_floor_stays_off_while_the_reward_rises_and_acts_once_it_stalls(monkeypatch):
    """Entropy at 0.5, under the floor 0.8, from step 2 on. Before 4 rewards are known the floor decides on entropy
    alone (on); while the reward climbs it is held off (bonus 0, counted), until the window of 4 is flat; then it
    turns on as without the gate; when the reward climbs again it lets go. gate_z 0.9: (0.5, 0.5) against (0.5, x)
    is a difference of exactly one standard error, whatever x."""
    f = _gated(monkeypatch, gate_z=0.9)
    f.observe(1.0, 0.0)  # baseline
    steps = [  # (reward, active, held off): the window's halves decide, e.g. (0.3, 0.4) vs (0.5, 0.5) still rises
        (0.1, True, False), (0.2, True, False), (0.3, False, True), (0.4, False, True), (0.5, False, True),
        (0.5, False, True), (0.5, False, True), (0.5, True, False), (0.5, True, False), (0.9, False, True),
        (1.3, False, True),
    ]  # fmt: skip
    for reward, active, held in steps:
        f.observe(0.5, reward)
        assert (f.active, f.holding_off) == (active, held), reward
        assert (f.bonus == 0.0) == held and f.metrics()["quatro/floor_held_off"] == float(held)
    assert f.held_off == 7 and f.activations == 2 and f.integral == 0.0
    state = f.state_dict()
    again = _gated(monkeypatch, gate_z=0.9)
    again.load_state_dict(state)
    assert again.state_dict() == state and list(again._rewards) == [0.5, 0.5, 0.9, 1.3] and again.held_off == 7
    with pytest.raises(ValueError, match=r"the QUATRO entropy floor: .* format version 2, .* reads version 3 only"):
        again.load_state_dict({**state, "version": 2})  # a pre-release format is refused, not converted


def test_follow_learning_lowers_the_floor_only_while_the_reward_rises(monkeypatch):
    """Entropy falls 0.9 -> 0.5 while the reward climbs, then the reward stalls at 0.5. Floor 0.8 at first; from
    the first step the gate sees a rise (step 3: halves (0, 0.1) against (0.2, 0.3)) it follows 0.8 x the entropy
    down: 0.56, 0.48, 0.40, and stays there once the reward is flat, so entropy 0.5 is not asked back. Without
    ``follow_learning`` the floor stays at 0.8 and turns on as soon as the reward stalls. A later rise at a higher
    entropy never raises the floor. gate_z 0.9 as above."""
    seq = [(0.9, 0.1), (0.8, 0.2), (0.7, 0.3), (0.6, 0.4), (0.5, 0.5), (0.5, 0.5), (0.5, 0.5), (0.5, 0.5)]
    f, fixed = _gated(monkeypatch, gate_z=0.9, follow_learning=True), _gated(monkeypatch, gate_z=0.9)
    for g in (f, fixed):
        g.observe(1.0, 0.0)  # baseline 1.0, floor 0.8
    floors, active, fixed_active = [], [], []
    for entropy, reward in seq:
        f.observe(entropy, reward)
        fixed.observe(entropy, reward)
        floors.append(f.floor)
        active.append(f.active)
        fixed_active.append(fixed.active)
    assert floors == pytest.approx([0.8, 0.8, 0.56, 0.48, 0.40, 0.40, 0.40, 0.40])
    assert f.follows == 3 and not any(active) and f.held_off == 0
    assert fixed.floor == 0.8 and fixed_active[-1] and not any(fixed_active[:6])  # on once the reward is flat
    f.observe(0.3, 0.5)  # a fall that buys nothing meets the followed floor
    assert f.active and f.floor == pytest.approx(0.4)
    for reward in (0.7, 0.9):
        f.observe(0.9, reward)  # rising again, at a higher entropy: the floor stays
    assert f.floor == pytest.approx(0.4) and f.follows == 3
    again = _gated(monkeypatch, gate_z=0.9, follow_learning=True)
    again.load_state_dict(f.state_dict())
    assert again.state_dict() == f.state_dict() and again.floor == pytest.approx(0.4) and again.follows == 3
    with pytest.raises(ValueError, match=r"follow_learning moves the floor .* learning_gate is false"):
        EntropyConfig(follow_learning=True, learning_gate=False)


def test_without_the_gate_a_rising_reward_does_not_hold_the_floor_off(monkeypatch):
    f = _gated(monkeypatch, learning_gate=False)
    f.observe(1.0, 0.0)
    for r in (0.1, 0.2, 0.3, 0.4, 0.5):
        f.observe(0.5, r)
    assert f.active and f.held_off == 0 and "quatro/floor_held_off" not in f.metrics()


def test_entropy_bonus_grows_until_it_holds_then_gives_back():
    """A toy collapse: each step entropy falls by 0.05 and the bonus raises it by 2 x bonus. The default PI
    controller settles where the bonus cancels the pressure (0.025) with entropy at the floor, without the
    oscillation of an integral alone; once the pressure stops, the bonus goes back to 0."""
    f = EntropyFloor(
        EntropyConfig(floor_ratio=0.8, baseline_steps=1, window=1, coef_max=0.5)
    )  # ki 0.1, kp 0.4 of the control
    entropy = 1.0
    f.observe(entropy)  # floor 0.8
    trace = []
    for _ in range(300):
        entropy = entropy - 0.05 + 2 * f.bonus
        f.observe(entropy)
        trace.append(entropy)
    assert min(trace) > 0.7 and max(abs(h - 0.8) for h in trace[100:]) < 0.01
    assert f.bonus == pytest.approx(0.025, abs=1e-3)
    for _ in range(200):  # the pressure ends: entropy rises with the bonus, the bonus shrinks back to 0
        entropy = entropy + 2 * f.bonus
        f.observe(entropy)
    assert f.bonus == 0.0 and not f.active and entropy < 1.2


def test_entropy_still_falling_while_active_warns_to_lower_the_kl_target():
    f = EntropyFloor(EntropyConfig(floor_ratio=0.8, baseline_steps=1, window=2))
    f.observe(1.0)  # baseline 1, floor 0.8
    assert f.observe(0.5) is None and f.active  # window mean 0.75: on; reference 0.75
    assert f.observe(0.4) is None  # 1 step after activation
    warning = f.observe(0.3)  # 2 steps: window mean 0.35 < 0.75
    assert warning is not None and f.warning == warning and f.warnings == 1
    assert "guards.quatro.entropy.ki" in warning and "0.75 -> 0.35" in warning
    assert f.observe(0.6) is None and f.warning is None  # the next check compares with 0.35
    assert f.observe(0.6) is None and f.active  # 0.6 > 0.35: recovering, no warning; 0.6 < 0.84: still on


def test_entropy_nan_is_ignored_and_disabled_never_activates():
    f = EntropyFloor(EntropyConfig(floor_ratio=0.8, baseline_steps=1, window=1))
    f.observe(NAN)
    assert (f.nan_count, f.steps, f.baseline) == (1, 0, None)
    f.observe(1.0)
    f.observe(NAN)
    assert f.window_mean() == 1.0 and f.nan_count == 2
    off = EntropyFloor(EntropyConfig(floor_ratio=0.8, enabled=False, baseline_steps=1, window=1))
    for value in (1.0, 0.1, 0.01):
        off.observe(value)
    assert not off.active and off.bonus == 0.0 and off.floor == 0.8


def test_entropy_state_round_trip():
    cfg = EntropyConfig(floor_ratio=0.8, baseline_steps=3, window=4)
    a = EntropyFloor(cfg)
    for value in (2.0, 2.1, 1.9, 1.2, 1.1):
        a.observe(value)
    b = EntropyFloor(cfg)
    b.load_state_dict(roundtrip(a.state_dict()))
    for value in (1.0, 0.9, NAN, 2.5, 2.5, 2.5, 0.1):
        assert a.observe(value) == b.observe(value)
        assert a.metrics() == b.metrics() and a.clip_scale() == b.clip_scale()


@settings(max_examples=50, deadline=None)
@given(st.lists(finite_or_nan, max_size=80))
def test_entropy_bonus_stays_within_its_bounds(values):
    cfg = EntropyConfig(floor_ratio=0.8, baseline_steps=3, window=5, ki=0.2, kp=0.5, coef_max=0.01)
    f = EntropyFloor(cfg)
    for value in values:
        f.observe(value)
        assert 0.0 <= f.bonus <= 0.01 and math.isfinite(f.bonus)
        assert 0.0 <= f.control <= 1.0 and f.bonus == pytest.approx(0.01 * f.control, abs=1e-15)
        assert f.clip_scale() == (0.5 if f.active else 1.0)


def test_policy_gradient_brake_by_hand(monkeypatch):
    """pg_scale = 1 - control x pg_brake: 1 before the floor turns on, 1 - 0.6 x 0.5 = 0.7 at the first step under
    it (control ki x gap = 2.4 x 0.25), 0.5 at the cap, exactly 1 with the brake off (whatever the control) and
    while the learning gate holds the floor off (the control is back at 0)."""
    monkeypatch.setattr(entropy_floor, "HYSTERESIS", 1.1)
    cfg = dict(baseline_steps=2, floor_ratio=0.8, window=1, ki=2.4, kp=0.0)
    braked, unbraked = (
        EntropyFloor(EntropyConfig(pg_brake=0.5, **cfg)),
        EntropyFloor(EntropyConfig(pg_brake=0, **cfg)),
    )
    for f in (braked, unbraked):
        for value in (1.0, 1.0, 0.8):
            f.observe(value)
    assert braked.pg_scale == 1.0 and unbraked.pg_scale == 1.0  # at the floor, not below: off
    for f in (braked, unbraked):
        f.observe(0.6)
    assert braked.control == pytest.approx(0.6) and braked.pg_scale == pytest.approx(0.7, abs=1e-12)
    assert unbraked.control == pytest.approx(0.6) and unbraked.pg_scale == 1.0
    braked.observe(0.6)
    assert braked.control == 1.0 and braked.pg_scale == 0.5
    gated = _gated(monkeypatch, gate_z=0.9, pg_brake=1.0)
    gated.observe(1.0, 0.0)
    for reward in (0.1, 0.2):  # fewer than 4 rewards: on by entropy alone
        gated.observe(0.5, reward)
    assert gated.active and gated.pg_scale == pytest.approx(1.0 - gated.control) and gated.pg_scale < 1.0
    gated.observe(0.5, 0.3)  # the reward rises: held off, the control back to 0, the full policy gradient
    assert gated.holding_off and gated.control == 0.0 and gated.pg_scale == 1.0 and gated.bonus == 0.0


def test_brake_moments_follow_the_brake_by_hand(monkeypatch):
    """brake_moments 0.6 with pg_brake 0.5 (the floor of the brake test above): the moments' factor is
    max(pg_scale, 0.6) over the scale they follow. 1 at the floor; 0.7 at the first step under it (pg_scale 0.7);
    0.6 / 0.7 at the cap (pg_scale 0.5 is under 0.6); on the way out 0.8 / 0.6 (control 0.4) and 1 / 0.8. The
    factors multiply back to 1, so the moments end where the gradients are. Off: 1.0 every step, no metric."""
    monkeypatch.setattr(entropy_floor, "HYSTERESIS", 1.1)
    cfg = dict(baseline_steps=2, floor_ratio=0.8, window=1, ki=2.4, kp=0.0, pg_brake=0.5)
    floor, off = (
        EntropyFloor(EntropyConfig(brake_moments=0.6, **cfg)),
        EntropyFloor(EntropyConfig(brake_moments=0, **cfg)),
    )
    factors, scales = [], []
    for value in (1.0, 1.0, 0.8, 0.6, 0.6, 1.0, 1.0, 1.0):
        for f in (floor, off):
            f.observe(value)
        factors.append(floor.moment_rescale())
        scales.append(floor.metrics()["quatro/moment_scale"])
        assert off.moment_rescale() == 1.0 and "quatro/moment_scale" not in off.metrics()
    expected = [1.0, 1.0, 1.0, 0.7, 0.6 / 0.7, 0.8 / 0.6, 1.0 / 0.8, 1.0]
    assert factors == pytest.approx(expected, rel=1e-12)
    assert scales == pytest.approx([1.0, 1.0, 1.0, 0.7, 0.6, 0.8, 1.0, 1.0], rel=1e-12)
    assert math.prod(factors) == pytest.approx(1.0, rel=1e-12)
    state = floor.state_dict()
    floor.observe(0.6)
    assert floor.moment_rescale() == pytest.approx(0.7) and floor.moment_scale == pytest.approx(0.7)
    floor.load_state_dict(state)  # a resume (or a rollback) restores the scale the restored moments follow
    assert floor.moment_scale == 1.0


def test_scale_moments_is_the_state_of_scaled_gradients():
    """Adam fed gradients g for two steps, its moments then scaled by 0.25 and fed 0.25 x g, takes the same steps
    as an Adam fed 0.25 x g from the start: scale_moments gives the state Adam would hold had every gradient it
    averaged been that factor times as large (Adam is scale-invariant up to eps). exp_avg x 0.25, exp_avg_sq x
    0.0625. A bad factor is refused."""
    from steadyrl.guards.optimizer_state import scale_moments

    torch.manual_seed(0)
    grads = [torch.randn(3, 4) for _ in range(4)]
    w = [torch.nn.Parameter(torch.ones(3, 4)) for _ in range(2)]
    adams = [torch.optim.AdamW([p], lr=0.1, eps=1e-12, weight_decay=0.0) for p in w]
    for i, g in enumerate(grads):
        for j, (p, adam) in enumerate(zip(w, adams, strict=True)):
            p.grad = g * (0.25 if j == 1 or i >= 2 else 1.0)
            adam.step()
        if i == 1:
            state = adams[0].state[w[0]]
            before = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
            assert scale_moments(adams[0], 0.25) == 2
            assert torch.equal(state["exp_avg"], before[0] * 0.25)
            assert torch.equal(state["exp_avg_sq"], before[1] * 0.0625)
            assert torch.allclose(state["exp_avg"], adams[1].state[w[1]]["exp_avg"], rtol=1e-6)
    assert torch.allclose(w[0], w[1], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(w[0], torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"factor must be finite and > 0, got 0\.0"):
        scale_moments(adams[0], 0.0)


def test_entropy_defaults():
    c = EntropyConfig()
    assert (c.baseline_steps, c.floor_ratio, c.window, c.ki, c.kp) == (10, 0.15, 10, 0.1, 0.4)
    assert (c.coef_max, c.pg_brake, c.brake_moments) == (0.01, 1.0, 0.01)


def test_entropy_config_validation():
    with pytest.raises(ValueError, match=r"floor_ratio must be in \(0, 1\].*window must be >= 1"):
        EntropyConfig(floor_ratio=1.5, window=0)
    with pytest.raises(ValueError, match=r"pg_brake must be in \[0, 1\], got 1.5"):
        EntropyConfig(pg_brake=1.5)
    with pytest.raises(ValueError, match=r"coef_max and pg_brake are both 0: the floor has no lever"):
        EntropyConfig(coef_max=0.0, pg_brake=0.0)
    assert EntropyConfig(coef_max=0.0, pg_brake=1.0).pg_brake == 1.0  # the brake alone is a lever
    inert = EntropyFloor(
        EntropyConfig(floor_ratio=0.8, pg_brake=0.0, baseline_steps=1, window=1)
    )  # brake_moments 0.01: nothing
    for value in (1.0, 0.5, 0.4):  # to follow without the brake (pg_scale stays 1), so the moments stay as they are
        inert.observe(value)
        assert inert.control >= 0 and inert.pg_scale == 1.0 and inert.moment_rescale() == 1.0
    assert inert.control > 0
    with pytest.raises(ValueError, match=r"brake_moments must be in \[0, 1\), got 1.0"):
        EntropyConfig(pg_brake=1.0, brake_moments=1.0)


# ---------------------------------------------------------------------------------------------------- filters


def only(**changes) -> FilterConfig:
    """A FilterConfig with every filter off except the ones given."""
    off = {
        "zscore": ZScoreConfig(enabled=False),
        "length": LengthConfig(enabled=False),
        "parrot": ParrotConfig(enabled=False),
        "repetition": RepetitionConfig(enabled=False),
        "zero_variance": ZeroVarianceConfig(enabled=False),
    }
    off.update(changes)
    return FilterConfig(**off)


def test_ngram_measures_by_hand():
    assert ngrams([1, 2, 3], 2) == [(1, 2), (2, 3)] and ngrams([1], 2) == []
    prompt = [1, 2, 3, 4, 5, 6]
    assert parrot_share(prompt, [2, 3, 4, 5, 6, 9], 4) == 2 / 3  # (2345) (3456) in the prompt, (4569) not
    assert parrot_share(prompt, prompt, 4) == 1.0 and parrot_share(prompt, [1, 2], 4) == 0.0
    assert repeat_share([7, 7, 7, 7, 7], 3) == 1 - 1 / 3
    assert repeat_share([1, 2, 3, 1, 2, 3], 3) == 1 - 3 / 4
    assert repeat_share([1, 2], 3) == 0.0


def test_zscore_drops_only_the_outlier_and_ignores_nan():
    rewards = [0, 1, 0.5, 0] * 4 + [0, 1, 0.5, 40] + [NAN, 0, 1, 0.5]
    finite = [r for r in rewards if not math.isnan(r)]
    mean, std = statistics.fmean(finite), statistics.stdev(finite)
    assert (40 - mean) / std > 3.5 and all(abs(r - mean) / std < 3.5 for r in finite if r != 40)
    n = len(rewards)
    assert not RolloutFilter()(t(*rewards), [[100]] * n, [[i] for i in range(n)], 4).reasons["zscore"]  # off
    filters = FilterConfig(zscore=ZScoreConfig(enabled=True))
    result = RolloutFilter(filters)(t(*rewards), [[100]] * n, [[i] for i in range(n)], 4)
    assert result.keep.tolist() == [i != 19 for i in range(n)]
    assert result.reasons == dict.fromkeys(FILTER_REASONS, 0) | {"zscore": 1}
    assert list(result.reasons) == list(FILTER_REASONS) and result.warning is None
    assert result.zero_variance_groups.tolist() == [False] * 6


def test_zscore_keeps_a_rare_success_of_pass_fail_rewards(monkeypatch):
    rewards = t(*([0.0] * 19 + [1.0]))  # z of the success: 0.95 / 0.2236 = 4.25
    prompts, completions = [[1]] * 20, [[i] for i in range(20)]
    kept = RolloutFilter(only(zscore=ZScoreConfig(enabled=True)))(rewards, prompts, completions, 4)
    assert kept.keep.all()  # only 2 distinct values: the filter does not run
    monkeypatch.setattr(rollout_filters, "MIN_DISTINCT", 1)
    strict = RolloutFilter(only(zscore=ZScoreConfig(enabled=True)))(rewards, prompts, completions, 4)
    assert strict.keep.tolist() == [True] * 19 + [False]


def test_length_fixed_and_rolling_range(monkeypatch):
    filt = RolloutFilter(only(length=LengthConfig(min_tokens=2, max_tokens=4, rolling=False)))
    completions = [[1], [1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]]
    assert filt(t(0, 1, 0, 1), [[9]] * 4, completions, 2).keep.tolist() == [False, True, True, False]

    monkeypatch.setattr(rollout_filters, "LENGTH_FENCE", 0.0)  # the quartiles themselves (fences: their own test)
    monkeypatch.setattr(rollout_filters, "LENGTH_HISTORY", 10)
    monkeypatch.setattr(rollout_filters, "LENGTH_MIN_HISTORY", 4)
    cfg = LengthConfig(rolling=True)
    filt = RolloutFilter(only(length=cfg))
    completions = [[1] * n for n in (1, 2, 3, 4)]
    first = filt(t(0, 1, 0, 1), [[9]] * 4, completions, 2)
    assert first.keep.all() and filt.length_range() == (1.75, 3.25)  # history [1, 2, 3, 4], linear quantiles
    second = filt(t(0, 1, 0, 1), [[9]] * 4, completions, 2)
    assert second.keep.tolist() == [False, True, True, False] and second.reasons["length"] == 2

    restored = RolloutFilter(only(length=cfg))
    restored.load_state_dict(roundtrip(filt.state_dict()))
    third = [[1] * n for n in (2, 5, 1, 3)]
    assert (
        restored(t(0, 1, 0, 1), [[9]] * 4, third, 2).keep.tolist()
        == filt(t(0, 1, 0, 1), [[9]] * 4, third, 2).keep.tolist()
    )
    assert restored.state_dict() == filt.state_dict()


def test_a_parrot_is_judged_only_over_enough_ngrams():
    # a short answer restating the prompt's subject ("Noah has 16 pencils.") shares every one of its few 4-grams;
    # copying counts from PARROT_MIN_NGRAMS (8) 4-grams, i.e. 11 tokens, on
    prompt = list(range(100, 130))
    rows = [prompt[:8], prompt[:10], prompt[:11], prompt[3:20], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert [len(c) - 3 for c in rows] == [5, 7, 8, 14, 8] and rollout_filters.PARROT_MIN_NGRAMS == 8
    assert [parrot_share(prompt, c, 4) for c in rows] == [1.0, 1.0, 1.0, 1.0, 0.0]
    cfg = only(parrot=ParrotConfig(max_overlap=0.8))
    result = RolloutFilter(cfg)(t(1, 1, 1, 1, 0), [prompt] * 5, rows, 5)  # rows 0-3 above the group's mean
    assert result.keep.tolist() == [True, True, False, False, True] and result.reasons["parrot"] == 2
    assert ReferenceRolloutFilter(cfg)(t(1, 1, 1, 1, 0), [prompt] * 5, rows, 5).keep.tolist() == result.keep.tolist()


def test_parrot_repetition_and_reason_order(monkeypatch):
    monkeypatch.setattr(rollout_filters, "PARROT_MIN_NGRAMS", 1)  # short rows: the share rule alone (floor: below)
    p1, p2 = [1, 2, 3, 4, 5, 6], [1, 2, 3] * 3
    rows = [
        (p1, [2, 3, 4, 5, 6, 9]),  # parrot 2/3, repeat 0: kept
        (p1, [1, 2, 3, 4, 5, 6]),  # parrot 1: dropped
        (p1, [7, 7, 7, 7, 7]),  # repeat 1 - 1/3: dropped
        (p1, [1, 2, 3, 1, 2, 3]),  # repeat 1 - 3/4: kept
        (p2, [1, 2, 3] * 4),  # parrot 1 and repeat 1 - 3/10: counted under parrot, the earlier filter
        (p2, [1, 1, 1, 1, 1, 1]),  # parrot 0 ((1 1 1 1) is not in the prompt), repeat 1 - 1/4: dropped
    ]
    shares = [(parrot_share(p, c, 4), repeat_share(c, 3)) for p, c in rows]
    assert shares == [(2 / 3, 0.0), (1.0, 0.0), (0.0, 1 - 1 / 3), (0.0, 1 - 3 / 4), (1.0, 1 - 3 / 10), (0.0, 0.75)]
    cfg = only(parrot=ParrotConfig(max_overlap=0.7), repetition=RepetitionConfig(n=3, max_repeat_share=0.5))
    prompts, completions = [p for p, _ in rows], [c for _, c in rows]
    result = RolloutFilter(cfg)(t(0, 1, 1, 0, 1, 1), prompts, completions, 3)  # rows 1, 2, 4, 5 above the mean
    assert result.keep.tolist() == [True, False, False, True, False, False]
    assert (result.reasons["parrot"], result.reasons["repetition"]) == (2, 2)
    # below their group's mean the same rows keep their negative advantage: nothing to stop reinforcing
    unpaid = RolloutFilter(cfg)(t(1, 0, 0, 1, 0, 0), prompts, completions, 3)
    assert unpaid.keep.all() and unpaid.reasons["parrot"] == unpaid.reasons["repetition"] == 0
    nan_group = RolloutFilter(cfg)(t(NAN, NAN, NAN, 1, 0, 0), prompts, completions, 3)
    assert nan_group.keep.all()  # no finite reward: nothing is paid


def test_default_filters_keep_a_run_that_learns_shorter_answers():
    """SmolLM2 seed 1 (issue 39): 300 clipped 24-token completions, then the run learns 6-token answers. With the
    rolling length range on, its history's fences are 24 +- 3 tokens and every new answer is dropped; by default
    the range is off, and the z-score filter too, so nothing here is dropped."""
    cfg = FilterConfig()
    assert not cfg.length.rolling and not cfg.zscore.enabled
    filt, rolling = RolloutFilter(cfg), RolloutFilter(dataclasses.replace(cfg, length=LengthConfig(rolling=True)))
    long, short = [[7, 8, 9] * 8] * 8, [[4, 5, 6, 1, 2, 3]] * 8
    rewards = t(0, 1, 0, 1, 0, 1, 0, 1)
    for _ in range(40):
        filt(rewards, [[1]] * 8, long, 4)
        rolling(rewards, [[1]] * 8, long, 4)
    assert filt(rewards, [[1]] * 8, short, 4).keep.all()
    assert rolling.length_range() == (21.0, 27.0)
    assert not rolling(rewards, [[1]] * 8, short, 4).keep.any()


def test_zero_variance_groups_after_the_other_filters():
    rewards = t(1, 1, 0, 1, NAN, 1, 2, 2, 0, 5, 3, 3)
    completions = [[1, 2]] * 8 + [[1, 2], [], [1, 2], [1, 2]]
    cfg = only(length=LengthConfig(min_tokens=1, rolling=False), zero_variance=ZeroVarianceConfig())
    result = RolloutFilter(cfg)(rewards, [[0]] * 12, completions, 2)
    # groups: [1 1] equal; [0 1] signal; [NaN 1] one finite; [2 2] equal; [0 (5 dropped)] one left; [3 3] equal
    assert result.zero_variance_groups.tolist() == [True, False, True, True, True, True]
    assert result.keep.tolist() == [False, False, True, True] + [False] * 8
    assert result.reasons["length"] == 1 and result.reasons["zero_variance"] == 9
    # zero-variance rows keep advantage 0, as in plain GRPO: only the length drop counts for the warning (1 of 12)
    assert result.warning is None
    excluded = dataclasses.replace(cfg, dropped_rows="exclude")  # now they leave the loss normaliser: they count
    result = RolloutFilter(excluded)(rewards, [[0]] * 12, completions, 2)
    assert result.warning is not None and "dropped 10 of 12" in result.warning
    assert "guards.quatro.filters.max_drop_share=0.5" in result.warning and "zero_variance 9" in result.warning
    off = RolloutFilter(only())(rewards, [[0]] * 12, completions, 2)
    assert off.keep.all() and off.zero_variance_groups.tolist() == [True, False, True, True, False, True]
    assert result.metrics()["quatro/filtered/zero_variance"] == 9.0
    assert result.metrics()["quatro/filtered_share"] == 10 / 12 and result.metrics()["quatro/zero_variance_groups"] == 5


def test_filter_input_checks_and_tensor_token_ids():
    filt = RolloutFilter()
    with pytest.raises(ValueError, match="does not divide"):
        filt(t(1, 2, 3), [[1]] * 3, [[1]] * 3, 2)
    with pytest.raises(ValueError, match="one of each per row"):
        filt(t(1, 2), [[1]], [[1], [2]], 1)
    with pytest.raises(ValueError, match=r"invalid ParrotConfig: max_overlap must be in \[0, 1\], got 2.0"):
        FilterConfig(parrot=ParrotConfig(max_overlap=2.0))
    with pytest.raises(ValueError, match=r"invalid RepetitionConfig: n must be >= 1, got 0"):
        FilterConfig(repetition=RepetitionConfig(n=0))
    copied = torch.arange(1, 12)  # 11 tokens: 8 4-grams, all in the prompt
    result = filt(t(1, 0), [copied] * 2, [copied, torch.tensor([50])], 2)
    assert result.keep.tolist() == [False, False]  # parrot (paid), then the group has 1 member left
    assert result.reasons["parrot"] == 1 and result.reasons["zero_variance"] == 1


# ----------------------------------------------------------------------------------------- masked advantages


def test_masked_group_advantages_exact():
    rewards = t(1, 2, 3, 4, 5, 5, 9, 0, 1, 0, 1, NAN)
    keep = torch.tensor([1, 1, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    adv = masked_group_advantages(rewards, keep, 4, group_normalized_advantages)
    mean, std = 7 / 3, math.sqrt(7 / 3)  # kept [1, 2, 4]: unbiased variance (16 + 1 + 25) / 9 / 2 = 7 / 3
    mean3, std3 = 2 / 3, math.sqrt(1 / 3)  # kept [1, 0, 1] (NaN unscorable)
    expected = [(1 - mean) / (std + 1e-4), (2 - mean) / (std + 1e-4), 0.0, (4 - mean) / (std + 1e-4)]
    expected += [0.0] * 4  # one kept member: no signal
    expected += [(1 - mean3) / (std3 + 1e-4), (0 - mean3) / (std3 + 1e-4), (1 - mean3) / (std3 + 1e-4), 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-6)
    assert adv[2] == 0 and adv[4] == 0 and adv[11] == 0  # exactly zero
    robust = masked_group_advantages(rewards, keep, 4, robust_group_advantages)
    torch.testing.assert_close(robust[:4], robust_group_advantages(t(1, 2, NAN, 4).view(1, 4))[0].nan_to_num(0.0))
    assert robust[4:8].eq(0).all()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(finite_or_nan, st.booleans()), min_size=4, max_size=4).map(lambda x: x * 2))
def test_masked_advantages_are_finite_and_zero_on_dropped_rows(rows):
    rewards = t(*(r for r, _ in rows))
    keep = torch.tensor([k for _, k in rows])
    for fn in (group_normalized_advantages, robust_group_advantages):
        adv = masked_group_advantages(rewards, keep, 4, fn)
        assert torch.isfinite(adv).all() and adv[~keep].eq(0).all()


# ----------------------------------------------------------------------------------------------------- replay

PAD = 99


def make_batch(prompts: list[list[int]], completions: list[list[int]], advantages: list[float], ref: bool = True):
    """A TRL-shaped batch: prompts left-padded, completions right-padded, log-probs = -(token id) / 10."""
    pw, cw = max(map(len, prompts)), max(map(len, completions))
    batch = {
        "prompt_ids": torch.tensor([[PAD] * (pw - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (pw - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [PAD] * (cw - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (cw - len(c)) for c in completions]),
        "advantages": torch.tensor(advantages),
        "old_per_token_logps": torch.tensor([[-x / 10 for x in c] + [0.0] * (cw - len(c)) for c in completions]),
        "num_items_in_batch": torch.tensor(17),
    }
    if ref:
        batch["ref_per_token_logps"] = batch["old_per_token_logps"] - 1.0
        batch["ref_per_token_logps"][batch["completion_mask"] == 0] = 0.0
    return batch


def test_replay_stores_only_rows_with_a_learning_signal():
    buf = ReplayBuffer(ReplayConfig(), seed=0, pad_token_id=PAD)
    batch = make_batch([[1, 2], [3], [4], [5]], [[6, 7], [8], [9], [10]], [0.5, 0.0, -1e-7, -2.0])
    batch["completion_mask"][3] = 0  # masked out (e.g. filtered): no token, no gradient
    assert buf.add(batch, step=3) == 1 and len(buf) == 1  # row 0 only
    poisoned = make_batch([[1], [2], [3]], [[6, 7], [8, 9], [4]], [1.0, 1.0, 1.0])
    poisoned["old_per_token_logps"][0, 1] = float("nan")  # a policy that went NaN: never stored
    poisoned["ref_per_token_logps"][1, 0] = float("-inf")
    poisoned["old_per_token_logps"][2, 1] = float("nan")  # on a padding position (row 2 has 1 token): harmless
    assert buf.add(poisoned, step=4) == 1 and len(buf) == 2
    with pytest.raises(ValueError, match=r"old_per_token_logps.*sampling policy's log-probs"):
        buf.add({k: v for k, v in batch.items() if k != "old_per_token_logps"}, 5)
    with pytest.raises(ValueError, match=r"does not know how to pad the batch keys \['pixel_values'\]"):
        buf.add({**batch, "pixel_values": torch.zeros(4, 3)}, 5)
    assert isinstance(buf, Stateful)


def test_replay_fifo_by_micro_batch():
    buf = ReplayBuffer(ReplayConfig(capacity=2), seed=0, pad_token_id=PAD)
    for step, adv in enumerate((1.0, 2.0, 0.0)):  # the last micro-batch has no signal row but still counts
        buf.add(make_batch([[1]], [[2]], [adv]), step)
    assert len(buf._entries) == 2 and len(buf) == 1
    _, info = buf.mix(make_batch([[1]] * 4, [[2]] * 4, [0.0] * 4), step=5)
    assert info.ages == [4]  # the step-1 row; the step-0 row was evicted


def test_replay_mix_exact_padding_and_positions():
    buf = ReplayBuffer(ReplayConfig(replay_ratio=0.3), seed=0, pad_token_id=PAD)
    buf.add(make_batch([[1, 2, 3], [4]], [[5, 6, 7, 8], [9]], [1.5, 0.0]), step=2)  # stores row 0 only
    fresh = make_batch([[11], [12, 13]], [[14, 15], [16]], [-0.1, 0.05])
    fresh_copy = {k: v.clone() for k, v in fresh.items()}
    # round_half_up(0.3 x 2) = 1 row; the fresh row with the smallest |advantage| (row 1, 0.05) is replaced
    mixed, info = buf.mix(fresh, step=7)
    assert (info.replay_frac, info.replay_age_mean, info.indices, info.ages) == (0.5, 5.0, [1], [5])
    assert info.indices == [1] and info.metrics()["quatro/replay_frac"] == 0.5
    assert mixed["prompt_ids"].tolist() == [[PAD, PAD, 11], [1, 2, 3]]  # widened to 3, left-padded
    assert mixed["prompt_mask"].tolist() == [[0, 0, 1], [1, 1, 1]]
    assert mixed["completion_ids"].tolist() == [[14, 15, PAD, PAD], [5, 6, 7, 8]]  # widened to 4, right-padded
    assert mixed["completion_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    torch.testing.assert_close(mixed["advantages"], torch.tensor([-0.1, 1.5]))
    torch.testing.assert_close(
        mixed["old_per_token_logps"], torch.tensor([[-1.4, -1.5, 0, 0], [-0.5, -0.6, -0.7, -0.8]])
    )
    torch.testing.assert_close(
        mixed["ref_per_token_logps"], torch.tensor([[-2.4, -2.5, 0, 0], [-1.5, -1.6, -1.7, -1.8]])
    )
    assert mixed["num_items_in_batch"] is fresh["num_items_in_batch"]
    assert all(torch.equal(fresh[k], fresh_copy[k]) for k in fresh)  # the input batch is untouched


def test_replay_trims_stored_rows_and_replays_what_it_has():
    buf = ReplayBuffer(ReplayConfig(replay_ratio=0.3), seed=1, pad_token_id=PAD)
    buf.add(make_batch([[1], [2, 3, 4, 5]], [[6], [7, 8, 9, 10, 11]], [1.0, 0.0]), step=0)  # row 0, width 1+1
    fresh = make_batch([[21, 22]] * 10, [[23, 24, 25]] * 10, [float(i) for i in range(10)])
    mixed, info = buf.mix(fresh, step=1)
    assert info.indices == [0] and info.replay_frac == 0.1  # 3 wanted, 1 stored
    assert mixed["prompt_ids"].shape == (10, 2) and mixed["completion_ids"].shape == (10, 3)  # no widening needed
    assert mixed["prompt_ids"][0].tolist() == [PAD, 1] and mixed["completion_ids"][0].tolist() == [6, PAD, PAD]


def test_replay_fraction_is_the_configured_share():
    buf = ReplayBuffer(ReplayConfig(replay_ratio=0.3), seed=0, pad_token_id=PAD)
    for step in range(3):
        buf.add(make_batch([[1]] * 8, [[2, 3]] * 8, [float(i + 1) for i in range(8)]), step)
    for size, k in ((10, 3), (8, 2), (5, 2), (2, 1)):  # round half up: 2.4 -> 2, 1.5 -> 2, 0.6 -> 1
        mixed, info = buf.mix(make_batch([[4]] * size, [[5]] * size, [1.0] * size), step=3)
        assert len(info.indices) == k and info.replay_frac == k / size and mixed["advantages"].shape == (size,)
        assert info.indices == list(range(k))  # all |advantage| tie: the lowest indices are replaced
    assert buf.mix(make_batch([[4]], [[5]], [1.0]), 3)[1].indices == []  # 0.3 x 1 rounds to 0


def test_replay_key_mismatch_and_disabled():
    buf = ReplayBuffer(ReplayConfig(), seed=0, pad_token_id=PAD)
    buf.add(make_batch([[1]], [[2]], [1.0], ref=False), 0)
    with pytest.raises(ValueError, match="replay needs the same keys in every batch"):
        buf.mix(make_batch([[1]] * 4, [[2]] * 4, [0.0] * 4, ref=True), 1)
    off = ReplayBuffer(ReplayConfig(enabled=False), seed=0)
    batch = make_batch([[1]] * 4, [[2]] * 4, [1.0] * 4)
    assert off.add(batch, 0) == 0 and len(off) == 0
    mixed, info = off.mix(batch, 1)
    assert info.indices == [] and all(mixed[k] is batch[k] for k in batch)


def test_replay_per_token_advantages():
    buf = ReplayBuffer(ReplayConfig(replay_ratio=0.5), seed=0, pad_token_id=PAD)
    stored = make_batch([[1]], [[2, 3, 4]], [0.0])
    stored["advantages"] = torch.tensor([[0.0, 0.5, -0.25]])
    assert buf.add(stored, 0) == 1
    fresh = make_batch([[1], [1]], [[5], [6]], [0.0, 0.0])
    fresh["advantages"] = torch.tensor([[0.3], [0.1]])
    mixed, info = buf.mix(fresh, 2)
    assert info.indices == [1]
    assert mixed["advantages"].tolist() == [[0.30000001192092896, 0.0, 0.0], [0.0, 0.5, -0.25]]


def test_replay_ppo_rows_keep_values_and_returns_and_rank_by_mean_token_advantage():
    """PPO batches: (B, T) advantages, old_values and returns are right-padded with 0 like the completion; rows are
    ranked by the mean |token advantage| over their loss tokens (not the largest token)."""
    buf = ReplayBuffer(ReplayConfig(replay_ratio=0.5), seed=0, pad_token_id=PAD)
    stored = make_batch([[1]], [[2, 3, 4]], [0.0])
    stored["advantages"] = torch.tensor([[0.0, 0.5, -0.25]])
    stored["old_values"] = torch.tensor([[0.1, 0.2, 0.3]])
    stored["returns"] = torch.tensor([[1.0, 2.0, 3.0]])
    assert buf.add(stored, 0) == 1
    fresh = make_batch([[1], [1]], [[5, 6], [7]], [0.0, 0.0])
    # row 0: max 0.9 but mean 0.45; row 1: mean 0.5 -> row 0 carries less signal and is the one replaced
    fresh["advantages"] = torch.tensor([[0.9, 0.0], [0.5, 7.0]])  # row 1's second token is padding (mask 0)
    fresh["old_values"] = torch.tensor([[0.5, 0.5], [0.5, 0.0]])
    fresh["returns"] = torch.tensor([[1.5, 1.5], [1.5, 0.0]])
    mixed, info = buf.mix(fresh, 2)
    assert info.indices == [0]
    torch.testing.assert_close(mixed["old_values"], torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.0, 0.0]]))
    assert mixed["returns"].tolist() == [[1.0, 2.0, 3.0], [1.5, 0.0, 0.0]]
    assert mixed["advantages"].tolist() == [[0.0, 0.5, -0.25], [0.5, 7.0, 0.0]]


def test_replay_state_round_trip_gives_identical_mixes():
    cfg = ReplayConfig(capacity=3, replay_ratio=0.3)
    a = ReplayBuffer(cfg, seed=5, pad_token_id=PAD)
    for step in range(4):
        a.add(make_batch([[step, 1], [2]] * 3, [[3], [step, 4, 5]] * 3, [1.0, -1.0, 2.0, 0.0, 0.5, 3.0]), step)
    a.mix(make_batch([[7]] * 10, [[8]] * 10, [0.1] * 10), 4)  # advance the generator
    b = ReplayBuffer(cfg, seed=0, pad_token_id=PAD)
    b.load_state_dict(roundtrip(a.state_dict()))
    assert len(b) == len(a) and len(b._entries) == 3
    for step in (5, 6):
        fresh = make_batch([[7, 7]] * 10, [[8]] * 10, [float(i) for i in range(10)])
        (ma, ia), (mb, ib) = a.mix(fresh, step), b.mix(fresh, step)
        assert ia == ib and all(torch.equal(ma[k], mb[k]) for k in ma)


def replay_importance_ratio_mean(cur, old, mask, rows) -> float:
    total, count = replay_importance_ratio_sum(cur, old, mask, rows)
    return float(total / count) if count > 0 else math.nan


def test_replay_config_validation_and_importance_ratio_metric():
    with pytest.raises(ValueError, match=r"replay_ratio must be in \[0, 1\)"):
        ReplayConfig(replay_ratio=1.0)
    cur = torch.tensor([[0.0, math.log(2.0)], [math.log(4.0), 0.0]])
    old = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    assert replay_importance_ratio_mean(cur, old, mask, torch.tensor([True, False])) == pytest.approx(1.5)
    assert replay_importance_ratio_mean(cur, old, mask, torch.tensor([True, True])) == pytest.approx(7 / 3)
    assert math.isnan(replay_importance_ratio_mean(cur, old, mask, torch.tensor([False, False])))


def test_the_rolling_length_range_is_tukeys_far_out_fences(monkeypatch):
    """Quartiles 3 and 5 of the remembered lengths: fences 3 - 3 x 2 = -3 and 5 + 3 x 2 = 11, so a healthy run's
    usual spread is never cut; equal lengths still leave LENGTH_MIN_SPREAD (1 token) x 3 on each side."""
    monkeypatch.setattr(rollout_filters, "LENGTH_HISTORY", 8)
    monkeypatch.setattr(rollout_filters, "LENGTH_MIN_HISTORY", 4)
    filt = RolloutFilter(only(length=LengthConfig(rolling=True)))
    filt(t(0, 1, 0, 1), [[9]] * 4, [[1] * n for n in (3, 3, 5, 5)], 2)
    assert filt.length_range() == (-3.0, 11.0)
    kept = filt(t(0, 1, 0, 1, 0, 1), [[9]] * 6, [[1] * n for n in (1, 11, 12, 4, 3, 5)], 2).keep.tolist()
    assert kept == [True, True, False, True, True, True]  # only 12 tokens is far out
    same = RolloutFilter(only(length=LengthConfig(rolling=True)))
    same(t(0, 1, 0, 1), [[9]] * 4, [[1] * 4] * 4, 2)
    assert same.length_range() == (1.0, 7.0)
