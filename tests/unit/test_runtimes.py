"""QUATRO's and OPEFO's pieces in their stations against a fake context: no trainer; what should change comes back
as values."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from fake_context import FakeContext, Quatro

from steadyrl.guards.entropy_floor import EntropyConfig
from steadyrl.guards.error_feedback import ErrorFeedbackConfig
from steadyrl.guards.kl_controller import KLConfig
from steadyrl.guards.moment_floor import FloorConfig
from steadyrl.guards.opefo import OpefoConfig
from steadyrl.guards.optimizer_state import nonfinite_moment_entries, repair_moments
from steadyrl.guards.quatro import QuatroConfig
from steadyrl.guards.rollback import RollbackConfig
from steadyrl.guards.rollout_filters import FilterConfig, LengthConfig, ParrotConfig, ZeroVarianceConfig, ZScoreConfig
from steadyrl.metrics import (
    EVENT_ROLLBACK,
    EVENT_STATE_REPAIR,
    OPEFO_EF_WEIGHT,
    OPEFO_REPAIRED_ENTRIES,
    OPEFO_REPAIRS,
    OPEFO_ROLLBACKS,
    QUATRO_KL_MEAN,
    QUATRO_REPLAY_AGE_MEAN,
    QUATRO_REPLAY_FRAC,
    quatro_filtered,
)
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.context import Controls, TrainerSettings
from steadyrl.trainers.recovery import StateRecovery
from steadyrl.trainers.rollout import FILTER_WARNING_EVERY, REPLAY_STEP_KEY
from steadyrl.trainers.step_gate import StepGate
from steadyrl.trainers.trl_state import LearningRateScale


def _micro_batch(tokens_per_row: list[int], width: int = 4) -> dict[str, torch.Tensor]:
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in tokens_per_row])
    return {"completion_mask": mask}


def test_quatro_kl_controller_observes_the_token_weighted_step_mean() -> None:
    ctx = FakeContext(step=1)
    q = Quatro(QuatroConfig(kl=KLConfig(enabled=True, target=0.02)), ctx=ctx)
    assert q.end.controls() == Controls(kl_factor=1.0)
    q.loss.record_micro_batch(_micro_batch([3, 3]), kl=0.05, entropy=math.nan)  # 6 tokens
    q.loss.record_micro_batch(_micro_batch([2, 0]), kl=0.01, entropy=math.nan)  # 2 tokens
    controls, metrics = q.end.control_step()
    assert metrics[QUATRO_KL_MEAN] == pytest.approx((0.05 * 6 + 0.01 * 2) / 8)  # 0.04 > target: beta x up
    assert controls == Controls(kl_factor=pytest.approx(1.2))
    assert ctx.metrics == []  # the trainer logs what control_step returns


def test_quatro_ppo_observes_once_per_generation_batch() -> None:
    setup = TrainerSettings(beta=0.04, seed=0, pad_token_id=0, loss_type="dapo", kl_from_rollouts=True)
    q = Quatro(QuatroConfig(kl=KLConfig(enabled=True, target=0.02, beta_range=[0.25, 4.0])), setup)
    q.notes.record_rollout_kl(0.01, tokens=10.0)
    controls, _ = q.end.control_step()
    assert controls.kl_factor == pytest.approx(0.8) and q.end.kl.updates == 1
    controls, _ = q.end.control_step()  # a step that trained on an earlier rollout: no new measurement
    assert controls.kl_factor == pytest.approx(0.8) and q.end.kl.updates == 1


@pytest.mark.parametrize(("loss_type", "clip_scale"), [("grpo", 0.5), ("cispo", None)])
def test_quatro_entropy_floor_returns_bonus_and_clip_scale(loss_type: str, clip_scale: float | None) -> None:
    cfg = EntropyConfig(floor_ratio=0.8, baseline_steps=1, window=1, ki=0.2, kp=0.0, clip_factor=0.5)  # coef_max 0.01
    q = Quatro(QuatroConfig(entropy=cfg), TrainerSettings(beta=0.0, seed=0, pad_token_id=0, loss_type=loss_type))
    for entropy in (1.0, 0.5):  # baseline 1.0 -> floor 0.8; then 0.5 < floor: active
        q.loss.record_micro_batch(_micro_batch([4]), kl=math.nan, entropy=entropy)
        controls, _ = q.end.control_step()
    # gap (0.8 - 0.5) / 0.8 = 0.375 -> control 0.2 x 0.375 = 0.075 -> bonus 0.01 x 0.075
    assert controls.entropy_coef == pytest.approx(0.00075) and controls.kl_factor is None
    assert controls.clip_scale == clip_scale


def test_trls_adaptive_entropy_set_by_the_user_wins_over_the_floor(caplog: pytest.LogCaptureFixture) -> None:
    setup = TrainerSettings(beta=0.0, seed=0, pad_token_id=0, loss_type="dapo", use_adaptive_entropy=True)
    with caplog.at_level("WARNING"):
        q = Quatro(QuatroConfig(entropy=EntropyConfig(floor_ratio=0.8, window=5)), setup)
    assert q.end.entropy is None and q.end.controls() == Controls()  # entropy_coef left to TRL
    assert "entropy floor is off for this run" in caplog.text and "use_adaptive_entropy=false" in caplog.text


def test_a_users_entropy_coef_is_kept_and_the_floors_bonus_adds_to_it() -> None:
    cfg = EntropyConfig(floor_ratio=0.8, baseline_steps=1, window=1, ki=0.2, kp=0.0, clip_factor=0.5)  # coef_max 0.01
    q = Quatro(QuatroConfig(entropy=cfg), TrainerSettings(beta=0.0, seed=0, pad_token_id=0, loss_type="dapo",
                                                            entropy_coef=0.5))  # fmt: skip
    assert q.end.controls().entropy_coef == 0.5  # the floor is idle: exactly the user's coefficient
    for entropy in (1.0, 0.5):  # baseline 1.0 -> floor 0.8; then 0.5 < floor: active
        q.loss.record_micro_batch(_micro_batch([4]), kl=math.nan, entropy=entropy)
        controls, _ = q.end.control_step()
    assert controls.entropy_coef == pytest.approx(0.5 + 0.00075)  # bonus 0.01 x 0.2 x 0.375 on top


def test_trls_default_beta_0_leaves_the_kl_controller_inactive(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO"):
        q = Quatro(
            QuatroConfig(kl=KLConfig(enabled=True)), TrainerSettings(beta=0.0, seed=0, pad_token_id=0, loss_type="dapo")
        )
    assert q.end.kl is None and q.end.controls().kl_factor is None
    assert "trainer.beta is 0 (TRL's default)" in caplog.text
    q.loss.record_micro_batch(_micro_batch([4]), kl=math.nan, entropy=1.0)
    controls, metrics = q.end.control_step()
    assert controls.kl_factor is None and not any(k.startswith("quatro/kl") for k in metrics)


def test_quatro_gate_reads_the_named_reward_column() -> None:
    """``gate_reward`` picks that reward's column for the learning gate; without it the gate reads TRL's weighted
    sum. A name the trainer does not have is refused at bind time with the names it has."""
    rewards = torch.tensor([[1.0, 0.0], [0.5, 1.0], [0.0, math.nan]])
    weights = torch.tensor([1.0, 0.0])  # the verifier (column 1) trains nothing
    names = ("proxy", "verifier")
    setup = TrainerSettings(beta=0.0, seed=0, pad_token_id=0, loss_type="dapo", reward_names=names)
    plain = Quatro(QuatroConfig(entropy=EntropyConfig(floor_ratio=0.8, window=5)), setup).rollout
    assert plain.gate_column is None
    assert plain.gate_rewards(rewards, weights).tolist() == [1.0, 0.5, 0.0]
    named = Quatro(QuatroConfig(entropy=EntropyConfig(floor_ratio=0.8, gate_reward="verifier")), setup)
    gate = named.rollout.gate_rewards(rewards, weights)
    assert named.rollout.gate_column == 1 and gate[:2].tolist() == [0.0, 1.0] and math.isnan(gate[2])
    named.rollout.record_reward(gate)
    assert named.notes.rewards == [0.5]  # the NaN row is unscorable: mean of the finite ones
    with pytest.raises(ValueError, match=r"gate_reward='verfier' is not one of .* \['proxy', 'verifier'\]"):
        Quatro(QuatroConfig(entropy=EntropyConfig(floor_ratio=0.8, gate_reward="verfier")), setup)


def _only_repetition() -> FilterConfig:
    return FilterConfig(
        zscore=ZScoreConfig(enabled=False),
        length=LengthConfig(enabled=False),
        parrot=ParrotConfig(enabled=False),
        zero_variance=ZeroVarianceConfig(enabled=False),
    )


def test_quatro_filters_gather_the_batch_log_their_counts_and_mask_the_dropped_rows() -> None:
    ctx = FakeContext(step=3)
    quatro = Quatro(QuatroConfig(filters=_only_repetition()), ctx=ctx).rollout
    output = {
        "prompt_ids": torch.tensor([[0, 5, 6], [0, 5, 6]]),
        "prompt_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]),
        "completion_ids": torch.tensor([[1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]]),  # the second repeats its 3-grams
        "completion_mask": torch.ones(2, 6, dtype=torch.long),
        "num_items_in_batch": torch.tensor(12),
    }
    keep = quatro.filter_generation(output, torch.tensor([0.0, 1.0]), torch.tensor([6, 6]), num_generations=2)
    assert keep.tolist() == [True, False]
    assert ctx.last(quatro_filtered("repetition")) == 1.0
    quatro.mask_dropped_rows(output, keep)  # default zero_advantage: the row stays in the loss and normaliser
    assert output["completion_mask"].sum(dim=1).tolist() == [6, 6] and int(output["num_items_in_batch"]) == 12
    quatro = Quatro(QuatroConfig(filters=dataclasses.replace(_only_repetition(), dropped_rows="exclude")), ctx=ctx)
    quatro = quatro.rollout
    quatro.mask_dropped_rows(output, keep)
    assert output["completion_mask"].sum(dim=1).tolist() == [6, 0] and int(output["num_items_in_batch"]) == 6


def test_filter_warnings_are_rate_limited_and_count_the_batches_in_between() -> None:
    ctx = FakeContext(step=1)
    quatro = Quatro(QuatroConfig(filters=dataclasses.replace(_only_repetition(), max_drop_share=0.4)), ctx=ctx)
    quatro = quatro.rollout
    output = {
        "prompt_ids": torch.tensor([[5], [5]]),
        "prompt_mask": torch.ones(2, 1, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]]),  # one of two dropped: 50% > 40%
        "completion_mask": torch.ones(2, 6, dtype=torch.long),
    }
    for step in (1, 2, 3, FILTER_WARNING_EVERY, FILTER_WARNING_EVERY + 1, FILTER_WARNING_EVERY + 2):
        ctx.step = step
        quatro.filter_generation(dict(output), torch.tensor([0.0, 1.0]), torch.tensor([6, 6]), num_generations=2)
        assert ctx.last(quatro_filtered("repetition")) == 1.0  # every batch's counts are logged
    warnings = [(step, fields["message"]) for step, kind, fields in ctx.events if kind == "filter_warning"]
    assert [step for step, _ in warnings] == [1, FILTER_WARNING_EVERY + 1]
    assert "dropped 1 of 2" in warnings[0][1] and "more batch" not in warnings[0][1]
    assert warnings[1][1].endswith("(3 more batch(es) over the share since step 1)")  # steps 2, 3 and 50


def test_groups_without_reward_variance_get_their_own_warning_not_the_filters() -> None:
    ctx = FakeContext(step=1)
    quatro = Quatro(QuatroConfig(filters=FilterConfig()), ctx=ctx).rollout  # defaults: zero_variance, zero_advantage
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [1, 3, 5, 7], [2, 4, 6, 8]])
    output = {"prompt_ids": torch.tensor([[9]] * 4), "prompt_mask": torch.ones(4, 1, dtype=torch.long),
              "completion_ids": ids, "completion_mask": torch.ones(4, 4, dtype=torch.long)}  # fmt: skip
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])  # group 1 all equal (2 of 4 rows): 50%, not over 50%
    quatro.filter_generation(dict(output), rewards, torch.tensor([4, 4, 4, 4]), num_generations=2)
    assert ctx.events == []
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])  # both groups all equal: every row dropped as zero_variance
    quatro.filter_generation(dict(output), rewards, torch.tensor([4, 4, 4, 4]), num_generations=2)
    (event,) = ctx.events
    assert event[2]["message"].startswith("4 of 4 rollouts (100% > 50%) are in groups whose rewards are all equal")
    assert "check the reward function" in event[2]["message"]


def test_quatro_replay_metrics_sum_over_ranks() -> None:
    ctx = FakeContext(step=5, world=2)
    loss = Quatro(QuatroConfig(), ctx=ctx).loss
    inputs = {**_micro_batch([4, 4, 4, 4]), REPLAY_STEP_KEY: torch.tensor([-1, -1, 2, 4])}
    loss.record_replay(inputs, per_token_logps=None)
    assert ctx.last(QUATRO_REPLAY_FRAC) == 0.5 and ctx.last(QUATRO_REPLAY_AGE_MEAN) == 2.0  # ages 3 and 1


def test_learning_rate_scale_does_not_compound_and_undoes_itself() -> None:
    groups, scale = [{"lr": 1.0}], LearningRateScale()
    assert not scale.apply(groups, 1.0) and groups[0]["lr"] == 1.0
    assert scale.apply(groups, 0.3) and groups[0]["lr"] == pytest.approx(0.3)
    assert scale.apply(groups, 0.3) and groups[0]["lr"] == pytest.approx(0.3)  # a schedule that left lr alone
    groups[0]["lr"] = 0.5  # the schedule set a new value
    assert scale.apply(groups, 0.3) and groups[0]["lr"] == pytest.approx(0.15)
    assert scale.apply(groups, 1.0) and groups[0]["lr"] == pytest.approx(0.5)


class _Counter:
    """Another guard's state, which a snapshot must hold and a rollback restore."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _adam_model() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_opefo_rolls_back_weights_moments_and_guard_state_and_returns_the_lr_factor(tmp_path) -> None:
    model, optimizer = _adam_model()
    rollback = RollbackConfig(snapshot_interval=1, check_interval=1, recovery_lr_factor=0.3, recovery_steps=2)
    opefo = StateRecovery(OpefoConfig(enabled=True, floor=FloorConfig(enabled=False), rollback=rollback))
    counter, ctx = _Counter(), FakeContext(step=1)
    guards = GuardState.register([("counter", counter), ("opefo", opefo)], None, {})
    opefo.attach(ctx, optimizer, model.named_parameters, str(tmp_path), guards)
    healthy = model.weight.detach().clone()
    assert opefo.on_step_end() == 1.0 and ctx.last(OPEFO_ROLLBACKS) == 0.0  # healthy: snapshot of step 1
    ctx.step, counter.n = 2, 7
    with torch.no_grad():
        model.weight.fill_(float("inf"))
    assert opefo.on_step_end() == 0.3  # rolled back: recovery learning rate, for the trainer to apply
    torch.testing.assert_close(model.weight.detach(), healthy)
    assert counter.n == 0 and ctx.last(OPEFO_ROLLBACKS) == 1.0
    assert [(step, kind) for step, kind, _ in ctx.events] == [(2, EVENT_ROLLBACK)]
    assert "non-finite parameters" in ctx.events[0][2]["cause"] and ctx.events[0][2]["snapshot_step"] == 1


