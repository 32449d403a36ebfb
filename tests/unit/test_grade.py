"""GRADE reward scaler: whitening, quantile tail clip, counterfactual centring, state, and the GRPO algebra."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.guards import reward_scaler
from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.base import RewardProcessor, Stateful
from steadyrl.guards.reward_scaler import EPS, GradeConfig, GradeScaler, prompt_key, soft_tail_clip

NAN = float("nan")


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_interfaces_and_config_validation():
    scaler = GradeScaler()
    assert isinstance(scaler, RewardProcessor) and isinstance(scaler, Stateful)
    assert scaler.config.quantile_every == 50 and scaler.config.window_size == 2048
    with pytest.raises(ValueError, match="tau must be in"):
        GradeConfig(tau=0.5)
    with pytest.raises(ValueError, match="warmup must be <= window_size=4, got 8"):
        GradeConfig(window_size=4, warmup=8)
    with pytest.raises(ValueError, match="does not divide"):
        scaler(t(1, 2, 3), ["a", "a", "a"], 2)
    with pytest.raises(ValueError, match="one per row"):
        scaler(t(1, 2), ["a"], 1)


def test_pass_through_before_warmup():
    scaler = GradeScaler(GradeConfig(window_size=16, warmup=8, clip_start=8))
    for _ in range(2):  # 0, then 4 values in the window: both below warmup
        r = t(0.3, -7.0, 1e6, 2.0)
        assert torch.equal(scaler(r, ["a", "a", "b", "b"], 2), r)
    assert scaler.kl_compensation() == 1.0
    assert scaler.metrics()["grade/window"] == 8.0
    # nothing on the raw scale leaks into the per-prompt baselines; the quantile window holds raw rewards
    assert scaler.state_dict()["baselines"] == []
    assert scaler.state_dict()["quantile_window"] == pytest.approx([0.3, -7.0, 1e6, 2.0] * 2)


def test_whitening_by_hand():
    scaler = GradeScaler(GradeConfig(window_size=4, warmup=4, clip_start=4, clip=False, centring_beta=0.0))
    assert torch.equal(scaler(t(1, 2, 3, 4), ["p"] * 4, 4), t(1, 2, 3, 4))  # window empty before this batch
    out = scaler(t(5, 0, 2.5, NAN), ["p"] * 4, 4)
    # window [1, 2, 3, 4] (this batch not yet in it): mean 2.5, unbiased std sqrt(5/3) = 1.2909944
    std = math.sqrt(5 / 3) + 1e-6
    assert out[:3].tolist() == pytest.approx([2.5 / std, -2.5 / std, 0.0], abs=1e-6)
    assert math.isnan(out[3].item())
    # kl compensation: raw std of [5, 0, 2.5] is 2.5, scaled std 2.5 / 1.2909944 -> ratio 1.2909944
    assert scaler.kl_compensation() == pytest.approx(std, abs=1e-5)
    assert scaler.metrics()["grade/window"] == 4.0
    # window now the last 4 finite raw values [4, 5, 0, 2.5]: mean 2.875,
    # squares of deviations 1.265625 + 4.515625 + 8.265625 + 0.140625 = 14.1875 -> var 14.1875 / 3
    out = scaler(t(4.875), ["p"], 1)
    assert out.item() == pytest.approx(2.0 / (math.sqrt(14.1875 / 3) + 1e-6), abs=1e-6)


def test_non_finite_never_enter_and_come_out_nan():
    scaler = GradeScaler(GradeConfig(window_size=8, warmup=2, clip_start=2, whiten=False))
    out = scaler(t(1.0, NAN, float("inf"), -float("inf")), ["a", "a", "b", "b"], 2)
    assert out[0].item() == 1.0 and torch.isnan(out[1:]).all()
    state = scaler.state_dict()
    assert state["raw_window"] == [1.0] and state["quantile_window"] == [1.0]
    assert state["baselines"] == [[prompt_key("a"), 1.0, 1]]  # b had no finite value: no baseline
    out = scaler(t(3.0, NAN, 2.0, float("inf")), ["a", "a", "b", "b"], 2)
    assert torch.isfinite(out[[0, 2]]).all() and torch.isnan(out[[1, 3]]).all()
    assert scaler.state_dict()["raw_window"] == [1.0, 3.0, 2.0]


def test_quantile_bounds_refresh_only_every_quantile_every_steps():
    cfg = GradeConfig(
        window_size=8,
        warmup=2,
        clip_start=2,
        quantile_window=8,
        quantile_every=3,
        tau=0.25,
        whiten=False,
        centring_beta=0.0,
    )
    scaler = GradeScaler(cfg)
    assert torch.equal(scaler(t(0, 1, 2, 3), ["p"] * 4, 4), t(0, 1, 2, 3))  # raw window empty < clip_start
    out = scaler(t(10, -10, 1.5, 2), ["p"] * 4, 4)
    # bounds from [0, 1, 2, 3]: q.25 at position 0.75 -> 0.75, q.75 at 2.25 -> 2.25 (linear interpolation)
    # tail: 2.25 + 0.1 * (10 - 2.25) = 3.025; 0.75 + 0.1 * (-10 - 0.75) = -0.325
    assert out.tolist() == pytest.approx([3.025, -0.325, 1.5, 2.0], abs=1e-6)
    assert scaler.state_dict()["bounds"] == [0.75, 2.25]
    assert scaler.metrics()["grade/clip_frac_low"] == 0.25 and scaler.metrics()["grade/clip_frac_high"] == 0.25
    scaler.step()
    scaler.step()
    # two steps since the refresh: bounds unchanged although the window now holds [0..3, 10, -10, 1.5, 2]
    out = scaler(t(0.5, 1, 1, 2), ["p"] * 4, 4)
    assert scaler.state_dict()["bounds"] == [0.75, 2.25]
    assert out.tolist() == pytest.approx([0.75 + 0.1 * (0.5 - 0.75), 1, 1, 2], abs=1e-6)
    scaler.step()  # third step: the next call refreshes from the window [10, -10, 1.5, 2, 0.5, 1, 1, 2]
    scaler(t(1.0), ["p"], 1)
    # sorted [-10, .5, 1, 1, 1.5, 2, 2, 10]: q.25 at 1.75 -> .5 + .75 * .5 = .875; q.75 at 5.25 -> 2
    assert scaler.state_dict()["bounds"] == pytest.approx([0.875, 2.0])
    scaler.step()
    scaler(t(1.0), ["p"], 1)
    assert scaler.state_dict()["bounds"] == pytest.approx([0.875, 2.0])  # one step only: no refresh


def test_tail_formula_by_hand():
    out = soft_tail_clip(torch.tensor([-3.0, 0.0, 5.0, NAN]), low=-1.0, high=2.0, slope=0.1)
    # -1 + 0.1 * (-3 + 1) = -1.2; 2 + 0.1 * (5 - 2) = 2.3
    assert out[:3].tolist() == pytest.approx([-1.2, 0.0, 2.3]) and math.isnan(out[3].item())
    assert torch.equal(soft_tail_clip(torch.tensor([-3.0, 5.0]), -1.0, 2.0, 0.0), torch.tensor([-1.0, 2.0]))


def test_centring_by_hand():
    scaler = GradeScaler(GradeConfig(whiten=False, clip=False, centring_beta=0.5))
    # first sight of a and b: no shift; baselines a = mean(1, 3) = 2, b = mean(10, 20) = 15
    assert torch.equal(scaler(t(1, 3, 10, 20), ["a", "a", "b", "b"], 2), t(1, 3, 10, 20))
    # a shifted by 0.5 * 2 = 1; c first seen: unshifted
    assert torch.equal(scaler(t(2, 4, 0, 1), ["a", "a", "c", "c"], 2), t(1, 3, 0, 1))
    # a's baseline uses the values before centring: mean(1, 3, 2, 4) = 2.5 -> shift 1.25
    assert torch.equal(scaler(t(0, 0), ["a", "a"], 2), t(-1.25, -1.25))
    # chat prompts are keyed by their JSON (dict key order does not matter)
    chat1 = [{"role": "user", "content": "hi"}]
    chat2 = [{"content": "hi", "role": "user"}]
    scaler(t(4, 6), [chat1, chat1], 2)
    assert torch.equal(scaler(t(5, 5), [chat2, chat2], 2), t(2.5, 2.5))  # 5 - 0.5 * 5


def test_lru_eviction_at_max_prompts(monkeypatch):
    monkeypatch.setattr(reward_scaler, "MAX_PROMPTS", 2)
    scaler = GradeScaler(GradeConfig(whiten=False, clip=False, centring_beta=1.0))
    scaler(t(1, 2), ["a", "b"], 1)
    scaler(t(3), ["c"], 1)  # LRU [a, b, c] -> evict a
    assert [k for k, _, _ in scaler.state_dict()["baselines"]] == [prompt_key("b"), prompt_key("c")]
    # a is new again (no shift); b is shifted by its baseline 2
    assert torch.equal(scaler(t(10, 10), ["a", "b"], 1), t(10, 8))
    # a inserted -> [b, c, a], b touched -> [c, a, b], evict c
    assert [k for k, _, _ in scaler.state_dict()["baselines"]] == [prompt_key("a"), prompt_key("b")]


def _stream(seed: int, n_batches: int, noise: float = 2.0, spread: float = 1.0) -> list[tuple[torch.Tensor, list[str]]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        ids = torch.randint(0, 5, (3,), generator=g).tolist()
        prompts = [f"p{i}" for i in ids for _ in range(4)]
        offsets = torch.tensor([spread * i for i in ids]).repeat_interleave(4)
        rewards = torch.randn(12, generator=g) * noise + offsets
        rewards[torch.rand(12, generator=g) < 0.1] = NAN
        batches.append((rewards, prompts))
    return batches


def test_state_round_trip_is_exact(monkeypatch):
    monkeypatch.setattr(reward_scaler, "MAX_PROMPTS", 3)
    cfg = GradeConfig(window_size=32, warmup=8, clip_start=16, quantile_window=24, quantile_every=2)
    stream = _stream(0, 16)
    a, b = GradeScaler(cfg), GradeScaler(cfg)
    outs_a, outs_b = [], []
    for i, (r, p) in enumerate(stream):
        outs_a.append(a(r, p, 4))
        a.step()
        if i < 8:
            outs_b.append(b(r, p, 4))
            b.step()
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    c = GradeScaler(cfg)
    c.load_state_dict(torch.load(buf))
    assert c.metrics() == b.metrics()
    for r, p in stream[8:]:
        outs_b.append(c(r, p, 4))
        c.step()
    for x, y in zip(outs_a, outs_b, strict=True):
        assert torch.equal(torch.isnan(x), torch.isnan(y))  # NaN rows in the same places
        assert torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))  # and bit-identical values elsewhere
    assert a.state_dict() == c.state_dict()
    assert a.state_dict()["bounds"] is not None and len(a.state_dict()["baselines"]) == 3  # all stages were live


def test_whitening_and_centring_cancel_under_group_scaling():
    """Per-prompt shift + shared affine map cancel in (r - group mean) / group std: only scale 'none' sees them.

    Exactly: a (r - m) / (a s + 1e-4) vs (r - m) / (s + 1e-4), so the only gap is TRL's epsilon, of order
    |adv| * 1e-4 * |1/a - 1| / s. The data keep the window std near 1 (a ~ 0.8) so that gap stays below 1e-4.
    """
    scaler = GradeScaler(GradeConfig(window_size=256, warmup=16, clip=False, centring_beta=0.7))
    for r, p in _stream(1, 12, noise=1.0, spread=0.4):  # past warmup, with baselines for (almost) every prompt
        scaler(r, p, 4)
    g = torch.Generator().manual_seed(2)
    raw = torch.randn(5, 4, generator=g) + 0.4 * torch.arange(5.0).unsqueeze(1) + 3.0
    prompts = [f"p{i}" for i in range(5) for _ in range(4)]
    window = torch.tensor(scaler.state_dict()["raw_window"], dtype=torch.float64)
    scaled = scaler(raw.reshape(-1), prompts, 4).reshape(5, 4)
    assert not torch.allclose(scaled, raw, atol=0.1)  # GRADE did change the rewards
    assert torch.allclose(
        group_normalized_advantages(scaled, "group"), group_normalized_advantages(raw, "group"), atol=1e-4
    )
    none_raw, none_scaled = group_normalized_advantages(raw, "none"), group_normalized_advantages(scaled, "none")
    assert (none_raw - none_scaled).abs().max() > 0.05
    # under "none" the centring shift still cancels, but the whitening sets the scale: 1 / (window std + eps)
    factor = 1.0 / (window.std().item() + 1e-6)
    assert torch.allclose(none_scaled, none_raw * factor, atol=1e-5)


batch_values = st.lists(
    st.one_of(st.floats(-1e12, 1e12, allow_nan=False, allow_infinity=False), st.just(NAN)), min_size=4, max_size=4
)


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(st.tuples(batch_values, st.sampled_from(["a", "b", "c"])), min_size=1, max_size=12))
def test_finite_inputs_give_finite_outputs(batches):
    cfg = GradeConfig(window_size=8, warmup=2, clip_start=3, quantile_window=6, quantile_every=1)
    scaler = GradeScaler(cfg)
    for values, prompt in batches:
        r = torch.tensor(values, dtype=torch.float32)
        out = scaler(r, [prompt, prompt, "z", "z"], 2)
        assert torch.equal(torch.isnan(out), torch.isnan(r))
        assert torch.isfinite(out[~torch.isnan(r)]).all()
        assert all(math.isfinite(v) or math.isnan(v) for v in scaler.metrics().values())
        scaler.step()


def _binary_batch(passes: int, size: int = 16) -> torch.Tensor:
    return torch.tensor([1.0] * passes + [0.0] * (size - passes))


def test_discrete_reward_is_never_clipped_while_its_pass_rate_rises():
    """A pass/fail reward has no tail: its bounds sit on its two values, and the whitening's drift (the pass rate
    rising from 25% to 75%) must not push the failing rows past a bound computed when they were the majority.

    Bounds from whitened values went stale exactly so (SmolLM2 runs: ``clip_frac_low`` 20-50% of the rows, the
    failing ones squashed to a tenth of their distance to the bound); bounds in raw space tie the values.
    """
    cfg = GradeConfig(
        window_size=64, warmup=16, clip_start=16, quantile_window=64, quantile_every=1000, centring_beta=0.0
    )
    scaler = GradeScaler(cfg)
    for passes in (4, 4, 4, 12, 12, 12, 12, 12):
        raw_window = torch.tensor(scaler.state_dict()["raw_window"], dtype=torch.float64)
        r = _binary_batch(passes)
        out = scaler(r, ["p"] * 16, 8)
        scaler.step()
        if len(raw_window) >= cfg.warmup:  # whitened, never clipped: exactly (r - mean) / (std + eps)
            expected = (r.double() - raw_window.mean()) / (raw_window.std() + EPS)
            assert torch.allclose(out.double(), expected, atol=1e-6)
            assert scaler.metrics()["grade/clip_frac_low"] == 0.0
            assert scaler.metrics()["grade/clip_frac_high"] == 0.0
    assert scaler.state_dict()["bounds"] == [0.0, 1.0]  # the 3% and 97% quantiles of the raw 0/1 window


def test_bounds_follow_the_whitening_of_the_same_window():
    """Clipping a whitened value at whitened bounds equals clipping the raw value at the raw window's quantiles:
    bound = whiten(raw quantile) with the statistics of this batch's whitening, not those of an older batch."""
    cfg = GradeConfig(
        window_size=8, warmup=4, clip_start=4, quantile_window=8, quantile_every=1000, tau=0.25, centring_beta=0.0
    )
    scaler = GradeScaler(cfg)
    scaler(t(0, 1, 2, 3), ["p"] * 4, 4)  # fills the windows, passes through (warmup)
    out = scaler(t(10, -10, 1.5, 2), ["p"] * 4, 4)
    # window [0, 1, 2, 3]: mean 1.5, std sqrt(5/3); raw bounds 0.75 and 2.25 -> whitened -0.58095, +0.58095
    s = math.sqrt(5 / 3) + 1e-6
    low, high = (0.75 - 1.5) / s, (2.25 - 1.5) / s
    assert scaler.state_dict()["bounds"] == [0.75, 2.25]
    assert out.tolist() == pytest.approx(
        [high + 0.1 * (8.5 / s - high), low + 0.1 * (-11.5 / s - low), 0.0, 0.5 / s], abs=1e-6
    )
    # next batch: the window is [0, 1, 2, 3, 10, -10, 1.5, 2] (mean 1.1875): the same raw bounds, whitened anew
    window = torch.tensor([0, 1, 2, 3, 10, -10, 1.5, 2], dtype=torch.float64)
    m, s2 = window.mean().item(), window.std().item() + 1e-6
    out = scaler(t(0.75, 2.25, 3.0), ["p"] * 3, 3)
    high2 = (2.25 - m) / s2
    assert out.tolist() == pytest.approx([(0.75 - m) / s2, high2, high2 + 0.1 * ((3.0 - m) / s2 - high2)], abs=1e-6)
    assert scaler.metrics()["grade/clip_frac_high"] == pytest.approx(1 / 3)  # 0.75 and 2.25 tie their bounds


def test_a_pre_release_state_is_refused_naming_both_versions():
    scaler = GradeScaler(GradeConfig())
    state = {k: v for k, v in scaler.state_dict().items() if k != "version"}  # version 1 had no version key
    with pytest.raises(ValueError, match=r"the GRADE reward scaler: .* format version 1, .* reads version 2 only"):
        scaler.load_state_dict(state)
