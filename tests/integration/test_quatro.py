"""QUATRO in real tiny GRPO runs: adaptive KL, entropy floor, rollout filters, exact resume (replay included;
replay itself: test_replay.py)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback

from steadyrl.faults import repetition_reward
from steadyrl.guards import entropy_floor
from steadyrl.guards.entropy_floor import EntropyConfig
from steadyrl.guards.kl_controller import KLConfig
from steadyrl.guards.quatro import QuatroConfig
from steadyrl.guards.replay import ReplayConfig
from steadyrl.guards.reward_scaler import GradeConfig, GradeScaler
from steadyrl.guards.rollout_filters import (
    FilterConfig,
    LengthConfig,
    ParrotConfig,
    RepetitionConfig,
    ZeroVarianceConfig,
    ZScoreConfig,
)
from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.grpo import load_steady_state
from steadyrl.trainers.layers import GuardParts
from tests.integration.helpers import assert_same_weights, byte_mean, grpo_args, per_step, small_dataset, weights
from tests.unit.reference_rollout_filters import repeat_share

pytestmark = pytest.mark.slow


class AfterGuards(TrainerCallback):
    """What steadyrl set at each step end (it runs first): beta, its factors, entropy_coef, epsilon."""

    def __init__(self, trainer):
        self.trainer, self.rows = trainer, []

    def on_step_end(self, args, state, control, **kwargs):
        t = self.trainer
        self.rows.append(dict(beta=t.beta, factors=dict(t.beta_factors), coef=t.entropy_coef, eps=t.epsilon_low))


def _trainer(model_dir, out, quatro, reward=byte_mean, observe=False, **args):
    trainer = SteadyGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward],
        args=grpo_args(out, **args),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        guards=GuardParts(quatro=quatro, observe=frozenset({"quatro"} if observe else ())),
    )
    after = AfterGuards(trainer)
    trainer.add_callback(after)
    return trainer, after


def test_adaptive_kl_moves_beta_toward_the_target_and_composes_with_grade(tiny_model_dir, tmp_path):
    """Target 1e-9: step 1's KL is 0 (policy == reference) -> beta x 0.8; afterwards KL > target -> x 1.2 each
    step. The effective beta is beta_base x quatro_kl x grade at every step."""
    quatro = QuatroConfig(kl=KLConfig(enabled=True, target=1e-9, beta_range=[0.25, 4.0]))
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(tmp_path / "kl", max_steps=5, beta=0.04),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        guards=GuardParts(reward_processor=GradeScaler(GradeConfig()), kl_compensation=(0.5, 2.0), quatro=quatro),
    )
    after = AfterGuards(trainer)
    trainer.add_callback(after)
    trainer.train()
    history = trainer.state.log_history
    kl_logged = per_step(history, "kl")  # TRL's metric (one micro-batch per step: equal to quatro/kl_mean)
    assert per_step(history, "quatro/kl_mean") == pytest.approx(kl_logged, rel=1e-6, abs=1e-12)
    assert kl_logged[0] == 0.0 and all(k > 1e-9 for k in kl_logged[1:])
    expected, coef = [], 0.04
    for k in kl_logged:
        coef *= 1.2 if k > 1e-9 else 0.8
        expected.append(coef)
    assert per_step(history, "quatro/kl_coef") == pytest.approx(expected, rel=1e-12)
    assert per_step(history, "quatro/kl_target") == [1e-9] * 5
    for row in after.rows:
        assert set(row["factors"]) == {"grade", "quatro_kl"}
        assert row["beta"] == pytest.approx(0.04 * row["factors"]["grade"] * row["factors"]["quatro_kl"], rel=1e-12)
    assert [r["factors"]["quatro_kl"] for r in after.rows] == pytest.approx([c / 0.04 for c in expected], rel=1e-12)
    assert per_step(history, "quatro/beta") == pytest.approx([r["beta"] for r in after.rows], rel=1e-12)


def test_entropy_floor_activates_on_a_collapsing_run(tiny_model_dir, tmp_path):
    """A reward that pays for repeating one character, lr 3e-2: entropy falls below 0.95 x its 2-step baseline.
    While the floor is active the next steps run with TRL's entropy bonus > 0 and epsilon x 0.5."""
    cfg = EntropyConfig(baseline_steps=2, window=2, floor_ratio=0.95, ki=0.1, coef_max=0.05)
    quatro = QuatroConfig(entropy=cfg)
    trainer, after = _trainer(
        tiny_model_dir, tmp_path / "ent", quatro, reward=repetition_reward, max_steps=10, learning_rate=3e-2,
        max_completion_length=8,
    )  # fmt: skip
    assert trainer._entropy_bonus_enabled and trainer.entropy_coef == 0.0
    trainer.train()
    history = trainer.state.log_history
    active = per_step(history, "quatro/floor_active")
    bonus = per_step(history, "quatro/entropy_bonus")
    assert len(active) == 10 and max(active) == 1.0, per_step(history, "quatro/entropy")
    floor = per_step(history, "quatro/entropy_floor")
    assert len(floor) == 10 - 1  # NaN (not logged) until the baseline exists, i.e. at step 1
    for row, on, b in zip(after.rows, active, bonus, strict=True):
        assert row["coef"] == b
        assert row["eps"] == pytest.approx(0.2 * (0.5 if on else 1.0))
        if on:
            assert b > 0
    # TRL logs the entropy_coef it applied: the step after the floor turned on runs with a positive bonus
    first = active.index(1.0)
    assert first + 1 < 10 and bonus[first] > 0
    assert per_step(history, "entropy_coef")[first + 1] == pytest.approx(bonus[first])


