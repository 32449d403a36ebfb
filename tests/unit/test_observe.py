"""Observe mode per layer (docs/DESIGN.md, "Observe mode"): each decision is counted, and the training state it
would have changed (advantages, beta, entropy_coef, the keep mask, the gradients, the optimizer state) is not."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch
from fake_context import FakeContext, Quatro

from steadyrl.config import ConfigError, load_config
from steadyrl.config.guard_sections import GepoSection, GuardsSection
from steadyrl.evidence.history import History
from steadyrl.evidence.observe import format_observe_summary
from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.entropy_floor import EntropyConfig
from steadyrl.guards.error_feedback import ErrorFeedbackConfig
from steadyrl.guards.kl_controller import KLConfig
from steadyrl.guards.moment_floor import FloorConfig
from steadyrl.guards.opefo import OpefoConfig
from steadyrl.guards.quatro import QuatroConfig
from steadyrl.guards.replay import ReplayConfig
from steadyrl.guards.reward_scaler import GradeConfig, GradeScaler
from steadyrl.guards.robust_advantage import GEPOAdvantage
from steadyrl.guards.rollback import RollbackConfig
from steadyrl.guards.rollout_filters import FilterConfig, LengthConfig, ParrotConfig, ZeroVarianceConfig, ZScoreConfig
from steadyrl.guards.spike import SpikeConfig, SpikeGuard
from steadyrl.metrics import (
    GEPO_SKIPPED_STEPS,
    GEPO_WOULD_ADV_DIFF_MEAN,
    GEPO_WOULD_CLIP_ROWS,
    GEPO_WOULD_SKIP,
    GEPO_WOULD_STOP,
    GRADE_KL_FACTOR_WOULD,
    OPEFO_ROLLBACKS,
    OPEFO_WOULD_FEED_BACK,
    OPEFO_WOULD_FLOOR_ENTRIES,
    OPEFO_WOULD_REPAIR,
    OPEFO_WOULD_ROLLBACK,
    QUATRO_CLIP_SCALE_WOULD,
    QUATRO_ENTROPY_BONUS_WOULD,
    QUATRO_FLOOR_ACTIVE_WOULD,
    QUATRO_KL_COEF,
    QUATRO_KL_COEF_WOULD,
    QUATRO_PG_SCALE_WOULD,
    QUATRO_WOULD_FILTER_SHARE,
    gepo_would_skip,
    quatro_filtered,
    quatro_would_filter,
)
from steadyrl.trainers.advantage_pipeline import AdvantagePipeline, RewardBatch, compare_advantages
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.context import Controls, SavedTogether, TrainerSettings
from steadyrl.trainers.layers import guard_parts
from steadyrl.trainers.recovery import StateRecovery
from steadyrl.trainers.step_gate import StepGate

# ----------------------------------------------------------------------------------------------- config


def _config(tmp_path: Path, *overrides: str):
    path = tmp_path / "grpo.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            algorithm: grpo
            model: {path: some/model}
            data: {path: builtin:arithmetic}
            rewards: [{fn: exact_match}]
            trainer: {output_dir: out, per_device_train_batch_size: 8, num_generations: 4, bf16: false, beta: 0.04}
            """
        )
    )
    return load_config(path, list(overrides))


@pytest.mark.parametrize("layer", ["gepo", "opefo", "quatro", "grade"])
def test_mode_defaults_to_act_and_accepts_observe(tmp_path: Path, layer: str) -> None:
    assert getattr(_config(tmp_path).guards, layer).mode == "act"
    cfg = _config(tmp_path, f"guards.{layer}.enabled=true", f"guards.{layer}.mode=observe")
    assert getattr(cfg.guards, layer).observing


@pytest.mark.parametrize("layer", ["gepo", "opefo", "quatro", "grade"])
def test_an_unknown_mode_names_the_key_and_the_valid_values(tmp_path: Path, layer: str) -> None:
    with pytest.raises(
        ConfigError,
        match=rf"guards\.{layer}\.mode \(set in command line\): must be one of \['act', 'observe'\], got 'watch'",
    ):
        _config(tmp_path, f"guards.{layer}.mode=watch")


def test_observing_entropy_floor_may_sit_next_to_trls_adaptive_entropy(tmp_path: Path) -> None:
    on = ["guards.quatro.enabled=true", "trainer.use_adaptive_entropy=true"]
    assert _config(tmp_path, *on, "guards.quatro.mode=observe").guards.quatro.observing


