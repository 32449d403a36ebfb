"""OPEFO: exp_avg_sq floor by hand and sampled, error feedback schedule/rescale/merge/state, rank splits, rollback."""

from __future__ import annotations

import io
import math
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from steadyrl.guards.error_feedback import ErrorFeedback, ErrorFeedbackConfig
from steadyrl.guards.moment_floor import FloorConfig, SecondMomentFloor
from steadyrl.guards.opefo import OpefoConfig
from steadyrl.guards.optimizer_state import distributed_ops, optimizer_state_finite
from steadyrl.guards.rollback import RollbackConfig, RollbackLimitError, RollbackPolicy, SnapshotStore

NAN, INF = float("nan"), float("inf")

ON = ErrorFeedbackConfig(enabled=True)  # off by default (docs/DESIGN.md, "OPEFO: error feedback")


# ------------------------------------------------------------------------------------------------- helpers


class FakeRanks:
    """``world`` ranks as threads; reduce_sum / all_gather meet at a barrier and combine in rank order."""

    def __init__(self, world: int = 2) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[Any] = [None] * world

    def _exchange(self, rank: int, t: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]):
        self.slots[rank] = t.clone()
        self.barrier.wait()
        out = combine(list(self.slots))
        self.barrier.wait()
        return out

    def reduce_sum(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            return self._exchange(rank, t, lambda ts: sum(ts[1:], ts[0].clone()))

        return fn

    def all_gather(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda t: self._exchange(rank, t, torch.cat)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as exc:  # re-raised in the test thread
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return results


def adamw_with_v(
    *groups: list[list[float]] | list[torch.Tensor], dtype: torch.dtype = torch.float32
) -> torch.optim.AdamW:
    """A real AdamW after one step, one param group per argument, each param's exp_avg_sq set to the given list and
    its exp_avg consistent with it (sqrt(v), a healthy ratio of 1), except where v is 0: there exp_avg is 0.1, a
    live first moment that v cannot explain (an underflow). NaN and inf entries get exp_avg 0.1."""
    params = [[torch.nn.Parameter(torch.zeros(len(v), dtype=dtype)) for v in g] for g in groups]
    opt = torch.optim.AdamW([{"params": ps} for ps in params], lr=1e-3)
    for ps in params:
        for p in ps:
            p.grad = torch.ones_like(p)
    opt.step()
    for ps, g in zip(params, groups, strict=True):
        for p, v in zip(ps, g, strict=True):
            v = torch.as_tensor(v, dtype=dtype)
            opt.state[p]["exp_avg_sq"].copy_(v)
            healthy = torch.isfinite(v) & (v > 0)
            opt.state[p]["exp_avg"].copy_(torch.where(healthy, v.clamp(min=0).sqrt(), torch.full_like(v, 0.1)))
    return opt


def v_of(opt: torch.optim.Optimizer, group: int = 0) -> torch.Tensor:
    params = [p for p in opt.param_groups[group]["params"] if p in opt.state]
    return torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params])


def lists(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.clone() for t in ts]


E8 = [i * 1e-8 for i in range(20)]  # 0, 1e-8, ..., 19e-8: one tiny entry in 20 (5 %)


# --------------------------------------------------------------------------------------------------- floor


def test_floor_config_validation_and_defaults():
    c = OpefoConfig()
    assert not c.enabled and c.floor.interval == 100 and c.floor.trigger_frac == 0.01 and c.floor.percentile == 10
    assert not c.error_feedback.enabled and c.error_feedback.weights == (0.3, 0.3, 0.2, 0.2)
    assert (c.rollback.snapshot_interval, c.rollback.recovery_lr_factor, c.rollback.recovery_steps) == (500, 0.3, 100)
    with pytest.raises(ValueError, match=r"percentile must be in \(0, 100\), got 100"):
        FloorConfig(percentile=100)
    with pytest.raises(ValueError, match=r"interval must be >= 1.*trigger_frac must be in"):
        FloorConfig(interval=0, trigger_frac=1.0)


def test_floor_by_hand_per_tensor_over_two_params_one_group_and_a_param_without_state():
    # group 0: [0, 1..19] x 1e-8 split over two params; group 1 healthy; one param never got a gradient.
    # Every entry's first moment is live (0.1 after the one real step), so the 0 is an underflow.
    opt = adamw_with_v([E8[:9], E8[9:]], [[1.0, 2.0, 3.0]])
    stateless = torch.nn.Parameter(torch.zeros(4))
    opt.param_groups[0]["params"].append(stateless)
    floor = SecondMomentFloor()
    m = floor.maybe_apply(opt, 100)
    # param A = [0, 1..8]e-8: 1 of 9 underflowed (11 %) -> its own p10 over the 8 entries above tiny, linear:
    # position 0.1 * 7 = 0.7 -> 1 + 0.7 * (2 - 1) = 1.7 (x1e-8); 0 and 1e-8 raised. Param B = [9..19]e-8: none.
    assert m["opefo/floor_value/0"] == pytest.approx(1.7e-8, rel=1e-6)
    assert m["opefo/tiny_frac/0"] == 0.05 and m["opefo/floor_raised_frac/0"] == 2 / 20
    assert (m["opefo/floor_triggered"], m["opefo/tiny_frac/1"], m["opefo/floor_value/1"]) == (1.0, 0.0, 0.0)
    # the underflowed 0 goes further, to (m / s)^2: m = 0.1 and A's healthy steps sqrt(v) / (sqrt(v) + eps) ~ 1
    # (s = 1 - 0.6e-4, their lower median at v = 4e-8), so ~0.01: its next step is a healthy one, not 0.1 / 1.7e-4
    expected = torch.tensor(E8[:9]).clamp(min=m["opefo/floor_value/0"])
    after = v_of(opt, 0)
    assert after[0].item() == pytest.approx((0.1 / (2e-4 / (2e-4 + 1e-8))) ** 2, rel=1e-5)
    assert torch.equal(after[1:9], expected[1:]) and torch.equal(after[9:], torch.tensor(E8[9:]))
    assert torch.equal(v_of(opt, 1), torch.tensor([1.0, 2.0, 3.0]))
    assert stateless not in opt.state and floor.floored_groups == 1 and floor.last_raised == 2