def _wide_adam(width: int = 200) -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    return model, optimizer


def _repairing_opefo(tmp_path, optimizer, model, **rollback) -> tuple[StateRecovery, FakeContext]:
    config = RollbackConfig(snapshot_interval=1, check_interval=1, recovery_lr_factor=0.3, **rollback)
    opefo = StateRecovery(OpefoConfig(enabled=True, floor=FloorConfig(enabled=False), rollback=config))
    ctx = FakeContext(step=1)
    opefo.attach(ctx, optimizer, model.named_parameters, str(tmp_path), GuardState())
    assert opefo.on_step_end() == 1.0  # healthy: the snapshot of step 1
    return opefo, ctx


def test_opefo_repairs_a_few_nonfinite_moments_in_place_without_rollback_or_lr_cut(tmp_path, caplog) -> None:
    """An inf second moment and a NaN first moment (2 of 201 entries, finite weights): the two entries are reset
    (first moment 0, second moment the largest finite one of the weight's), nothing else changes, the learning rate
    keeps its factor 1 and no step is lost. The same fault again within recovery_steps is no one-off: rollback."""
    model, optimizer = _wide_adam()
    opefo, ctx = _repairing_opefo(tmp_path, optimizer, model, recovery_steps=100)
    state = optimizer.state[model.weight]
    largest = float(state["exp_avg_sq"].max())
    state["exp_avg_sq"][0, 5], state["exp_avg"][0, 7] = math.inf, math.nan
    m_before, v_before = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    weights = model.weight.detach().clone()
    ctx.step = 2
    model.weight.data.add_(1.0)  # the step's update, after the snapshot of step 1: a rollback would undo it
    assert opefo.on_step_end() == 1.0  # no LR cut
    assert opefo.policy.rollbacks == 0 and opefo.policy.repairs == 1 and ctx.last(OPEFO_REPAIRED_ENTRIES) == 2.0
    torch.testing.assert_close(model.weight.detach(), weights + 1.0)  # the update is kept
    assert state["exp_avg_sq"][0, 5] == largest and state["exp_avg_sq"][0, 7] == largest
    assert state["exp_avg"][0, 5] == 0.0 and state["exp_avg"][0, 7] == 0.0
    others = torch.ones_like(m_before, dtype=torch.bool)
    others[0, 5] = others[0, 7] = False
    assert torch.equal(state["exp_avg"][others], m_before[others])
    assert torch.equal(state["exp_avg_sq"][others], v_before[others])
    assert [(step, kind) for step, kind, _ in ctx.events] == [(2, EVENT_STATE_REPAIR)]
    assert ctx.events[0][2]["entries"] == 2
    ctx.step = 3
    state["exp_avg_sq"][0, 9] = math.inf
    with caplog.at_level("WARNING", logger="steadyrl.opefo"):
        assert opefo.on_step_end() == 0.3  # rolled back to step 1, LR cut
    assert opefo.policy.rollbacks == 1 and opefo.policy.repairs == 1
    assert "not repaired in place: the moments went non-finite again 1 steps after the repair at step 2" in caplog.text
    torch.testing.assert_close(model.weight.detach(), weights)