def test_the_trainer_feeds_the_floors_learning_gate_each_steps_training_reward(tiny_model_dir, tmp_path, monkeypatch):
    """The gate reads what the trainer trained on: after 6 steps its window holds the last 4 steps' mean training
    rewards, the ones TRL logs as ``reward`` (gathered, weighted), and ``quatro/floor_held_off`` is logged."""
    monkeypatch.setattr(entropy_floor, "GATE_WINDOW", 4)
    cfg = EntropyConfig(baseline_steps=2, window=2, floor_ratio=0.95)
    quatro = QuatroConfig(entropy=cfg)
    trainer, _ = _trainer(
        tiny_model_dir, tmp_path / "gate", quatro, reward=repetition_reward, max_steps=6, learning_rate=3e-2,
        max_completion_length=8,
    )  # fmt: skip
    trainer.train()
    history = trainer.state.log_history
    logged = per_step(history, "reward")
    assert len(logged) == 6
    assert list(trainer.step_end.entropy._rewards) == pytest.approx(logged[-4:], rel=1e-5)
    assert len(per_step(history, "quatro/floor_held_off")) == 6


def test_the_gate_reads_the_named_reward_not_the_trained_one(tiny_model_dir, tmp_path, monkeypatch):
    """``gate_reward`` names a weight-0 reward (``byte_mean``) next to the trained one (``repetition_reward``): the
    gate's window holds the last 4 steps' means of *that* reward as TRL logs it, not the weighted training reward."""
    monkeypatch.setattr(entropy_floor, "GATE_WINDOW", 4)
    cfg = EntropyConfig(baseline_steps=2, window=2, floor_ratio=0.95, gate_reward="byte_mean")
    quatro = QuatroConfig(entropy=cfg)
    trainer = SteadyGRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[repetition_reward, byte_mean],
        args=grpo_args(tmp_path / "named", max_steps=6, learning_rate=3e-2, max_completion_length=8,
                       reward_weights=[1.0, 0.0]),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        guards=GuardParts(quatro=quatro),
    )  # fmt: skip
    assert trainer.rollout.gate_column == 1
    trainer.train()
    history = trainer.state.log_history
    watched, trained = per_step(history, "rewards/byte_mean/mean"), per_step(history, "reward")
    assert len(watched) == len(trained) == 6
    assert list(trainer.step_end.entropy._rewards) == pytest.approx(watched[-4:], rel=1e-5)
    assert trained[-4:] != pytest.approx(watched[-4:], rel=1e-3)  # the two rewards differ: the test can tell them


class Recorder:
    """Wraps ``_generate_and_score_completions`` to keep each generation batch's output."""

    def __init__(self, trainer):
        self.outputs = []
        original = trainer._generate_and_score_completions

        def wrapped(inputs):
            out = original(inputs)
            self.outputs.append({k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)})
            return out

        trainer._generate_and_score_completions = wrapped