def _set_m(opt: torch.optim.Optimizer, values: list[float], group: int = 0, index: int = 0) -> None:
    p = opt.param_groups[group]["params"][index]
    opt.state[p]["exp_avg"].copy_(torch.tensor(values))


def test_consistency_bound_by_hand_and_on_a_real_adam_history():
    from steadyrl.guards.moment_floor import consistency_bound

    assert consistency_bound(0.9, 0.999) == pytest.approx(0.1 / math.sqrt(0.001 * (1 - 0.81 / 0.999)))
    assert consistency_bound(0.9, 0.999) == pytest.approx(7.2703, abs=1e-3) and consistency_bound(0.99, 0.9) == INF
    # the worst case for the bound: a gradient that is 0 for a long time, then one spike: m/sqrt(v) stays below C
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([p], lr=0.0)
    worst = 0.0
    for step in range(300):
        p.grad = torch.tensor([1.0, 1e-12, 0.0]) * (1.0 if step % 50 else 1e3) * (0.5 ** (step % 7))
        opt.step()
        m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
        live = v > 0
        worst = max(worst, float((m[live].abs() / v[live].sqrt()).max()))
    assert worst < consistency_bound(0.9, 0.999)


def test_tiny_but_consistent_entries_do_not_count_as_underflow():
    # v ~ 1e-20 from gradients ~ 1e-9 (m = sqrt(v)): a normal Adam step, not a fault; the seed's v <= 1e-20 counts it
    opt = adamw_with_v([[1e-21] * 10 + [1e-6] * 90])
    m = SecondMomentFloor().maybe_apply(opt, 100)
    assert m["opefo/tiny_frac/0"] == 0.0 and m["opefo/floor_triggered"] == 0.0


def test_never_touched_entries_are_not_underflow_and_stay_zero():
    # v: three zeros then 1..17; m: the first two zeros never saw a gradient (m == 0), the third did (an underflow)
    values = [0.0, 0.0, 0.0, *range(1, 18)]
    opt = adamw_with_v([values])
    _set_m(opt, [0.0, 0.0, *[0.1] * 18])
    m = SecondMomentFloor().maybe_apply(opt, 100)
    # 1 live underflow in 20 (5 %) -> p10 over the 17 entries above tiny: 1 + 0.1 * 16 = 2.6; raised: 1 and 2 to it,
    # the live zero to (m / s)^2 with s the median healthy step 0.1 / sqrt(9) (v = 1..17, m = 0.1): 9, the tensor's
    # median v; the never-touched zeros stay 0 (their update is m / (sqrt(v) + eps) = 0 anyway)
    assert m["opefo/tiny_frac/0"] == 0.05 and m["opefo/floor_value/0"] == pytest.approx(2.6)
    assert v_of(opt).tolist()[:6] == pytest.approx([0.0, 0.0, 9.0, 2.6, 2.6, 3.0])
    assert m["opefo/floor_raised_frac/0"] == 3 / 20
    # only never-touched zeros (an SFT checkpoint's unseen-token rows): no trigger, nothing changes
    opt = adamw_with_v([values])
    _set_m(opt, [0.0, 0.0, 0.0, *[0.1] * 17])
    m = SecondMomentFloor().maybe_apply(opt, 100)
    assert m["opefo/tiny_frac/0"] == 0.0 and m["opefo/floor_triggered"] == 0.0
    assert v_of(opt).tolist() == values


def test_a_half_zeroed_tensor_is_floored_at_its_own_scale_not_the_groups():
    # tensor A at ~1e-4 with half its v zeroed (its m intact), tensor B at ~1e-12 in the same group: the group's p10
    # (~1e-12) would leave A's zeroed half ~1e8 below its level; A's own p10 is its floor, and each zeroed entry gets
    # back (m / s)^2, s = A's median healthy step (~1: m = sqrt(v) before the fault), i.e. its own v before the fault
    true = [1e-4 * (1 + i / 100) for i in range(100)]
    a = [0.0 if i % 2 == 0 else x for i, x in enumerate(true)]
    b = [1e-12 * (1 + i / 100) for i in range(400)]
    opt = adamw_with_v([a, b])
    _set_m(opt, [x**0.5 for x in true])
    m = SecondMomentFloor().maybe_apply(opt, 100)
    expected = torch.quantile(torch.tensor(a[1::2], dtype=torch.float64), 0.1).item()
    assert m["opefo/floor_value/0"] == pytest.approx(expected) and expected > 1e-4
    s = 1 / (1 + 1e-8 / 1.49**0.5 / 1e-2)  # the lower median healthy step, at v = 1.49e-4
    assert v_of(opt)[0:100:2].tolist() == pytest.approx([max(x / s**2, expected) for x in true[::2]], rel=1e-5)
    assert v_of(opt)[1:100:2].tolist() == pytest.approx([max(x, expected) for x in true[1::2]], rel=1e-6)
    assert torch.equal(v_of(opt)[100:], torch.tensor(b))  # B had no underflow: untouched