@pytest.mark.parametrize(
    ("fault", "rollback", "reason"),
    [
        ("many", {}, "3 of 201 moment entries are not finite, more than guards.opefo.rollback.repair_max_share=0.01"),
        ("one", {"repair_state": False}, None),
        ("weights", {}, "the weights are not finite"),
    ],
)
def test_opefo_rolls_back_instead_of_repairing(tmp_path, caplog, fault, rollback, reason) -> None:
    model, optimizer = _wide_adam()
    opefo, ctx = _repairing_opefo(tmp_path, optimizer, model, **rollback)
    state = optimizer.state[model.weight]
    if fault == "many":
        state["exp_avg_sq"][0, :3] = math.inf  # 3 of 201 entries: above 1%
    elif fault == "one":
        state["exp_avg_sq"][0, 0] = math.inf
    else:
        state["exp_avg_sq"][0, 0] = math.inf
        model.weight.data[0, 1] = math.nan
    ctx.step = 2
    with caplog.at_level("WARNING", logger="steadyrl.opefo"):
        assert opefo.on_step_end() == 0.3
    assert opefo.policy.rollbacks == 1 and opefo.policy.repairs == 0
    assert torch.isfinite(optimizer.state[model.weight]["exp_avg_sq"]).all()  # the snapshot's tensors
    if reason is None:  # repair off: the rollback says nothing about repairs, and no repair metric is logged
        assert "not repaired" not in caplog.text and not any(n == OPEFO_REPAIRS for n, _ in ctx.metrics)
    else:
        assert f"not repaired in place: {reason}" in caplog.text