def test_factories_fill_the_observe_keys_and_keep_opefos_acting_nonfinite_skip() -> None:
    g = GuardsSection()
    for section in (g.gepo, g.opefo, g.quatro, g.grade):
        section.enabled, section.mode = True, "observe"
    parts = guard_parts(g)
    assert parts.observe == {"gepo", "opefo", "quatro", "grade"}
    assert parts.advantage_fn is not None and parts.logprob_min is not None and parts.reward_processor is not None
    assert parts.step_guards_in(observing=False) == []
    assert len(parts.step_guards_in(observing=True)) == 1  # GEPO's; OPEFO's non-finite-only guard would only repeat it
    g.opefo.mode = "act"  # GEPO observes, OPEFO acts: a non-finite gradient must still not reach Adam's moments
    parts = guard_parts(g)
    (acting,) = parts.step_guards_in(observing=False)
    assert math.isinf(acting.config.min_ratio) and acting is parts.nonfinite_guard
    assert parts.step_guards_in(observing=True) == parts.step_guards and "opefo" not in parts.observe


# ----------------------------------------------------------------------------------------------- GEPO


def _model_with_grad(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.full_like(model.weight, value)
    return model


def test_gepo_observing_spike_guard_counts_the_would_skip_and_the_step_proceeds() -> None:
    ctx = FakeContext(step=3)
    guard = SpikeGuard(SpikeConfig(warmup_steps=1, min_ratio=5.0))
    gate = StepGate([], ctx, observers=[guard])
    for value in (1.0, 1.0, 100.0):  # norms sqrt(2), sqrt(2), 141
        model = _model_with_grad(value)
        _norm, skipped = gate.clip_or_skip(model, max_grad_norm=1.0)
        assert not skipped and model.weight.grad is not None
    assert float(model.weight.grad.norm()) == pytest.approx(1.0)  # taken and clipped as in plain TRL
    assert ctx.last(GEPO_WOULD_SKIP) == 1.0 and ctx.last(gepo_would_skip("spike")) == 1.0
    assert ctx.last(GEPO_SKIPPED_STEPS) == 0.0 and gate.counters["skipped_steps"] == 0
    assert ctx.events == []  # no skip event: nothing was skipped


def test_gepo_observing_guard_never_stops_the_run_it_counts_would_stop() -> None:
    ctx = FakeContext()
    gate = StepGate([], ctx, observers=[SpikeGuard(SpikeConfig(max_consecutive_skips=2))])
    for _ in range(3):
        norm, skipped = gate.clip_or_skip(_model_with_grad(float("nan")), max_grad_norm=1.0)
        assert not skipped and math.isnan(float(norm))  # the NaN goes on, as in plain TRL
    assert ctx.last(GEPO_WOULD_SKIP) == 3.0 and ctx.last(gepo_would_skip("nonfinite")) == 3.0
    assert ctx.last(GEPO_WOULD_STOP) == 2.0  # the 2nd and 3rd would have stopped an acting run


def test_gepo_observing_advantages_are_compared_and_trls_train() -> None:
    rewards = torch.tensor([0.0, 0.1, 0.2, 5.0, 1.0, 1.0, 0.0, 0.5])
    trl = AdvantagePipeline(scale_rewards="group")
    pipeline = AdvantagePipeline(None, GEPOAdvantage(3.0), "group", observe_advantages=True)
    expected, _ = trl.advantages(rewards, None, 4)
    advantages, metrics = pipeline.advantages(rewards, None, 4)
    assert torch.equal(advantages, expected)
    assert torch.equal(expected, group_normalized_advantages(rewards.view(2, 4), scale_rewards="group").view(-1))
    robust = GEPOAdvantage(3.0)(rewards.view(2, 4)).view(-1)
    assert metrics[GEPO_WOULD_ADV_DIFF_MEAN] == pytest.approx(float((robust - expected).abs().mean()))
    assert metrics[GEPO_WOULD_CLIP_ROWS] >= 1  # the outlier 5.0: its z-score is far beyond the clip


def test_would_clip_rows_counts_only_rows_the_tanh_shrinks_by_more_than_ten_percent() -> None:
    c = 3.0
    z = torch.tensor([0.1, 1.0, 1.6, 1.8, 10.0], dtype=torch.float64)  # tanh(x)/x = 0.9 at x = 0.5716 (z 1.715)
    metrics = compare_advantages(c * torch.tanh(z / c), torch.zeros(5), c)
    assert metrics[GEPO_WOULD_CLIP_ROWS] == 2.0


# ----------------------------------------------------------------------------------------------- GRADE


def test_grade_observing_scales_and_logs_but_the_raw_rewards_go_on() -> None:
    grade = GradeScaler(GradeConfig(warmup=2, clip_start=2, window_size=64))
    pipeline = AdvantagePipeline(grade, None, "group", kl_compensation=(0.5, 2.0), observe_rewards=True)
    raw = torch.tensor([[0.1], [0.9], [0.4], [7.0]])
    batch = RewardBatch(raw, ["a", "a", "b", "b"], 2, torch.ones(1))
    for _ in range(3):
        scaled = pipeline.scale(batch)
    assert torch.equal(scaled.rewards, raw.view(-1)) and scaled.kl_factor is None  # beta is left alone
    assert math.isfinite(scaled.metrics[GRADE_KL_FACTOR_WOULD])
    acting = AdvantagePipeline(GradeScaler(GradeConfig(warmup=2, clip_start=2, window_size=64)), None, "group")
    for _ in range(3):
        acted = acting.scale(batch)
    assert not torch.equal(acted.rewards, raw.view(-1))  # what observe mode withheld


# ----------------------------------------------------------------------------------------------- QUATRO

SETUP = TrainerSettings(beta=0.04, seed=0, pad_token_id=0, loss_type="dapo", entropy_coef=0.0)


def _quatro(**parts) -> tuple[Quatro, FakeContext]:
    quatro = Quatro(QuatroConfig(**parts), SETUP, FakeContext(step=1), observe=True)
    return quatro, quatro.ctx


def test_quatro_observing_controllers_set_nothing_and_log_what_they_would() -> None:
    kl = KLConfig(enabled=True, target=1e-6)
    entropy = EntropyConfig(floor_ratio=0.8, baseline_steps=1, window=1)
    quatro, _ctx = _quatro(kl=kl, entropy=entropy)
    for kl_value, ent in ((0.5, 2.0), (0.5, 0.1), (0.5, 0.1)):  # KL far above target; entropy falls below the floor
        quatro.loss.record_micro_batch({"completion_mask": torch.ones(1, 4)}, kl_value, ent)
        controls, metrics = quatro.end.control_step()
        assert controls == Controls()  # nothing for the trainer to write: TRL's beta and entropy_coef stay
    assert metrics[QUATRO_KL_COEF_WOULD] == pytest.approx(0.04 * 1.2**3) and QUATRO_KL_COEF not in metrics
    # floor 0.8 x 2.0 = 1.6, gap (1.6 - 0.1) / 1.6 = 0.9375 on two steps: control 2 x 0.1 x gap + 0.4 x gap = 0.5625,
    # bonus 0.01 x 0.5625
    assert metrics[QUATRO_FLOOR_ACTIVE_WOULD] == 1.0 and metrics[QUATRO_ENTROPY_BONUS_WOULD] == pytest.approx(0.005625)
    assert metrics[QUATRO_CLIP_SCALE_WOULD] == 0.5
    assert quatro.end.controls() == Controls()  # also after a resume (load_steady_state applies controls())
    state = SavedTogether({"kl": quatro.end.kl, "entropy": quatro.end.entropy}, "").state_dict()
    again, _ = _quatro(kl=kl, entropy=entropy)
    SavedTogether({"kl": again.end.kl, "entropy": again.end.entropy}, "").load_state_dict(state)
    assert again.end.would_controls() == quatro.end.would_controls() != Controls()


def test_quatro_observing_filters_log_would_drops_and_keep_every_row() -> None:
    filters = FilterConfig(
        zscore=ZScoreConfig(enabled=False),
        length=LengthConfig(enabled=False),
        parrot=ParrotConfig(enabled=False),
        zero_variance=ZeroVarianceConfig(enabled=False),
    )
    quatro, ctx = _quatro(filters=filters)
    output = {
        "prompt_ids": torch.tensor([[5, 6], [5, 6]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7]]),  # the second repeats its 3-grams
    }
    keep = quatro.rollout.filter_generation(output, torch.tensor([0.0, 1.0]), torch.tensor([6, 6]), num_generations=2)
    assert keep is None  # the trainer masks nothing and computes advantages over every row
    assert ctx.last(quatro_would_filter("repetition")) == 1.0 and ctx.last(QUATRO_WOULD_FILTER_SHARE) == 0.5
    assert not any(name == quatro_filtered("repetition") for name, _ in ctx.metrics)