def test_an_underflowed_entrys_next_step_is_the_tensors_median_step_however_wide_v_is_spread():
    # v spread over 8 decades (as after a few steps); a quarter of the entries zeroed with m intact. A percentile
    # floor sits far below most of them: their next step |m| / sqrt(floor) would be up to ~3e3 x their healthy one.
    # With (m / s)^2 every repaired entry steps exactly the median healthy step s (here 1: m = sqrt(v))
    g = torch.Generator().manual_seed(0)
    true = 10.0 ** (torch.rand(4000, generator=g) * 8 - 12)
    zeroed = torch.rand(4000, generator=g) < 0.25
    opt = adamw_with_v([true.masked_fill(zeroed, 0.0)])
    _set_m(opt, true.sqrt().tolist())
    SecondMomentFloor().maybe_apply(opt, 100)
    after = v_of(opt).double()
    step = true.double().sqrt()[zeroed] / (after[zeroed].sqrt() + 1e-8)
    healthy = true.double().sqrt()[~zeroed] / (true.double()[~zeroed].sqrt() + 1e-8)
    assert step.max().item() == pytest.approx(healthy.median().item(), rel=1e-5)
    assert step.max().item() <= 1.0 and step.min().item() > 0.01  # the p10 alone: up to 1e-4 / 1e-11 -> ~3e3
    assert torch.equal(after[~zeroed], true.double()[~zeroed].clamp(min=after[~zeroed].min().item()).float().double())


def test_floor_strict_trigger_and_off_steps():
    opt = adamw_with_v([E8])
    assert SecondMomentFloor(FloorConfig(trigger_frac=0.05)).maybe_apply(opt, 100)["opefo/floor_triggered"] == 0.0
    floor = SecondMomentFloor()
    for step in (0, 50, 150, -100):
        assert floor.maybe_apply(opt, step) == {}
    assert SecondMomentFloor(FloorConfig(enabled=False)).maybe_apply(opt, 100) == {}
    assert torch.equal(v_of(opt), torch.tensor(E8)) and floor.checks == 0


def test_floor_bf16_state_and_nonfinite_entries_are_left_alone():
    values = [0.0, 0.0, *range(1, 19)]
    opt = adamw_with_v([values], dtype=torch.bfloat16)
    m = SecondMomentFloor().maybe_apply(opt, 100)
    # above tiny: 1..18, position 0.1 * 17 = 1.7 -> 2.7; bf16 rounds the floor when it is written
    assert m["opefo/floor_value/0"] == pytest.approx(2.7) and m["opefo/tiny_frac/0"] == 0.1
    out = v_of(opt)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.tensor(values, dtype=torch.bfloat16).clamp(min=2.7))
    opt = adamw_with_v([[NAN, INF, 0.0, 0.0, *range(1, 17)]])
    m = SecondMomentFloor().maybe_apply(opt, 100)
    # tiny: the two zeros (2/20); percentile over the 16 finite entries above tiny: 1 + 0.1 * 15 = 2.5
    assert m["opefo/tiny_frac/0"] == 0.1 and m["opefo/floor_value/0"] == 2.5
    out = v_of(opt)
    assert math.isnan(out[0]) and out[1] == INF and out[2:6].tolist() == [2.5] * 4 and out[6] == 3.0


def big_state(sizes: list[int], seed: int = 0) -> torch.optim.AdamW:
    g = torch.Generator().manual_seed(seed)
    values = [(torch.rand(n, generator=g) + 1e-3) * (torch.rand(n, generator=g) >= 0.02) for n in sizes]
    return adamw_with_v(values)


def test_sampled_percentile_is_accurate_and_deterministic():
    opt = big_state([600_000, 400_000])
    before = [t.clone() for t in (v_of_param(opt, 0), v_of_param(opt, 1))]
    m = SecondMomentFloor().maybe_apply(opt, 300)
    assert m["opefo/tiny_frac/0"] == pytest.approx(0.02, abs=0.001)
    floors = []
    for i, b in enumerate(before):
        after = v_of_param(opt, i)
        q = after.min().item()  # every entry is live: the ones below the tensor's floor now equal it
        floors.append(q)
        healthy = b[b > 1e-20]
        # rank of the estimate among the entries above tiny: 0.10 +- sqrt(0.1 * 0.9 / 65536) = 0.0012 (1 sigma)
        assert (healthy < q).double().mean().item() == pytest.approx(0.10, abs=0.006)
        assert torch.equal(after, b.clamp(min=q))
    q = m["opefo/floor_value/0"]  # float64; the state holds it rounded to fp32
    assert q == pytest.approx(min(floors), rel=1e-6) and floors[0] != floors[1]
    raised = sum(int((b < q).sum()) for b, q in zip(before, floors, strict=True))
    assert m["opefo/floor_raised_frac/0"] == pytest.approx(raised / 1_000_000)
    # deterministic in (seed, step): a fresh instance on the same state agrees; another step draws another sample
    again, other = big_state([600_000, 400_000]), big_state([600_000, 400_000])
    assert SecondMomentFloor().maybe_apply(again, 300)["opefo/floor_value/0"] == q
    assert SecondMomentFloor().maybe_apply(other, 400)["opefo/floor_value/0"] != q


