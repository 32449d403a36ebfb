"""GEPO robust (median/MAD, tanh-clipped) group advantages, against hand-computed values and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.base import AdvantageFunction
from steadyrl.guards.robust_advantage import (
    AdvantageConfig,
    GEPOAdvantage,
    nan_median,
    outlier_groups,
    robust_group_advantages,
)

NAN = float("nan")


def soft(x: float, c: float = 3.0) -> float:
    return c * math.tanh(x / c)


def test_small_group_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 10.0]])
    adv = robust_group_advantages(r)
    # median 3; |r - 3| = [2, 1, 0, 1, 7] -> sorted [0, 1, 1, 2, 7] -> MAD 1; scale = 1.4826 * 1 + 1e-8
    # raw = [-2, -1, 0, 1, 7] / 1.4826 -> 3 * tanh(raw / 3)
    scale = 1.4826 + 1e-8
    expected = [soft(d / scale) for d in (-2.0, -1.0, 0.0, 1.0, 7.0)]
    assert adv[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert adv[0, 4].item() == pytest.approx(2.7529, abs=1e-4)  # 7 / 1.4826 = 4.7214, 3 * tanh(1.5738)


def test_even_group_uses_true_median():
    r = torch.tensor([[0.0, 1.0, 3.0, 10.0]])
    # true median (1 + 3) / 2 = 2 (torch.median would say 1); |r - 2| = [2, 1, 1, 8] -> MAD (1 + 2) / 2 = 1.5
    assert nan_median(r, dim=1).item() == 2.0
    scale = 1.4826 * 1.5 + 1e-8
    expected = [soft(d / scale) for d in (-2.0, -1.0, 1.0, 8.0)]
    assert robust_group_advantages(r)[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_constant_group_is_exactly_zero():
    r = torch.tensor([[2.0, 2.0, 2.0, 2.0], [0.0, 0.0, NAN, 0.0], [1e12, 1e12, 1e12, 1e12]])
    assert torch.equal(robust_group_advantages(r), torch.zeros(3, 4))


def test_mad_zero_falls_back_to_mean_and_std():
    r = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = robust_group_advantages(r, mad_zero_centre="mean")
    # median 1; |r - 1| = [0, 0, 0, 1] -> MAD 0 but the group is not constant -> mean/std fallback
    # mean 0.75; unbiased var = (3 * 0.25^2 + 0.75^2) / 3 = 0.75 / 3 = 0.25 -> std 0.5; scale 0.5 + 1e-8
    # adv = [3 tanh(0.5 / 3)] * 3 + [3 tanh(-1.5 / 3)] = [0.4954] * 3 + [-1.3863]
    scale = 0.5 + 1e-8
    assert adv[0].tolist() == pytest.approx([soft(0.25 / scale)] * 3 + [soft(-0.75 / scale)], abs=1e-6)
    assert adv[0].tolist() == pytest.approx([0.4954, 0.4954, 0.4954, -1.3863], abs=1e-4)
    # without the fallback the scale would be 1e-8 and the minority would sit at the bound
    assert abs(adv[0, 3].item()) < 2.9


def test_mad_zero_median_centre_gives_the_majority_zero():
    """``mad_zero_centre: median`` (the default): std scale, median centre, the majority exactly 0."""
    adv = robust_group_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # adv = [0, 0, 0, 3 * tanh((-1 / 0.5) / 3)] = [0, 0, 0, -1.7483]
    assert adv[0, :3].tolist() == [0.0, 0.0, 0.0]
    assert adv[0, 3].item() == pytest.approx(-1.7483, abs=1e-4)
    assert torch.equal(GEPOAdvantage(outlier_z=0)(torch.tensor([[1.0, 1.0, 1.0, 0.0]])), adv)
    mean = GEPOAdvantage.from_config(AdvantageConfig(mad_zero_centre="mean", outlier_z=0))
    assert torch.equal(
        mean(torch.tensor([[1.0, 1.0, 1.0, 0.0]])),
        robust_group_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0]]), mad_zero_centre="mean"),
    )
    with pytest.raises(ValueError, match="mad_zero_centre must be one of mean, median, got 'mode'"):
        GEPOAdvantage(mad_zero_centre="mode")


@pytest.mark.parametrize("k", range(1, 8))
def test_pass_fail_groups_get_trls_advantages_soft_clipped(k):
    """0/1 rewards, k of 8 correct: with k != 4 the MAD is 0, and the advantage is TRL's (r - mean) / std, soft
    clipped; so a pass/fail reward is not centred on its majority (whose rows would train with exactly 0)."""
    r = torch.tensor([[1.0] * k + [0.0] * (8 - k)], dtype=torch.float64)
    mean, std = k / 8, math.sqrt(k * (8 - k) / 8 / 7)
    adv = robust_group_advantages(r, mad_zero_centre="mean")[0]
    if k == 4:  # median 0.5, MAD 0.5: the robust branch, scale 1.4826 * 0.5
        assert adv.tolist() == pytest.approx([soft(0.5 / (1.4826 * 0.5 + 1e-8))] * 4 + [soft(-0.5 / 0.7413)] * 4)
    else:
        assert adv.tolist() == pytest.approx(
            [soft((1 - mean) / (std + 1e-8))] * k + [soft(-mean / (std + 1e-8))] * (8 - k), abs=1e-9
        )
        assert abs(adv.sum().item()) < 0.5  # near zero-sum, where the median centre sums to -/+ the minority's


def test_nan_member_is_zero_and_excluded_from_stats():
    with_nan = robust_group_advantages(torch.tensor([[1.0, NAN, 3.0, 4.0]]))
    without = robust_group_advantages(torch.tensor([[1.0, 3.0, 4.0]]))
    # scorable {1, 3, 4}: median 3, |r - 3| = [2, 0, 1] -> MAD 1
    assert with_nan[0, 1].item() == 0.0
    assert torch.equal(with_nan[0, [0, 2, 3]], without[0])
    assert with_nan[0, 0].item() == pytest.approx(soft(-2.0 / 1.4826), abs=1e-6)
    inf = robust_group_advantages(torch.tensor([[1.0, float("inf"), 3.0, 4.0]]))
    assert torch.equal(inf, with_nan)  # ±inf is treated as unscorable too


def test_fewer_than_two_scorable_is_zero():
    r = torch.tensor([[5.0, NAN, NAN], [NAN, NAN, NAN], [1.0, 2.0, 3.0]])
    adv = robust_group_advantages(r)
    assert torch.equal(adv[:2], torch.zeros(2, 3))
    assert torch.isfinite(adv).all() and adv[2, 0].item() < 0 < adv[2, 2].item()


def test_invalid_clip_scale_raises():
    for bad in (2.4, 4.1, float("nan")):
        with pytest.raises(ValueError, match=r"clip_scale must be in \[2.5, 4.0\]"):
            robust_group_advantages(torch.zeros(1, 2), clip_scale=bad)
        with pytest.raises(ValueError, match=r"\[2.5, 4.0\]"):
            GEPOAdvantage(clip_scale=bad)
    robust_group_advantages(torch.zeros(1, 2), clip_scale=2.5)
    robust_group_advantages(torch.zeros(1, 2), clip_scale=4.0)


def test_class_matches_function_and_interface():
    fn = GEPOAdvantage(clip_scale=2.5)
    assert isinstance(fn, AdvantageFunction)
    # group 0: median 2.5, MAD 1, 40 is 37.5 / 1.4826 = 25.3 spreads out: robust; group 1: MAD 0: TRL's
    r = torch.tensor([[1.0, 2.0, 3.0, 40.0], [0.0, 1.0, 1.0, 1.0]])
    out = fn(r)
    assert fn.robust_groups == 1 and out.shape == r.shape and out.dtype == r.dtype
    assert torch.equal(out[0], robust_group_advantages(r, clip_scale=2.5)[0])
    assert torch.equal(out[1], group_normalized_advantages(r)[1])
    assert torch.equal(GEPOAdvantage(clip_scale=2.5, outlier_z=0)(r), robust_group_advantages(r, clip_scale=2.5))


def test_outlier_groups_by_hand():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 10.0], [1.0, 2.0, 3.0, 4.0, 30.0], [0.0, 0.0, 0.0, 0.0, 1e9]])
    # median 3, MAD 1: 10 is 7 / 1.4826 = 4.7 spreads out, 30 is 27 / 1.4826 = 18.2; MAD 0: no far outlier
    assert outlier_groups(r).tolist() == [False, True, False]
    assert outlier_groups(r, outlier_z=4.5).tolist() == [True, True, False]
    assert outlier_groups(r, outlier_z=0).tolist() == [True, True, True]
    nan = torch.tensor([[1.0, NAN, NAN, NAN], [1.0, 2.0, 3.0, float("inf")]])
    assert outlier_groups(nan, outlier_z=0).tolist() == [False, True]  # 2 finite rewards needed
    assert outlier_groups(nan).tolist() == [False, False]  # inf is unscorable, not an outlier
    for bad in (0.5, float("inf"), -1.0):
        with pytest.raises(ValueError, match="outlier_z must be 0"):
            GEPOAdvantage(outlier_z=bad)


def test_a_bounded_reward_keeps_trls_advantage_and_its_small_differences():
    """The SmolLM2 case: a 0.25-weight format reward on top of a 0/1 verifier. No far outlier, so GEPO gives TRL's
    advantage exactly; the robust rule would centre on 0.25 with scale 1.4826 * 0.125 and push both right answers
    into the tanh's flat end, where 1.25 is barely above 1.0."""
    r = torch.tensor([[0.0, 0.0, 0.25, 0.25, 0.25, 0.25, 1.0, 1.25]], dtype=torch.float64)
    fn = GEPOAdvantage()
    out = fn(r)
    assert fn.robust_groups == 0 and torch.equal(out, group_normalized_advantages(r))
    # mean 0.40625, unbiased std sqrt(sum (r - mean)^2 / 7) = sqrt(1.4921875 / 7) = 0.461698
    trl_gap = (1.25 - 1.0) / (math.sqrt(1.4921875 / 7) + 1e-4)
    assert out[0, 7] - out[0, 6] == pytest.approx(trl_gap, rel=1e-6) and trl_gap == pytest.approx(0.5414, abs=1e-4)
    robust = robust_group_advantages(r)[0]
    # (1.0 - 0.25) / 0.18533 = 4.047, (1.25 - 0.25) / 0.18533 = 5.396 -> 3 tanh(.): 2.6302, 2.8487
    assert robust[7] - robust[6] == pytest.approx(soft(1.0 / 0.185325) - soft(0.75 / 0.185325), abs=1e-6)
    assert robust[7] - robust[6] < 0.45 * trl_gap


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_groups_without_an_outlier_follow_trls_scale_rewards(scale_rewards):
    r = torch.tensor([[0.0, 1.0, 1.0, 0.5], [2.0, 0.0, 1.0, 1.0], [1.0, 2.0, 3.0, 300.0]])
    fn = GEPOAdvantage(scale_rewards=scale_rewards)
    out = fn(r)
    assert fn.robust_groups == 1
    assert torch.equal(out[:2], group_normalized_advantages(r, scale_rewards)[:2])
    assert torch.equal(out[2], robust_group_advantages(r)[2])