def test_quatro_observing_replay_is_inactive_and_says_so(caplog) -> None:
    with caplog.at_level("INFO", logger="steadyrl.quatro"):
        quatro, _ = _quatro(replay=ReplayConfig())
    assert not quatro.rollout.replay_on(True) and quatro.rollout.replay is None
    assert "replay is inactive in observe mode" in caplog.text


# ----------------------------------------------------------------------------------------------- OPEFO


def _adam_model() -> tuple[torch.nn.Linear, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def _opefo(tmp_path: Path, **config) -> tuple[StateRecovery, FakeContext, torch.nn.Linear, torch.optim.AdamW]:
    model, optimizer = _adam_model()
    opefo = StateRecovery(OpefoConfig(enabled=True, **config), observe=True)
    ctx = FakeContext(step=1)
    opefo.attach(ctx, optimizer, model.named_parameters, str(tmp_path), GuardState())
    return opefo, ctx, model, optimizer


def _state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def test_opefo_observing_floor_counts_the_entries_it_would_raise_and_changes_none(tmp_path: Path) -> None:
    opefo, ctx, _, optimizer = _opefo(tmp_path, floor=FloorConfig(interval=1, trigger_frac=0.0))
    weight_state = optimizer.state[next(iter(optimizer.state))]
    weight_state["exp_avg_sq"].view(-1)[:2] = 0.0  # 2 of 3 entries underflowed
    before = _state(optimizer)
    assert opefo.on_step_end() is None  # no LR factor in observe mode
    assert all(torch.equal(a, b) for a, b in zip(before, _state(optimizer), strict=True))
    assert ctx.last(OPEFO_WOULD_FLOOR_ENTRIES) == 2.0 and opefo.floor.floored_groups == 0
    assert opefo.store is None  # no snapshot in observe mode


def test_opefo_observing_check_counts_a_would_rollback_and_restores_nothing(tmp_path: Path) -> None:
    rollback = RollbackConfig(check_interval=1)
    opefo, ctx, _model, optimizer = _opefo(tmp_path, floor=FloorConfig(enabled=False), rollback=rollback)
    next(iter(optimizer.state.values()))["exp_avg_sq"].view(-1)[0] = math.inf
    before = _state(optimizer)
    assert opefo.on_step_end() is None
    assert ctx.last(OPEFO_WOULD_ROLLBACK) == 1.0 and opefo.policy.rollbacks == 0
    assert all(torch.equal(a, b) for a, b in zip(before, _state(optimizer), strict=True))
    assert not any(name == OPEFO_ROLLBACKS for name, _ in ctx.metrics) and ctx.events == []
    state = opefo.state_dict()  # the counts survive a resume
    again, _, _, _ = _opefo(tmp_path, floor=FloorConfig(enabled=False), rollback=rollback)
    again.load_state_dict(state)
    assert again.would["rollback"] == 1


def test_opefo_observing_counts_a_would_repair_for_a_few_bad_entries_and_changes_nothing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 1)  # 201 entries: one bad one is under repair_max_share, so act mode would repair
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 200)).sum().backward()
    optimizer.step()
    opefo = StateRecovery(OpefoConfig(enabled=True, floor=FloorConfig(enabled=False)), observe=True)
    ctx = FakeContext(step=10)
    opefo.attach(ctx, optimizer, model.named_parameters, str(tmp_path), GuardState())
    optimizer.state[model.weight]["exp_avg_sq"][0, 3] = math.inf
    before = _state(optimizer)
    assert opefo.on_step_end() is None
    assert ctx.last(OPEFO_WOULD_REPAIR) == 1.0 and ctx.last(OPEFO_WOULD_ROLLBACK) == 0.0
    assert opefo.policy.repairs == 0 and opefo.policy.rollbacks == 0 and ctx.events == []
    assert all(torch.equal(a, b) for a, b in zip(before, _state(optimizer), strict=True))