def v_of_param(opt: torch.optim.Optimizer, index: int, group: int = 0) -> torch.Tensor:
    return opt.state[opt.param_groups[group]["params"][index]]["exp_avg_sq"].reshape(-1)


def test_two_ranks_floor_their_own_partition_and_agree_on_the_counts():
    # a ZeRO-like split of one group: rank 0's partition has 2 underflows in 17, rank 1's none
    values = [0.0, 0.0, 5.0, *range(1, 28)]
    parts = [values[:17], values[17:]]
    alone = []
    for part in parts:
        opt = adamw_with_v([part])
        SecondMomentFloor().maybe_apply(opt, 100)
        alone.append(v_of(opt))
    ranks = FakeRanks(2)

    def rank_fn(rank: int):
        opt = adamw_with_v([parts[rank]])
        floor = SecondMomentFloor(reduce_sum=ranks.reduce_sum(rank))
        return floor.maybe_apply(opt, 100), v_of(opt), floor.last_raised

    (m_a, v_a, n_a), (m_b, v_b, n_b) = ranks.run(rank_fn)
    assert torch.equal(v_a, alone[0]) and torch.equal(v_b, torch.tensor(parts[1]))  # each by its own statistic
    assert m_a["opefo/tiny_frac/0"] == m_b["opefo/tiny_frac/0"] == 2 / 30  # counts over both partitions
    assert m_a["opefo/floor_triggered"] == m_b["opefo/floor_triggered"] == 1.0
    assert m_a["opefo/floor_raised_frac/0"] == m_b["opefo/floor_raised_frac/0"] == n_a / 30 and n_a == n_b > 0


# ------------------------------------------------------------------------------------------ error feedback


def test_error_feedback_config_validation():
    assert ErrorFeedbackConfig(weights=[0.5, 0.5]).weights == (0.5, 0.5)  # a YAML list becomes a tuple
    with pytest.raises(ValueError, match=r"weights must sum to 1 \(\+-1e-6\), got \[0.5, 0.4\]"):
        ErrorFeedbackConfig(weights=(0.5, 0.4))
    with pytest.raises(ValueError, match=r"weights\[1\] must be finite and > 0, got -0.2"):
        ErrorFeedbackConfig(weights=(1.2, -0.2))
    with pytest.raises(ValueError, match=r"weights must have at least 1 item\(s\), got \(\)"):
        ErrorFeedbackConfig(weights=())


def test_four_steps_inject_the_residual_direction_with_total_weight_one():
    gen = torch.Generator().manual_seed(1)
    r = [torch.randn(3, 2, generator=gen), None, torch.randn(5, generator=gen)]
    g0 = [torch.randn(3, 2, generator=gen), torch.randn(4, generator=gen), torch.randn(5, generator=gen)]
    ef = ErrorFeedback(ON)
    assert ef.store(lists(*r)) and ef.pending
    r_norm = math.sqrt(sum(float(t.square().sum()) for t in r if t is not None))
    total = [torch.zeros_like(t) for t in g0]
    weights = []
    for _ in range(4):
        g = lists(*g0)
        g_norm = math.sqrt(sum(float(t.square().sum()) for t in g0))
        m = ef.apply(g)
        weights.append(m["opefo/ef_weight"])
        assert m["opefo/ef_pending"] == 1.0
        assert m["opefo/ef_injected_norm"] == pytest.approx(m["opefo/ef_weight"] * g_norm, rel=1e-6)
        for acc, after, before in zip(total, g, g0, strict=True):
            acc += (after - before) / g_norm
    assert weights == [0.3, 0.3, 0.2, 0.2] and not ef.pending and ef.completed == 1
    assert torch.allclose(total[0], r[0] / r_norm, atol=1e-6) and torch.allclose(total[2], r[2] / r_norm, atol=1e-6)
    assert torch.equal(total[1], torch.zeros(4))  # no residual in that slot
    g = lists(*g0)
    assert ef.apply(g) == {"opefo/ef_pending": 0.0, "opefo/ef_weight": 0.0, "opefo/ef_injected_norm": 0.0}
    assert all(torch.equal(a, b) for a, b in zip(g, g0, strict=True))