def test_saturation_stays_strictly_below_clip_scale():
    # (1e12 - 0) / (1.4826 * 0 ... ) -> the raw advantage is astronomically large and tanh rounds to 1.0
    for dtype in (torch.float32, torch.float64):
        r = torch.tensor([[0.0, 1.0, 2.0, 1e12]], dtype=dtype)
        adv = robust_group_advantages(r)
        assert adv.dtype == dtype
        assert 0 < 3.0 - adv[0, 3].item() < 1e-5


finite_reward = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False, allow_infinity=False)
groups = st.lists(
    st.one_of(
        st.lists(finite_reward, min_size=1, max_size=8),
        st.tuples(finite_reward, st.integers(1, 8)).map(lambda t: [t[0]] * t[1]),  # constant groups
        st.tuples(st.lists(st.sampled_from([0.0, 1.0]), min_size=2, max_size=7), finite_reward).map(
            lambda t: [*t[0], t[1]]  # 0/1 rewards with an arbitrary (possibly huge) outlier
        ),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(
    groups=groups, clip_scale=st.sampled_from([2.5, 3.0, 4.0]), dtype=st.sampled_from([torch.float32, torch.float64])
)
def test_any_finite_input_gives_bounded_finite_advantages(groups, clip_scale, dtype):
    width = max(len(g) for g in groups)
    r = torch.full((len(groups), width), NAN, dtype=dtype)  # ragged groups padded with unscorable NaN
    for i, g in enumerate(groups):
        r[i, : len(g)] = torch.tensor(g, dtype=dtype)
    adv = robust_group_advantages(r, clip_scale=clip_scale)
    assert adv.shape == r.shape and adv.dtype == dtype
    assert torch.isfinite(adv).all()
    assert (adv.abs() < clip_scale).all()
    assert (adv[torch.isnan(r)] == 0).all()


@settings(max_examples=100, deadline=None)
@given(others=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=5, max_size=5))
def test_single_huge_outlier_leaves_others_unchanged(others):
    """The property that really holds: compare [a, b, c, d, e, x] with [a, b, c, d, e, 1e9].

    Sorted s1..s5 of the five others, x = s5 + (s5 - s1) + 1. Both x and 1e9 are above s4, so in both groups
    the 3rd and 4th order statistics are s3, s4 and the median m = (s3 + s4) / 2 is the same. The deviation of
    x (and of 1e9) from m exceeds every |s_i - m| (x - m > s5 - s1 >= |s_i - m|), so the 3rd and 4th smallest
    deviations are the others' and the MAD is the same too. Hence, when that MAD > 0, the five others get
    identical advantages. When it is 0 the std fallback applies, and the std is *not* robust (see
    test_std_fallback_is_not_outlier_robust), so those cases are excluded.
    """
    s = sorted(others)
    x = s[4] + (s[4] - s[0]) + 1.0
    base = torch.tensor([[*others, x]])
    spiked = torch.tensor([[*others, 1e9]])
    m = nan_median(base, dim=1, keepdim=True)
    mad = nan_median((base - m).abs(), dim=1)
    if mad.item() == 0:
        return
    a, b = robust_group_advantages(base), robust_group_advantages(spiked)
    assert torch.allclose(a[0, :5], b[0, :5], atol=1e-6, rtol=0)
    assert 0 < b[0, 5].item() < 3.0


def test_std_fallback_is_not_outlier_robust():
    """Documented limitation: MAD == 0 -> std, and a huge outlier inflates it and mutes the minority; with the mean
    centre it also pushes the majority down together (the tanh still bounds the outlier)."""
    small = robust_group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 2.0]]), mad_zero_centre="mean")
    spiked = robust_group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 1e9]]), mad_zero_centre="mean")
    assert small[0, 4].item() < -1.0
    # mean 1e9 / 6, std 1e9 / sqrt(6): every other member (1 or 0) sits at about -1 / sqrt(6) = -0.408 before tanh
    assert spiked[0, :5].tolist() == pytest.approx([soft(-1 / math.sqrt(6))] * 5, abs=1e-6)
    assert 0 < spiked[0, 5].item() < 3.0
    median = robust_group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 1e9]]))
    assert median[0, :4].tolist() == [0.0] * 4 and -1e-6 < median[0, 4].item() < 0.0