def test_repair_moments_by_hand() -> None:
    """Bad where either moment is not finite; a tensor with no finite second moment takes the largest of the others;
    a non-contiguous state tensor is repaired in place too (a flat view of it would be a copy)."""
    a, b, c = (torch.nn.Parameter(torch.zeros(s)) for s in ((3,), (2,), (2, 2)))
    optimizer = torch.optim.AdamW([a, b, c])
    optimizer.state[a] = {
        "exp_avg": torch.tensor([0.1, 0.2, math.nan]),
        "exp_avg_sq": torch.tensor([1.0, math.inf, 4.0]),
    }
    optimizer.state[b] = {"exp_avg": torch.tensor([0.5, 0.6]), "exp_avg_sq": torch.tensor([math.nan, math.inf])}
    transposed = torch.tensor([[9.0, math.inf], [2.0, 3.0]]).t()  # non-contiguous
    optimizer.state[c] = {"exp_avg": torch.ones(2, 2), "exp_avg_sq": transposed}
    assert nonfinite_moment_entries(optimizer) == (5, 9)
    assert repair_moments(optimizer) == 5
    assert optimizer.state[a]["exp_avg"].tolist() == [torch.tensor(0.1).item(), 0.0, 0.0]
    assert optimizer.state[a]["exp_avg_sq"].tolist() == [1.0, 4.0, 4.0]
    assert optimizer.state[b]["exp_avg"].tolist() == [0.0, 0.0]
    assert optimizer.state[b]["exp_avg_sq"].tolist() == [9.0, 9.0]  # none finite: the largest of all, c's 9
    assert optimizer.state[c]["exp_avg_sq"] is transposed and transposed.tolist() == [[9.0, 2.0], [9.0, 3.0]]
    assert optimizer.state[c]["exp_avg"].tolist() == [[1.0, 1.0], [0.0, 1.0]]
    assert nonfinite_moment_entries(optimizer) == (0, 9)