def test_norm_20_residual_into_norm_2_gradient_adds_0_6():
    ef = ErrorFeedback(ON)
    ef.store([torch.tensor([12.0, 0.0]), torch.tensor([16.0])])  # ||r|| = 20
    g = [torch.tensor([0.0, 2.0]), torch.tensor([0.0])]  # ||g|| = 2
    m = ef.apply(g)
    # g += 0.3 * 2 * r / 20 = 0.03 * r
    assert m == pytest.approx({"opefo/ef_pending": 1.0, "opefo/ef_weight": 0.3, "opefo/ef_injected_norm": 0.6})
    assert torch.allclose(g[0], torch.tensor([0.36, 2.0])) and torch.allclose(g[1], torch.tensor([0.48]))


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nonfinite_residual_is_rejected_and_a_pending_one_is_kept(bad):
    ef = ErrorFeedback(ON)
    assert not ef.store([torch.tensor([1.0, bad])]) and not ef.pending and ef.rejected_nonfinite == 1
    ef.store([torch.tensor([3.0, 4.0])])
    ef.apply([torch.tensor([1.0, 0.0])])
    assert not ef.store([torch.tensor([bad, 0.0])])
    assert ef._position == 1 and ef.rejected_nonfinite == 2 and ef.stored == 1
    g = [torch.tensor([0.0, 10.0])]
    assert ef.apply(g)["opefo/ef_weight"] == 0.3  # the second weight, on the old residual
    assert torch.allclose(g[0], torch.tensor([1.8, 12.4]))  # + 0.3 * 10 * [0.6, 0.8]


def test_zero_residual_is_rejected_and_zero_gradient_defers_the_schedule():
    ef = ErrorFeedback(ON)
    assert not ef.store([torch.zeros(3), None]) and ef.rejected_zero == 1 and not ef.pending
    ef.store([torch.tensor([0.0, 0.0, 2.0]), None])
    g = [torch.zeros(3), None]
    m = ef.apply(g)
    assert m == {"opefo/ef_pending": 1.0, "opefo/ef_weight": 0.0, "opefo/ef_injected_norm": 0.0}
    assert torch.equal(g[0], torch.zeros(3)) and ef._position == 0 and ef.deferred == 1
    assert ef.apply([torch.tensor([NAN, 0.0, 0.0]), None])["opefo/ef_weight"] == 0.0 and ef._position == 0
    assert ef.apply([torch.tensor([1.0, 0.0, 0.0]), None])["opefo/ef_weight"] == 0.3  # schedule resumes intact


def test_second_skip_merges_the_remaining_fraction_into_one_buffer():
    ef = ErrorFeedback(ON)
    ef.store([torch.tensor([3.0, 4.0])])  # direction [0.6, 0.8]
    buffer = ef._residual[0]
    ef.apply([torch.tensor([1.0, 0.0])])
    ef.apply([torch.tensor([1.0, 0.0])])  # 0.6 injected, R = 0.4 left
    assert ef.store([torch.tensor([0.0, -10.0])])  # direction [0, -1]
    # merged: 0.4 * [0.6, 0.8] + [0, -1] = [0.24, -0.68], in the same buffer; schedule restarts
    assert ef._residual[0] is buffer and torch.allclose(buffer, torch.tensor([0.24, -0.68]))
    assert (ef._position, ef.merged, ef.stored) == (0, 1, 2)
    g = [torch.tensor([2.0, 0.0])]
    ef.apply(g)
    n = math.hypot(0.24, 0.68)
    assert torch.allclose(g[0], torch.tensor([2.0 + 0.6 * 0.24 / n, -0.6 * 0.68 / n]))
    weights = [ef.apply([torch.tensor([1.0, 0.0])])["opefo/ef_weight"] for _ in range(4)]
    assert weights == [0.3, 0.2, 0.2, 0.0]


def test_merge_with_none_slots_and_exact_cancellation():
    ef = ErrorFeedback(ON)
    ef.store([torch.tensor([2.0]), None])
    ef.store([None, torch.tensor([0.0, 5.0])])  # R = 1: [1] and [0, 1]
    assert torch.equal(ef._residual[0], torch.tensor([1.0])) and torch.equal(ef._residual[1], torch.tensor([0.0, 1.0]))
    ef = ErrorFeedback(ON)
    ef.store([torch.tensor([2.0])])
    assert not ef.store([torch.tensor([-4.0])]) and not ef.pending  # 1 * [1] + [-1] = 0: nothing left


def test_slot_mismatch_is_an_error():
    ef = ErrorFeedback(ON)
    ef.store([torch.ones(2), torch.ones(3)])
    with pytest.raises(ValueError, match="got 1 gradients but holds a residual of 2"):
        ef.apply([torch.ones(2)])
    with pytest.raises(ValueError, match=r"gradient 1 has shape \(4,\), the residual \(3,\)"):
        ef.store([torch.ones(2), torch.ones(4)])


def test_disabled_error_feedback_does_nothing():
    ef = ErrorFeedback(ErrorFeedbackConfig(enabled=False))
    assert not ef.store([torch.ones(2)]) and ef.apply([torch.ones(2)])["opefo/ef_pending"] == 0.0


def test_state_round_trip_mid_schedule_gives_identical_gradients():
    gen = torch.Generator().manual_seed(3)
    steps = [[torch.randn(4, 3, generator=gen), torch.randn(2, generator=gen)] for _ in range(5)]
    a = ErrorFeedback(ON)
    a.store([torch.randn(4, 3, generator=gen), torch.randn(2, generator=gen)])
    a.apply(lists(*steps[0]))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = ErrorFeedback(ON)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b._position == 1 and b.stored == 1 and all(r.device.type == "cpu" for r in b._residual)
    for grads in steps[1:]:
        ga, gb = lists(*grads), lists(*grads)
        assert a.apply(ga) == b.apply(gb)
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
    assert not a.pending and not b.pending
    c = ErrorFeedback(ErrorFeedbackConfig(enabled=True, weights=(1.0,)))
    c.load_state_dict(a.state_dict() | {"position": 1, "residual": [torch.ones(1)], "slot_sq": torch.ones(1)})
    assert not c.pending  # the saved position is past the configured schedule: dropped


