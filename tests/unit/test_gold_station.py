"""The gold watch as a station (steadyrl/trainers/gold.py) and what ``trl_state`` writes for it: the decisions per
eval, the tightening that compounds per rollback and survives a resume, the one learning-rate writer (a schedule
that rewrites the groups every step, as a DeepSpeed scheduler block does, keeps the watch's factor), the rollouts
dropped after a restore, and the watch's state left out of OPEFO's snapshots and of the beta factors they restore."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from steadyrl.guards.gold_watch import EvalPoint, GoldConfig
from steadyrl.guards.replay import ReplayBuffer
from steadyrl.trainers import trl_state
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.gold import GoldStation

NAN = math.nan


def _judge_all(station: GoldStation, golds: list[float], kept: bool = True) -> list[str]:
    return [station.judge(EvalPoint(10 * i, g, 1.0), kept).action for i, g in enumerate(golds)]


def test_each_confirmed_fall_rolls_back_and_compounds_the_tightening_until_the_stop():
    station = GoldStation(GoldConfig(confirm=1, max_rollbacks=2))
    assert _judge_all(station, [0.8, 0.5]) == ["keep", "rollback"]
    assert (station.rollbacks, station.tightenings, station.lr_factor, station.beta_factor) == (1, 1, 0.5, 2.0)
    assert _judge_all(station, [0.5]) == ["rollback"]
    assert (station.lr_factor, station.beta_factor) == (0.25, 4.0)
    assert _judge_all(station, [0.5]) == ["stop"]  # the third: past max_rollbacks, restore and end; no tightening
    assert (station.rollbacks, station.tightenings, station.stopped) == (3, 2, True)
    stop_first = GoldStation(GoldConfig(confirm=1, action="stop"))
    assert _judge_all(stop_first, [0.8, 0.5]) == ["keep", "stop"] and stop_first.lr_factor == 1.0


def test_nothing_to_restore_or_observing_only_warns_and_never_tightens():
    observing = GoldStation(GoldConfig(confirm=1), observe=True)
    assert _judge_all(observing, [0.8, 0.5, 0.5]) == ["none", "warn", "warn"]  # keeps nothing either
    assert (observing.rollbacks, observing.tightenings) == (2, 0)
    unkept = GoldStation(GoldConfig(confirm=1))
    assert _judge_all(unkept, [0.8, 0.5], kept=False) == ["keep", "warn"] and unkept.lr_factor == 1.0
    no_save = GoldStation(GoldConfig(confirm=1, save_best=False))
    assert _judge_all(no_save, [0.8], kept=False) == ["none"]


def test_mode_min_words_the_evidence_as_a_rise():
    station = GoldStation(GoldConfig(confirm=1, mode="min"))
    station.judge(EvalPoint(10, 0.2, 1.0), True)
    decision = station.judge(EvalPoint(20, 0.4, 1.0), True)
    assert decision.action == "rollback" and "rose from 0.2 at step 10 to 0.4 at step 20" in decision.evidence
    assert "above it" in decision.evidence


def test_the_tightening_is_state_and_a_state_from_before_it_loads_untightened():
    station = GoldStation(GoldConfig(confirm=1))
    _judge_all(station, [0.8, 0.5])
    again = GoldStation(GoldConfig(confirm=1))
    again.load_state_dict(station.state_dict())
    assert (again.tightenings, again.lr_factor, again.detector.best_gold) == (1, 0.5, 0.8)
    legacy = {k: v for k, v in station.state_dict().items() if k != "tightenings"}  # its LR cut was in base_lrs
    old = GoldStation(GoldConfig(confirm=1))
    old.load_state_dict(legacy)
    assert (old.rollbacks, old.tightenings, old.lr_factor) == (1, 0, 1.0)


def _fake_trainer(lr: float = 1.0, beta: float = 0.04) -> SimpleNamespace:
    logged: list[tuple[str, float]] = []
    return SimpleNamespace(
        lr_factors={}, lr_scale=trl_state.LearningRateScale(),
        optimizer=SimpleNamespace(param_groups=[{"lr": lr}, {"lr": lr / 10}]),
        _guard_metric=lambda name, value: logged.append((name, value)), logged=logged,
        beta_base=beta, beta_factors={}, beta=beta,
    )  # fmt: skip


def test_one_writer_keeps_the_watch_factor_under_a_schedule_that_rewrites_the_groups_every_step():
    t = _fake_trainer()
    trl_state.set_gold_factors(t, 0.5, 2.0, now=True)  # at the rollback: this very step trains at half the rate
    assert [g["lr"] for g in t.optimizer.param_groups] == [0.5, 0.05] and t.beta == pytest.approx(0.08)
    for step in range(3):  # a DeepSpeed scheduler block writes its LR into the groups at every step
        for g, lr in zip(t.optimizer.param_groups, (1.0, 0.1), strict=True):
            g["lr"] = lr
        trl_state.apply_lr_factors(t, 0.1 if step == 1 else 1.0)  # OPEFO's recovery factor on one step
        expected = [0.05, 0.005] if step == 1 else [0.5, 0.05]
        assert [g["lr"] for g in t.optimizer.param_groups] == pytest.approx(expected), step
    assert ("opefo/lr_factor", 0.1) in t.logged
    # a schedule that leaves the groups alone (constant): never compounds
    for _ in range(3):
        trl_state.apply_lr_factors(t, 1.0)
    assert [g["lr"] for g in t.optimizer.param_groups] == pytest.approx([0.5, 0.05])


def test_a_resume_sets_the_factor_for_the_next_step_end_and_beta_at_once():
    t = _fake_trainer(lr=0.25)  # the checkpoint's groups: already scaled by the watch's 0.25
    trl_state.set_gold_factors(t, 0.25, 4.0, now=False)
    assert t.optimizer.param_groups[0]["lr"] == 0.25 and t.lr_factors == {"gold": 0.25}  # not scaled twice
    assert t.beta == pytest.approx(0.16)
    untightened = _fake_trainer()
    trl_state.set_gold_factors(untightened, 1.0, 1.0, now=True)
    assert untightened.lr_factors == {} and untightened.beta_factors == {}  # nothing written for a run never cut
    no_kl = _fake_trainer(beta=0.0)
    trl_state.set_gold_factors(no_kl, 0.5, 2.0, now=True)
    assert no_kl.beta_factors == {} and no_kl.beta == 0.0


def test_the_watch_state_stays_out_of_opefo_snapshots_and_of_the_restored_beta_factors():
    t = _fake_trainer()
    trl_state.set_beta_factor(t, "quatro_kl", 1.5)
    trl_state.set_gold_factors(t, 0.5, 2.0, now=True)
    betas = trl_state.BetaFactors(t)
    saved = betas.state_dict()
    assert saved == {"factors": {"quatro_kl": 1.5}}
    trl_state.set_beta_factor(t, "quatro_kl", 3.0)
    betas.load_state_dict(saved)  # an OPEFO rollback restores the controllers' factor, not the watch's
    assert t.beta_factors == {"quatro_kl": 1.5, "gold": 2.0} and t.beta == pytest.approx(0.04 * 3.0)
    owner, watch = SimpleNamespace(state_dict=lambda: {"o": 1}), GoldStation(GoldConfig())
    state = GuardState({"gold": watch, "opefo": owner, "beta_factors": betas}, counters={})
    assert set(state.snapshot_state_dicts(owner)) == {"beta_factors"}
    assert set(state.guard_state_dicts()) == {"gold", "opefo", "beta_factors"}  # checkpoints keep it all


def test_a_restore_drops_trls_buffered_rollouts_and_the_replay_rows():
    replay = ReplayBuffer(seed=0)
    row = {"prompt_ids": torch.ones(1, 2, dtype=torch.long), "prompt_mask": torch.ones(1, 2, dtype=torch.long),
           "completion_ids": torch.ones(1, 3, dtype=torch.long), "completion_mask": torch.ones(1, 3, dtype=torch.long),
           "advantages": torch.tensor([1.0]), "old_per_token_logps": torch.zeros(1, 3)}  # fmt: skip
    replay.add(row, step=1)
    assert len(replay) == 1
    t = SimpleNamespace(_buffered_inputs=[row], rollout=SimpleNamespace(replay=replay))
    trl_state.drop_buffered_rollouts(t)
    assert t._buffered_inputs is None and len(replay) == 0  # TRL generates afresh from the restored policy
    bare = SimpleNamespace(_buffered_inputs=[row])  # no replay (PPO, or replay off)
    trl_state.drop_buffered_rollouts(bare)
    assert bare._buffered_inputs is None


def test_trls_eval_gives_the_weight_0_rewards_mean_and_its_standard_error_over_prompts():
    from steadyrl.trainers.gold import trl_eval_metric, trl_eval_se

    names, config = ["accuracy_proxy", "judge", "exact"], GoldConfig()
    assert trl_eval_metric(config, names, [1.0, 0.5, 0.0]) == ("eval_rewards/exact/mean", "")
    assert trl_eval_metric(GoldConfig(metric="eval_reward"), names, [1.0, 1.0, 1.0]) == ("eval_reward", "")
    key, why = trl_eval_metric(config, names, [1.0, 0.0, 0.0])  # two candidates: which one is gold is not guessed
    assert key is None and "found 2 (judge, exact)" in why and "quatro.gold.metric" in why
    row = {"eval_rewards/exact/mean": 0.6, "eval_rewards/exact/std": 0.5}
    assert trl_eval_se(row, "eval_rewards/exact/mean", 25) == pytest.approx(0.1)  # 0.5 / sqrt(25 prompts)
    assert trl_eval_se(row, "eval_rewards/exact/mean", 0) is None and trl_eval_se(row, "eval_reward", 25) is None