def test_opefo_observing_error_feedback_keeps_nothing_and_injects_nothing(tmp_path: Path) -> None:
    ef = ErrorFeedbackConfig(enabled=True)
    opefo, ctx, model, _ = _opefo(tmp_path, floor=FloorConfig(enabled=False), error_feedback=ef)
    gate = StepGate([], ctx, feedback=opefo.feedback, notes=opefo.notes, would=opefo.would)
    gate.keep_skipped([p.grad.clone() for p in model.parameters()], 1)  # an acting guard skipped this step
    grads = [torch.ones(2), torch.ones(3)]
    assert not gate.feed_back(grads) and all(torch.equal(g, torch.ones_like(g)) for g in grads)
    assert not opefo.feedback.pending
    opefo.on_step_end()
    assert ctx.last(OPEFO_WOULD_FEED_BACK) == 1.0


# ----------------------------------------------------------------------------------------------- doctor


def _observe_rows() -> list[dict]:
    rows = []
    for t in range(1, 11):
        rows.append(
            {
                "step": t,
                GEPO_WOULD_SKIP: float(t >= 4) + float(t >= 7),
                gepo_would_skip("spike"): float(t >= 4) + float(t >= 7),
                GEPO_WOULD_ADV_DIFF_MEAN: 0.2,
                OPEFO_WOULD_ROLLBACK: 0.0,
                OPEFO_WOULD_FLOOR_ENTRIES: 0.0,
                QUATRO_KL_COEF_WOULD: 0.04 * 0.8**t,
                QUATRO_WOULD_FILTER_SHARE: 0.25,
                quatro_would_filter("length"): 2.0,
            }
        )
    return rows