def test_mad_zero_centre_from_the_config_reaches_the_advantage_function_and_a_bad_value_is_a_config_error():
    from pathlib import Path

    from steadyrl.config import ConfigError, load_config
    from steadyrl.trainers.layers import gepo_layer

    config = Path(__file__).resolve().parents[2] / "configs/tiny/grpo-guarded.yaml"
    every_group = ["guards.gepo.advantage.outlier_z=0"]
    cfg = load_config(config, ["guards.gepo.enabled=true", "guards.gepo.advantage.mad_zero_centre=mean", *every_group])
    fn = gepo_layer(cfg.guards.gepo)["advantage_fn"]
    r = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert fn.mad_zero_centre == "mean" and torch.equal(fn(r), robust_group_advantages(r, mad_zero_centre="mean"))
    assert gepo_layer(load_config(config).guards.gepo)["advantage_fn"].outlier_z == 10.0
    with pytest.raises(ConfigError, match=r"guards\.gepo\.advantage\.mad_zero_centre: mad_zero_centre must be one of"):
        load_config(config, ["guards.gepo.enabled=true", "guards.gepo.advantage.mad_zero_centre=mode"])
    with pytest.raises(ConfigError, match=r"guards\.gepo\.advantage\.outlier_z: outlier_z must be 0 .* got 0\.5"):
        load_config(config, ["guards.gepo.advantage.outlier_z=0.5"])