def test_opefo_error_feedback_reinjects_a_skipped_gradient(tmp_path) -> None:
    model, optimizer = _adam_model()
    ef = ErrorFeedbackConfig(enabled=True)
    opefo = StateRecovery(OpefoConfig(enabled=True, floor=FloorConfig(enabled=False), error_feedback=ef))
    ctx = FakeContext()
    opefo.attach(ctx, optimizer, model.named_parameters, str(tmp_path), GuardState())
    gate = StepGate([], ctx, feedback=opefo.feedback, notes=opefo.notes)
    skipped = [p.grad.clone() for p in model.parameters()]
    gate.keep_skipped(skipped, 0)
    assert opefo.notes.check_now == "skipped step"
    grads = [torch.ones_like(g) for g in skipped]
    assert gate.feed_back(grads) and ctx.last(OPEFO_EF_WEIGHT) == pytest.approx(0.3)
    assert not torch.equal(grads[0], torch.ones_like(grads[0]))


def test_opefo_refuses_an_optimizer_without_adam_moments(tmp_path) -> None:
    """SGD (or Adafactor, 8-bit Adam) keeps no fp32 exp_avg / exp_avg_sq: OPEFO would report a NaN state finite."""
    model = torch.nn.Linear(3, 2)
    opefo = StateRecovery(OpefoConfig(enabled=True))
    with pytest.raises(TypeError, match=r"the optimizer is torch.optim.sgd.SGD, whose state it cannot read"):
        opefo.attach(FakeContext(), torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters, str(tmp_path),
                     GuardState())  # fmt: skip