def test_doctor_summary_says_what_each_observing_layer_would_have_done(tmp_path: Path) -> None:
    history = History(rows=_observe_rows())
    text = format_observe_summary(history)
    assert "GEPO (guards.gepo.mode: observe)" in text
    assert "would have skipped 2 of 10 optimizer steps (spike 2)" in text
    assert "guards.gepo.mode=act applies it" in text
    assert "OPEFO (guards.opefo.mode: observe)" in text and "0 finiteness checks" in text
    assert "OPEFO (guards.opefo.mode: observe):\n    - 0 finiteness" in text
    opefo_block = text.split("OPEFO")[1]
    assert "it would not have intervened in this run" in opefo_block
    assert "would drop 25.0% of rows" in text and "length 2" in text
    # with the run's resolved config: the layers it names, and trainer.beta for the KL comparison
    (tmp_path / "resolved_config.yaml").write_text(
        "trainer: {beta: 0.04}\nguards:\n  quatro: {enabled: true, mode: observe}\n  gepo: {enabled: true, mode: act}\n"
    )
    text = format_observe_summary(history, tmp_path)
    assert "QUATRO" in text and "GEPO" not in text and "(trainer.beta 0.04 stayed)" in text
    assert format_observe_summary(History(rows=[{"step": 1, "loss": 0.1}])) == ""


def test_doctor_summary_reports_the_entropy_floors_would_be_levers() -> None:
    """The floor would have been active on 2 of 4 logged steps, with a bonus up to 0.006, the clip range down to 0.5
    and the brake scaling the policy gradient down to 0.4x (its factor logged 1.0 while the floor was off)."""
    rows = [
        {"step": t, QUATRO_ENTROPY_BONUS_WOULD: bonus, QUATRO_FLOOR_ACTIVE_WOULD: active, QUATRO_PG_SCALE_WOULD: scale,
         QUATRO_CLIP_SCALE_WOULD: 0.5}
        for t, (bonus, active, scale) in enumerate([(0, 0, 1.0), (0.004, 1, 0.6), (0.006, 1, 0.4), (0, 0, 1.0)], 1)
    ]  # fmt: skip
    text = format_observe_summary(History(rows=rows))
    assert (
        "entropy floor: would be active at 2 logged step(s), bonus up to 0.006, clip scale down to 0.5 while active, "
        "policy gradient scaled down to 0.4x by the brake" in text
    )


def test_gepo_section_observing_needs_enabled() -> None:
    assert not GepoSection(mode="observe").observing and GepoSection(enabled=True, mode="observe").observing


def test_steadyrl_doctor_prints_the_observe_summary(tmp_path: Path, capsys) -> None:
    import json

    from steadyrl.cli import main

    rows = [{**r, "loss": 0.1, "grad_norm": 1.0, "reward": 0.5} for r in _observe_rows()]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "resolved_config.yaml").write_text(
        "trainer: {beta: 0.04}\nguards:\n"
        "  gepo: {enabled: true, mode: observe}\n  quatro: {enabled: true, mode: observe}\n"
    )
    main(["doctor", str(tmp_path)])
    out = capsys.readouterr().out
    assert "observe mode: what the observing layers would have done (none of it was applied)" in out
    assert out.index("QUATRO (guards.quatro.mode: observe)") < out.index("GEPO (guards.gepo.mode: observe)")
    assert "would have skipped 2 of 10 optimizer steps" in out