def test_two_rank_split_equals_one_process():
    gen = torch.Generator().manual_seed(7)

    def draw() -> list[torch.Tensor | None]:
        return [torch.randn(10, generator=gen, dtype=torch.float64), None, torch.randn(7, generator=gen).double()]

    r1, r2 = draw(), draw()
    grads = [draw() for _ in range(6)]

    def run(ef: ErrorFeedback, part: Callable[[list[torch.Tensor | None]], list[torch.Tensor | None]]):
        ef.store(part(r1))
        outs = []
        for k, g in enumerate(grads):
            if k == 2:
                ef.store(part(r2))  # a second skip mid-schedule: merge
            g = part(g)
            outs.append((ef.apply(g), g))
        return outs

    single = run(ErrorFeedback(ON), lambda ts: lists(*ts))
    ranks = FakeRanks(2)

    def half(rank: int) -> Callable[[list[torch.Tensor | None]], list[torch.Tensor | None]]:
        return lambda ts: [None if t is None else t.tensor_split(2)[rank].clone() for t in ts]

    split = ranks.run(lambda rank: run(ErrorFeedback(ON, reduce_sum=ranks.reduce_sum(rank)), half(rank)))
    for k, (m, g) in enumerate(single):
        (m0, g0), (m1, g1) = split[0][k], split[1][k]
        assert m0 == m1 and m0 == pytest.approx(m, rel=1e-12)
        for full, a, b in zip(g, g0, g1, strict=True):
            if full is None:
                assert a is None and b is None
            else:
                assert torch.allclose(torch.cat([a, b]), full, rtol=1e-12, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(
    r=st.lists(st.floats(-1e3, 1e3), min_size=4, max_size=4),
    g=st.lists(st.floats(-1e3, 1e3), min_size=4, max_size=4),
    steps=st.integers(0, 3),
)
def test_every_injected_piece_is_w_times_the_gradient_norm(r, g, steps):
    rt, gt = torch.tensor(r, dtype=torch.float64), torch.tensor(g, dtype=torch.float64)
    assume(rt.norm() > 1e-6 and gt.norm() > 1e-6)
    ef = ErrorFeedback(ON)
    ef.store([rt])
    for _ in range(steps):
        ef.apply([torch.ones(4, dtype=torch.float64)])
    before = gt.clone()
    m = ef.apply([gt])
    w = (0.3, 0.3, 0.2, 0.2)[steps]
    assert torch.isfinite(gt).all()
    assert (gt - before).norm().item() == pytest.approx(w * before.norm().item(), rel=1e-9)
    assert m["opefo/ef_injected_norm"] == pytest.approx(w * before.norm().item(), rel=1e-9)


# -------------------------------------------------------------------------------------------------- rollback


def test_optimizer_state_finite_checks_both_moments_and_every_rank():
    opt = adamw_with_v([[1.0, 2.0]], [[3.0]])
    assert optimizer_state_finite(opt)
    p = opt.param_groups[1]["params"][0]
    opt.state[p]["exp_avg"][0] = -INF
    assert not optimizer_state_finite(opt) and optimizer_state_finite(opt, keys=("exp_avg_sq",))
    opt.state[p]["exp_avg"][0] = 0.0
    opt.state[p]["exp_avg_sq"][0] = NAN
    assert not optimizer_state_finite(opt)
    ranks = FakeRanks(2)
    healthy = adamw_with_v([[1.0]])
    verdicts = ranks.run(lambda rank: optimizer_state_finite((opt, healthy)[rank], reduce_sum=ranks.reduce_sum(rank)))
    assert verdicts == [False, False]  # one rank's NaN: both ranks see it


def test_rollback_config_validation():
    with pytest.raises(ValueError, match=r"storage must be one of \['memory', 'disk'\], got 'tape'"):
        RollbackConfig(storage="tape")
    with pytest.raises(ValueError, match=r"recovery_lr_factor must be in \(0, 1\], got 0.*rollback_window must be"):
        RollbackConfig(recovery_lr_factor=0.0, rollback_window=0)
    with pytest.raises(ValueError, match=r"snapshot_interval must be >= 1.*check_interval must be >= 1"):
        RollbackConfig(snapshot_interval=0, check_interval=0)


def payload() -> dict[str, Any]:
    return {"weights": {"w": torch.arange(4.0)}, "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}}}, "rng": [1, 2]}


def test_memory_snapshot_is_a_deep_copy_both_ways():
    store = SnapshotStore()
    with pytest.raises(LookupError, match="no snapshot"):
        store.load()
    p = payload()
    store.save(500, p)
    p["weights"]["w"].add_(100.0)  # training goes on: the snapshot must not move
    p["rng"].append(3)
    step, loaded = store.load()
    assert step == 500
    assert torch.equal(loaded["weights"]["w"], torch.arange(4.0)) and loaded["rng"] == [1, 2]
    loaded["optimizer"]["state"][0]["exp_avg"].mul_(0)  # restored state trained on: the snapshot must not move
    assert torch.equal(store.load()[1]["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    store.clear()
    with pytest.raises(LookupError, match="no snapshot"):
        store.load()


def test_disk_snapshot_is_atomic_and_keeps_only_the_latest(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="needs a directory"):
        SnapshotStore("disk")
    with pytest.raises(ValueError, match="must be one of memory, disk"):
        SnapshotStore("tape")
    store = SnapshotStore("disk", tmp_path / "rank0")
    with pytest.raises(LookupError, match="no snapshot"):
        store.load()
    store.save(500, payload())
    store.save(1000, payload() | {"rng": [9]})
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["snapshot-000000001000.pt"]
    assert SnapshotStore("disk", tmp_path / "rank0").load()[0] == 1000  # seen by a new store too
    step, loaded = store.load()
    assert step == 1000 and loaded["rng"] == [9] and torch.equal(loaded["weights"]["w"], torch.arange(4.0))

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        store.save(1500, payload())
    assert sorted(p.name for p in (tmp_path / "rank0").iterdir()) == ["snapshot-000000001000.pt"]  # no temp left
    assert store.load()[0] == 1000
    store.clear()
    assert list((tmp_path / "rank0").iterdir()) == []


def test_a_disk_snapshot_one_rank_cannot_write_is_published_by_no_rank(tmp_path, monkeypatch):
    # two ranks (threads) agree in one reduce before publishing: rank 1's disk is full at step 1500, so rank 0 (which
    # wrote its file) keeps step 1000 too, and a rollback would restore one step on both
    ranks, here = FakeRanks(2), threading.local()
    stores = [SnapshotStore("disk", tmp_path / f"rank{r}") for r in range(2)]
    real_save, full = torch.save, {1500}

    def save(obj, f, *a, **k):
        if here.rank == 1 and obj["step"] in full:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)

    def run(rank: int) -> list[tuple[bool, str | None, int]]:
        here.rank, reduce = rank, ranks.reduce_sum(rank)
        agree = lambda ok: int(reduce(torch.tensor([0.0 if ok else 1.0])).item()) == 0  # noqa: E731
        out = []
        for step in (1000, 1500, 2000):
            ok = stores[rank].save(step, payload(), agree=agree)
            error = stores[rank].last_error
            out.append((ok, None if error is None else str(error), stores[rank].load()[0]))
        return out

    assert ranks.run(run) == [
        [(True, None, 1000), (False, None, 1000), (True, None, 2000)],  # rank 0 wrote 1500 and kept 1000
        [(True, None, 1000), (False, "[Errno 28] No space left on device", 1000), (True, None, 2000)],
    ]
    for rank in range(2):  # the latest only, no temp file left
        assert sorted(p.name for p in (tmp_path / f"rank{rank}").iterdir()) == ["snapshot-000000002000.pt"]


def test_rollback_policy_recovery_and_limit():
    policy = RollbackPolicy(RollbackConfig(recovery_steps=100, max_rollbacks=2, rollback_window=1000))
    assert policy.lr_factor(0) == 1.0 and not policy.recovery_active(0)
    policy.record(500, "nonfinite exp_avg_sq")
    assert policy.lr_factor(500) == 0.3 and policy.lr_factor(599) == 0.3 and policy.lr_factor(600) == 1.0
    policy.record(1200, "nonfinite loss")
    policy.record(1600, "nonfinite loss")  # 500 is out of the window (1600 - 500 >= 1000): 2 within, allowed
    assert policy.rollbacks == 3 and [s for s, _ in policy.recent] == [1200, 1600]
    state = policy.state_dict()
    with pytest.raises(
        RollbackLimitError,
        match=r"step 1700: rollback #4 \(cause: nonfinite exp_avg\) makes 3 rollbacks within 1000 steps "
        r"\(at steps 1200, 1600, 1700; max_rollbacks=2\)\. .*lower the learning rate",
    ):
        policy.record(1700, "nonfinite exp_avg")
    restored = RollbackPolicy(RollbackConfig(recovery_steps=100, max_rollbacks=2, rollback_window=1000))
    restored.load_state_dict(state)
    assert restored.state_dict() == state and restored.lr_factor(1650) == 0.3 and restored.lr_factor(1700) == 1.0
    off = RollbackPolicy(RollbackConfig(enabled=False))
    off.record(10, "x")
    assert off.lr_factor(10) == 1.0


def test_repair_policy_decides_and_survives_a_resume():
    policy = RollbackPolicy(RollbackConfig(recovery_steps=50, repair_max_share=0.01))
    assert policy.refuse_repair(10, 0, 1, 100) is None  # 1% exactly: repaired
    assert "more than guards.opefo.rollback.repair_max_share=0.01" in policy.refuse_repair(10, 0, 2, 100)
    assert policy.refuse_repair(10, 1, 1, 100).startswith("the weights are not finite")
    policy.record_repair(10, 1)
    assert "again 49 steps after the repair at step 10" in policy.refuse_repair(59, 0, 1, 1000)
    assert policy.refuse_repair(60, 0, 1, 1000) is None  # recovery_steps later: a new one-off
    state = policy.state_dict()
    restored = RollbackPolicy(RollbackConfig(recovery_steps=50))
    restored.load_state_dict(state)
    assert restored.state_dict() == state and restored.repairs == 1 and restored.last_repair == 10
    old = {k: v for k, v in state.items() if k not in ("repairs", "repaired_entries", "last_repair")}
    with pytest.raises(KeyError, match="repairs"):  # a pre-release checkpoint from before repairs is refused
        restored.load_state_dict(old)
    assert "repair_state is off" in RollbackPolicy(RollbackConfig(repair_state=False)).refuse_repair(1, 0, 1, 1000)
    with pytest.raises(ValueError, match=r"repair_max_share must be in \(0, 1\], got 0"):
        RollbackConfig(repair_max_share=0.0)


# ------------------------------------------------------------------------------------------ torch.distributed


def test_distributed_ops_on_a_one_process_gloo_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        reduce_sum, all_gather = distributed_ops()
        x = torch.tensor([1.0, 2.0])
        assert torch.equal(reduce_sum(x), x) and reduce_sum(x) is not x
        assert torch.equal(all_gather(torch.arange(3.0)), torch.arange(3.0))
        assert all_gather(torch.zeros(0)).numel() == 0
        with pytest.raises(ValueError, match="1-D"):
            all_gather(torch.zeros(2, 2))
        opt = big_state([50_000])
        floor = SecondMomentFloor(FloorConfig(), reduce_sum)
        assert floor.maybe_apply(opt, 100)["opefo/floor_triggered"] == 1.0
    finally:
        dist.destroy_process_group()


def _two_process_worker(rank: int, tmp: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        reduce_sum, all_gather = distributed_ops()
        summed = reduce_sum(torch.tensor([1.0 + rank, 10.0]))
        gathered = all_gather(torch.arange(3.0) if rank == 0 else torch.tensor([7.0]))
        empty_one = all_gather(torch.zeros(0) if rank == 0 else torch.tensor([5.0]))
        param = torch.nn.Parameter(torch.zeros(30_000 if rank == 0 else 20_000))
        opt = torch.optim.AdamW([param])  # state set by hand: no optimizer step in the worker (slow first call)
        v = torch.rand(param.numel()) * (torch.arange(param.numel()) % 20 > 0)
        opt.state[param]["exp_avg_sq"] = v
        opt.state[param]["exp_avg"] = torch.where(v > 0, v.sqrt(), torch.ones_like(v))  # 1 in 20 underflowed
        m = SecondMomentFloor(FloorConfig(), reduce_sum).maybe_apply(opt, 100)
        torch.save((summed.tolist(), gathered.tolist(), empty_one.tolist(), m), f"{tmp}/rank{rank}.pt")
        dist.barrier()  # a rank that tears gloo down while its peer still reads the last collective aborts it
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_distributed_ops_on_two_gloo_processes(tmp_path):
    from tests.integration.spawn import spawn_or_fail

    spawn_or_fail(_two_process_worker, (str(tmp_path),))
    (s0, g0, e0, m0), (s1, g1, e1, m1) = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert s0 == s1 == [3.0, 20.0]
    assert g0 == g1 == [0.0, 1.0, 2.0, 7.0] and e0 == e1 == [5.0]
    assert m0["opefo/floor_triggered"] == m1["opefo/floor_triggered"] == 1.0  # counts summed over both ranks
    assert m0["opefo/tiny_frac/0"] == m1["opefo/tiny_frac/0"] == pytest.approx(0.05, abs=0.01)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(0.0, 1e3), min_size=2, max_size=60),
    zeros=st.integers(1, 10),
    percentile=st.floats(1.0, 99.0),
)
def test_floor_property_exact_mode(values, zeros, percentile):
    state = [0.0] * zeros + values
    assume(any(v > 1e-20 for v in state))
    opt = adamw_with_v([state], dtype=torch.float64)
    before = v_of(opt).clone()
    m = SecondMomentFloor(FloorConfig(percentile=percentile)).maybe_apply(opt, 100)
    q = torch.quantile(before[before > 1e-20], percentile / 100).item()
    assert m["opefo/floor_triggered"] == 1.0 and m["opefo/floor_value/0"] == q
    after = v_of(opt)
    healthy = before > 1e-20  # m = sqrt(v): each healthy step is sqrt(v) / (sqrt(v) + eps), s their lower median
    s = sorted((before[healthy].sqrt() / (before[healthy].sqrt() + 1e-8)).tolist())[(int(healthy.sum()) - 1) // 2]
    under = before == 0  # m = 0.1 there (the helper): underflowed
    assert torch.equal(after[~under], before[~under].clamp(min=q)) and (after >= q).all()
    assert after[under].tolist() == pytest.approx([max(q, (0.1 / s) ** 2)] * int(under.sum()), rel=1e-12)


def test_bf16_gradients_keep_a_bf16_residual():
    ef = ErrorFeedback(ON)
    ef.store([torch.tensor([3.0, 4.0], dtype=torch.bfloat16)])
    assert ef._residual[0].dtype == torch.bfloat16
    g = [torch.tensor([0.0, 8.0], dtype=torch.bfloat16)]
    assert ef.apply(g)["opefo/ef_injected_norm"] == pytest.approx(2.4)
    assert torch.equal(g[0], torch.tensor([1.44, 9.92], dtype=torch.bfloat16))  # + 0.3 * 8 * [0.6, 0.8]