def test_nested_timer_blocks_count_each_second_once_and_split_by_part(monkeypatch) -> None:
    import steadyrl.trainers.context as context_module
    from steadyrl.trainers.context import RuntimeContext

    # outer 10 -> 13 holding a middle block 11 -> 12.5 that holds an inner block 11.5 -> 12; then 20 -> 20.5
    clock = iter([10.0, 11.0, 11.5, 12.0, 12.5, 13.0, 20.0, 20.5])
    monkeypatch.setattr(context_module.time, "perf_counter", lambda: next(clock))
    ctx = RuntimeContext()
    with ctx.timer("pipeline"):
        with ctx.timer("quatro"):  # a timed hook calling a timed runtime: counted once in seconds
            with ctx.timer("gepo"):
                pass
    assert ctx.seconds == 3.0
    assert ctx.seconds_by_part == {"pipeline": 1.5, "quatro": 1.0, "gepo": 0.5}  # own time: 3 - 1.5, 1.5 - 0.5
    with pytest.raises(RuntimeError), ctx.timer("quatro"):  # an exception still stops the clock and pops the block
        raise RuntimeError("boom")
    assert ctx.seconds == 3.5 and ctx._timer_stack == []
    assert ctx.seconds_by_part["quatro"] == 1.5
    assert sum(ctx.seconds_by_part.values()) == ctx.seconds  # the parts add up to the total