def _only_repetition(n: int = 1, share: float = 0.0, dropped_rows: str = "zero_advantage") -> FilterConfig:
    return FilterConfig(
        dropped_rows=dropped_rows,
        zscore=ZScoreConfig(enabled=False),
        length=LengthConfig(enabled=False),
        parrot=ParrotConfig(enabled=False),
        repetition=RepetitionConfig(n=n, max_repeat_share=share),
        zero_variance=ZeroVarianceConfig(enabled=False),
        max_drop_share=1.0,
    )


@pytest.mark.parametrize("dropped_rows", ["zero_advantage", "exclude"])
def test_repetition_filter_drops_and_counts_exactly(tiny_model_dir, tmp_path, dropped_rows):
    """Repetition filter alone (n=1, share > 0: any token twice): the per-step count equals the number of completions
    with a repeated token and a reward above their group's mean (recomputed here from the token ids and the
    rewards); those rows train with advantage 0. Under
    ``zero_advantage`` (default) they keep their completion mask and count in num_items_in_batch, so the kept rows'
    weight is that of an unfiltered batch; under ``exclude`` their mask is 0 and num_items_in_batch counts only the
    kept rows' tokens."""
    quatro = QuatroConfig(filters=_only_repetition(dropped_rows=dropped_rows))
    trainer, _ = _trainer(tiny_model_dir, tmp_path / "rep", quatro, max_steps=4, max_completion_length=16)
    recorder = Recorder(trainer)
    ids_per_step, paid_per_step = [], []
    original = trainer._calculate_rewards

    def calc(inputs, prompts, completions, completion_ids_list):
        ids_per_step.append([list(ids) for ids in completion_ids_list])
        rewards_per_func = original(inputs, prompts, completions, completion_ids_list)
        rewards = (rewards_per_func * trainer.reward_weights.to(rewards_per_func.device)).sum(dim=1).tolist()
        means = [sum(rewards[g : g + 4]) / 4 for g in range(0, len(rewards), 4)]
        paid_per_step.append([r > means[i // 4] for i, r in enumerate(rewards)])
        return rewards_per_func

    trainer._calculate_rewards = calc
    trainer.train()
    counts = per_step(trainer.state.log_history, "quatro/filtered/repetition")
    repeats = [[repeat_share(ids, 1) > 0.0 for ids in step] for step in ids_per_step]
    expected = [sum(a and b for a, b in zip(r, p, strict=True)) for r, p in zip(repeats, paid_per_step, strict=True)]
    assert counts == expected and sum(expected) > 0 and all(c < 8 for c in expected), expected
    assert sum(map(sum, repeats)) > sum(expected)  # repeated rows below their group's mean keep their signal
    for ids, paid, out in zip(ids_per_step, paid_per_step, recorder.outputs, strict=True):
        dropped = torch.tensor([repeat_share(c, 1) > 0.0 and up for c, up in zip(ids, paid, strict=True)])
        lengths = torch.tensor([len(c) for c in ids])
        assert torch.all(out["advantages"][dropped] == 0)
        kept_lengths = out["completion_mask"][~dropped].sum(dim=1)
        assert torch.equal(kept_lengths, lengths[~dropped])
        if dropped_rows == "exclude":
            assert torch.all(out["completion_mask"][dropped] == 0)
            assert int(out["num_items_in_batch"]) == int(kept_lengths.sum())
        else:
            assert torch.equal(out["completion_mask"].sum(dim=1), lengths)
            assert int(out["num_items_in_batch"]) == int(lengths.sum())
        # the kept rows of a group are normalised among themselves: each group with >= 2 kept rows has mean 0
        for g in range(2):
            rows = slice(4 * g, 4 * g + 4)
            kept = ~dropped[rows]
            if kept.sum() >= 2:
                assert float(out["advantages"][rows][kept].mean()) == pytest.approx(0.0, abs=1e-5)


def _all_on():
    entropy = EntropyConfig(baseline_steps=2, window=2, floor_ratio=1.0, ki=0.01)
    return QuatroConfig(
        kl=KLConfig(enabled=True, target=1e-3),
        entropy=entropy,
        filters=_only_repetition(),
        replay=ReplayConfig(capacity=2),
    )


def _same_tree(a, b) -> bool:
    """Nested dicts / lists of tensors and plain values, compared with torch.equal."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def test_resume_is_exact_with_quatro_kl_entropy_filters_and_replay_on(tiny_model_dir, tmp_path):
    """6 straight steps == 3 + resume + 3 (torch.equal weights, identical logged rows), controllers restored, the
    replay buffer (rows and generator) round-trips through the rank file and replays across the resume."""
    common = dict(max_steps=6, save_steps=3, save_strategy="steps", beta=0.04, max_completion_length=8)
    straight, _ = _trainer(tiny_model_dir, tmp_path / "straight", _all_on(), **common)
    straight.train()
    history = straight.state.log_history
    assert sum(per_step(history, "quatro/filtered/repetition")) > 0, "the filter must really drop rows here"
    assert max(per_step(history, "quatro/floor_active")) == 1.0, "the floor must really activate here"
    # 0.3 x 8 = 2.4 -> 2 replayed rows of 8 from step 2 on (the buffer holds >= 2 signal rows by then)
    assert per_step(history, "quatro/replay_frac") == [0.0] + [0.25] * 5
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    saved = torch.load(checkpoint / "steadyrl_state.pt", weights_only=False)["guards"]["quatro"]
    assert saved["kl"]["updates"] == 3 and saved["entropy"]["steps"] == 3 and saved["filter"]["calls"] == 3
    buffer = torch.load(checkpoint / "steadyrl_rank0.pt", weights_only=False)["guards"]["quatro"]["replay"]
    assert [e["step"] for e in buffer["entries"]] == [1, 2] and buffer["added_rows"] > 0  # capacity 2, steps 0..2

    resumed_quatro = _all_on()
    resumed, _ = _trainer(tiny_model_dir, tmp_path / "resumed", resumed_quatro, **common)
    load_steady_state(resumed, checkpoint)  # what train(resume_from_checkpoint=...) does, checked on its own
    replay = resumed.rollout.replay
    assert _same_tree(replay.state_dict(), buffer) and len(replay) > 0
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert_same_weights(weights(resumed.model), weights(straight.model))
    keys = [k for k in history[-2] if k.startswith(("quatro/", "loss", "reward", "kl", "entropy", "grad_norm"))]
    assert {"quatro/kl_coef", "quatro/entropy_bonus", "quatro/replay_frac", "quatro/replay_ratio_mean"} <= set(keys)
    rows = lambda h: [{k: h_row.get(k) for k in keys} for h_row in h if h_row.get("step", 0) > 3 and "loss" in h_row]  # noqa: E731
    got, want = rows(resumed.state.log_history), rows(history)
    assert len(got) == 3 and all(
        all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])) for k in keys)
        for a, b in zip(got, want, strict=True)
    ), (got, want)
    assert resumed.beta == straight.beta and resumed.entropy_coef == straight.entropy_coef


def _cov_batch(rows: int = 8, length: int = 6) -> dict:
    """A hand-made loss micro-batch: random prompts and completions, ragged completion masks, advantages of both
    signs (TRL's loss needs nothing else at beta 0 and one iteration)."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, 200, (rows, n), generator=g)  # noqa: E731
    completion_mask = torch.ones(rows, length, dtype=torch.long)
    for r in range(rows):
        completion_mask[r, 2 + r % (length - 2) :] = 0
    return {
        "prompt_ids": ids(5),
        "prompt_mask": torch.ones(rows, 5, dtype=torch.long),
        "completion_ids": ids(length),
        "completion_mask": completion_mask,
        "advantages": torch.linspace(-1.5, 1.5, rows),
        "num_items_in_batch": completion_mask.sum(),
    }


def _loss_seam(model_dir, out, entropy: EntropyConfig, mode: str):
    """A trainer with only QUATRO's entropy floor (acting or observing), in training mode, a hand-made micro-batch,
    and TRL's own loss on that batch (computed without steadyrl's hooks)."""
    from trl import GRPOTrainer

    trainer, _ = _trainer(model_dir, out, QuatroConfig(entropy=entropy), observe=mode == "observe")
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which this test does not run
    inputs = _cov_batch()
    with torch.no_grad():
        plain = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs))  # steadyrl's hooks see no loss
    return trainer, inputs, plain


def _floor_loss(trainer, inputs: dict, control: float) -> float:
    """steadyrl's loss on ``inputs`` with the floor's control set; the batch (replayed, or reused by num_iterations)
    keeps its own advantages afterwards."""
    original = inputs["advantages"]
    trainer.step_end.entropy.control = control
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
    assert inputs["advantages"] is original
    return float(loss)


@pytest.mark.parametrize("mode", ["act", "observe"])
def test_the_loss_trains_on_the_braked_advantages(tiny_model_dir, tmp_path, mode):
    """The seam of the entropy floor's policy-gradient brake: at control 0.75 with pg_brake 1 the loss is TRL's own
    loss on the same batch with every advantage x 0.25, the micro-batch keeps its own advantages afterwards, and
    ``quatro/pg_scale`` is 0.25. Observe mode: TRL's loss unchanged, ``quatro/would_pg_scale`` 0.25. Control 0: TRL's
    loss, factor 1."""
    from trl import GRPOTrainer

    trainer, inputs, plain = _loss_seam(tiny_model_dir, tmp_path / mode, EntropyConfig(pg_brake=1.0), mode)
    original = inputs["advantages"]
    with torch.no_grad():
        by_hand = GRPOTrainer._compute_loss(trainer, trainer.model, dict(inputs, advantages=original * 0.25))
    assert not torch.allclose(by_hand, plain)  # the brake changes this loss: the equalities below can fail

    expected = plain if mode == "observe" else by_hand
    assert _floor_loss(trainer, inputs, 0.75) == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    name = "quatro/would_pg_scale" if mode == "observe" else "quatro/pg_scale"
    assert trainer._metrics["train"][name][-1] == 0.25

    trainer.step_end.entropy.control = 0.0
    with torch.no_grad():
        assert float(trainer._compute_loss(trainer.model, inputs)) == pytest.approx(float(plain), rel=1e-6)
    assert trainer._metrics["train"][name][-1] == 1.0


class MomentSpy(TrainerCallback):
    """Adam's moments right after each optimizer step and again after steadyrl's step-end work (it runs first)."""

    def __init__(self):
        self.after_step, self.after_guards = [], []

    @staticmethod
    def _moments(optimizer):
        from steadyrl.trainers.recovery import optimizer_chain

        base = optimizer_chain(optimizer)[-1]
        return [(s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in base.state.values()]

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.after_step.append(self._moments(optimizer))

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.after_guards.append(self._moments(optimizer))


@pytest.mark.parametrize("mode", ["act", "observe"])
def test_the_optimizer_steps_on_the_moments_the_brake_scaled(tiny_model_dir, tmp_path, mode):
    """The seam of ``brake_moments``: whatever factor the floor returns after a step (here 0.5, 1, 2.5, fixed so the
    test does not wait for a collapse; the floor's own factors are checked by hand in tests/unit/test_quatro.py),
    every exp_avg the next update starts from is that factor x the one the step left, every exp_avg_sq its square
    x. Observe mode: the moments are the step's, untouched."""
    quatro = QuatroConfig(entropy=EntropyConfig(pg_brake=1.0, brake_moments=0.1))
    trainer, _ = _trainer(tiny_model_dir, tmp_path / mode, quatro, observe=mode == "observe", max_steps=3)
    factors = iter([0.5, 1.0, 2.5])
    trainer.step_end.entropy.moment_rescale = lambda: next(factors)
    spy = MomentSpy()
    trainer.add_callback(spy)
    trainer.train()
    assert len(spy.after_step) == len(spy.after_guards) == 3
    for factor, stepped, guarded in zip((0.5, 1.0, 2.5), spy.after_step, spy.after_guards, strict=True):
        expected = 1.0 if mode == "observe" else factor
        assert stepped and len(stepped) == len(guarded)
        for (m, v), (m2, v2) in zip(stepped, guarded, strict=True):
            assert torch.equal(m2, m * expected) and torch.equal(v2, v * (expected * expected))
        assert any(bool(m.abs().sum() > 0) for m, _ in stepped)  # real moments: the equalities can fail
