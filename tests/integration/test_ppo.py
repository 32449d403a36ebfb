"""SteadyPPOTrainer on the tiny model: metrics, the critic trains in its own param group, KL stays out of the loss,
exact resume of policy + critic + their optimizer state, num_generations=1, QUATRO's adaptive KL on the reward's
beta, QUATRO's rollout replay (GAE tensors kept, exact resume)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer
from trl import GRPOConfig

import steadyrl.trainers.ppo as ppo_module
from steadyrl.config.schema import PPOSection
from steadyrl.trainers.checkpoints import COMPLETE_MARKER
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.ppo import CRITIC_FILE, SteadyPPOTrainer
from steadyrl.trainers.ppo_config import SteadyPPOConfig
from tests.integration.helpers import (
    RecordingGrade,
    assert_same_weights,
    byte_mean,
    grpo_args,
    per_step,
    small_dataset,
    weights,
)
from tests.integration.rank_dump import FORCED_MOMENT_FACTORS, GroupMomentSpy, assert_brake_moments_scaled

pytestmark = pytest.mark.slow

PPO_METRICS = ("ppo/value_loss", "ppo/explained_variance", "ppo/returns_mean", "ppo/clipfrac_value", "ppo/kl")


def _trainer(
    model_dir: Path, out: Path, ppo: PPOSection | None = None, guards: dict | None = None, **args
) -> SteadyPPOTrainer:
    """``guards``: ``GuardParts`` fields, and other trainer keyword arguments (``peft_config``)."""
    args = {"num_generations": 1, "beta": 0.04, **args}
    fields = {f.name for f in dataclasses.fields(GuardParts)}
    parts = {k: v for k, v in (guards or {}).items() if k in fields}
    extra = {k: v for k, v in (guards or {}).items() if k not in fields}
    return SteadyPPOTrainer(
        model=str(model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(out, SteadyPPOConfig, **args),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        ppo=ppo or PPOSection(critic_lr=3e-3),
        guards=GuardParts(**parts),
        **extra,
    )


def test_num_generations_1_is_ppo_only(tmp_path):
    assert SteadyPPOConfig(output_dir=str(tmp_path), num_generations=1, use_cpu=True, bf16=False).num_generations == 1
    with pytest.raises(ValueError, match="at least 2 generations"):
        GRPOConfig(output_dir=str(tmp_path), num_generations=1, use_cpu=True, bf16=False)


def test_ppo_run_trains_policy_and_critic(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path / "run", max_steps=4)
    wrapper = trainer.policy_and_value
    initial = weights(wrapper)
    assert torch.count_nonzero(wrapper.critic.value_head.summary.weight) == 0  # zero-initialised head
    trainer.train()
    final = weights(wrapper)

    history = trainer.state.log_history
    for key in PPO_METRICS:
        values = per_step(history, key)
        assert len(values) == 4 and all(math.isfinite(v) for v in values), (key, values)
    assert per_step(history, "kl") == []  # TRL's loss-side KL term is off: PPO's KL is in the reward
    # the policy's and the critic's gradient norms split TRL's total (pre-clip) norm exactly: p^2 + c^2 = total^2
    policy_norm, critic_norm = per_step(history, "ppo/policy_grad_norm"), per_step(history, "ppo/critic_grad_norm")
    total_norm = per_step(history, "grad_norm")
    assert len(policy_norm) == len(critic_norm) == len(total_norm) == 4
    for p, c, t in zip(policy_norm, critic_norm, total_norm, strict=True):
        assert p > 0 and c > 0 and math.isclose(math.hypot(p, c), t, rel_tol=1e-4), (p, c, t)
    assert per_step(history, "ppo/kl")[0] == 0.0  # the first rollout's policy is the reference
    # values start at exactly 0, so the first explained variance is exactly 0 and the critic then learns
    assert per_step(history, "ppo/explained_variance")[0] == 0.0
    assert all(torch.isfinite(v).all() for v in final.values())
    critic_changed = [k for k in final if k.startswith("critic.") and not torch.equal(initial[k], final[k])]
    policy_changed = [k for k in final if k.startswith("policy.") and not torch.equal(initial[k], final[k])]
    assert "critic.value_head.summary.weight" in critic_changed and len(critic_changed) > 5
    assert policy_changed

    # one optimizer: the critic's params are their own groups, at critic_lr x the same schedule factor
    critic_ids = {id(p) for p in wrapper.critic.parameters()}
    groups = trainer.optimizer.param_groups
    critic_groups = [g for g in groups if all(id(p) in critic_ids for p in g["params"])]
    policy_groups = [g for g in groups if not any(id(p) in critic_ids for p in g["params"])]
    assert len(critic_groups) + len(policy_groups) == len(groups) and critic_groups and policy_groups
    assert sum(len(g["params"]) for g in critic_groups) == len(list(wrapper.critic.parameters()))
    assert {g["initial_lr"] for g in critic_groups} == {3e-3}
    assert {g["initial_lr"] for g in policy_groups} == {1e-3}


def test_ppo_resume_is_exact_with_critic_and_its_optimizer(tiny_model_dir, tmp_path):
    common = dict(max_steps=4, save_steps=2, save_strategy="steps", num_iterations=2)
    straight = _trainer(tiny_model_dir, tmp_path / "straight", **common)
    straight.train()
    checkpoint = tmp_path / "straight" / "checkpoint-2"
    assert (checkpoint / COMPLETE_MARKER).is_file() and (checkpoint / CRITIC_FILE).is_file()
    assert (checkpoint / "model.safetensors").is_file()  # the policy, in its own format

    resumed = _trainer(tiny_model_dir, tmp_path / "resumed", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert resumed.state.global_step == straight.state.global_step == 4
    assert_same_weights(weights(resumed.policy_and_value), weights(straight.policy_and_value))
    a, b = resumed.optimizer.state_dict(), straight.optimizer.state_dict()
    assert a["state"].keys() == b["state"].keys() and len(a["param_groups"]) == 4
    for index, state in a["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name], b["state"][index][name]), (index, name)
        assert int(state["step"]) == 4
    after = [r for r in straight.state.log_history if r.get("step", 0) > 2 and "loss" in r]
    resumed_rows = [r for r in resumed.state.log_history if r.get("step", 0) > 2 and "loss" in r]
    for key in ("ppo/value_loss", "ppo/returns_mean", "ppo/explained_variance", "loss"):
        assert per_step(resumed_rows, key) == per_step(after, key) != [], key


def _quatro_kl(**kl) -> dict:
    """QUATRO's adaptive KL alone; the tiny target makes every positive rollout KL push beta up."""
    from steadyrl.guards.kl_controller import KLConfig
    from steadyrl.guards.quatro import QuatroConfig

    kl = {"target": 1e-9, "up": 1.5, "down": 0.5, "beta_range": [0.25, 4.0], **kl}  # two-sided: rollout 1 lowers beta
    return {"quatro": QuatroConfig(kl=KLConfig(enabled=True, **kl))}


def _spy_on_placed_beta(monkeypatch) -> list[float]:
    """The beta every ``place_rewards`` call of the PPO trainer gets (one per training generation batch)."""
    import steadyrl.trainers.ppo as ppo_module

    placed: list[float] = []
    real = ppo_module.place_rewards

    def spy(sequence_rewards, completion_mask, per_token_kl=None, beta=0.0):
        placed.append(float(beta))
        return real(sequence_rewards, completion_mask, per_token_kl, beta)

    monkeypatch.setattr(ppo_module, "place_rewards", spy)
    return placed


def test_quatro_adaptive_kl_drives_the_reward_kl_coefficient(tiny_model_dir, tmp_path, monkeypatch):
    """PPO feeds QUATRO's controller the rollout KL (TRL's loss logs none); the coefficient it sets is the one the
    next rollout's ``-beta * kl_t`` uses. k3 (>= 0): rollout 1 has KL exactly 0 (policy = reference) < target, so
    beta goes down; every later rollout has KL > 1e-9, so it goes up."""
    placed = _spy_on_placed_beta(monkeypatch)
    ppo = PPOSection(critic_lr=3e-3, kl_estimator="k3")
    trainer = _trainer(tiny_model_dir, tmp_path / "kl", ppo=ppo, guards=_quatro_kl(), max_steps=4, beta=0.04)
    trainer.train()
    history = trainer.state.log_history
    kls, coefs = per_step(history, "ppo/kl"), per_step(history, "quatro/kl_coef")
    assert len(kls) == len(coefs) == 4 and per_step(history, "kl") == []
    assert per_step(history, "quatro/kl_mean") == kls  # the controller observed each rollout's measured KL
    assert kls[0] == 0.0 and all(k > 1e-9 for k in kls[1:])
    assert coefs == pytest.approx([0.02, 0.03, 0.045, 0.0675])  # x0.5, then x1.5 per rollout
    # the placed coefficient: beta0 for rollout 1, then the controller's latest (beta_base x factor), never 0/stale
    assert placed == per_step(history, "ppo/beta") == pytest.approx([0.04, *coefs[:-1]])
    assert placed[1:] == pytest.approx([0.04 * f for f in per_step(history, "quatro/kl_factor")[:-1]])
    assert trainer.beta == pytest.approx(coefs[-1]) and trainer.step_end.kl.updates == 4


def test_ppo_resume_is_exact_with_quatro_adaptive_kl(tiny_model_dir, tmp_path, monkeypatch):
    """num_iterations=2: one rollout per 2 optimizer steps, so the controller observes at steps 1 and 3 only (a
    rollout's KL counts once); resuming from step 2 restores its beta and reproduces weights, KL and coefficients."""
    placed = _spy_on_placed_beta(monkeypatch)
    common = dict(max_steps=4, save_steps=2, save_strategy="steps", num_iterations=2, beta=0.04)
    ppo = PPOSection(critic_lr=3e-3, kl_estimator="k3")
    straight = _trainer(tiny_model_dir, tmp_path / "straight", ppo=ppo, guards=_quatro_kl(), **common)
    straight.train()
    history = straight.state.log_history
    coefs = per_step(history, "quatro/kl_coef")
    assert coefs == pytest.approx([0.02, 0.02, 0.03, 0.03]) and straight.step_end.kl.updates == 2
    assert placed == pytest.approx([0.04, 0.02])  # one placement per rollout, with the coefficient of its time

    placed.clear()
    resumed = _trainer(tiny_model_dir, tmp_path / "resumed", ppo=ppo, guards=_quatro_kl(), **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert placed == pytest.approx([0.02])  # the restored controller's beta, not trainer.beta's initial 0.04
    assert resumed.state.global_step == 4 and resumed.beta == straight.beta
    assert resumed.guard_state.stateful["quatro"].state_dict() == straight.guard_state.stateful["quatro"].state_dict()
    assert_same_weights(weights(resumed.policy_and_value), weights(straight.policy_and_value))
    after = [r for r in history if r.get("step", 0) > 2 and "loss" in r]
    resumed_rows = [r for r in resumed.state.log_history if r.get("step", 0) > 2 and "loss" in r]
    for key in ("quatro/kl_coef", "quatro/kl_mean", "ppo/kl", "ppo/beta", "ppo/returns_mean", "loss"):
        assert per_step(resumed_rows, key) == per_step(after, key) != [], key


def test_vf_coef_zero_leaves_the_critic_untouched(tiny_model_dir, tmp_path):
    """vf_coef=0: the critic gets zero gradient (Adam leaves it in place); the value loss is still measured."""
    trainer = _trainer(tiny_model_dir, tmp_path / "novf", ppo=PPOSection(vf_coef=0.0), max_steps=2)
    initial = weights(trainer.policy_and_value.critic)
    trainer.train()
    assert_same_weights(weights(trainer.policy_and_value.critic), initial)
    assert all(v > 0 for v in per_step(trainer.state.log_history, "ppo/value_loss"))


def test_grade_feeds_gae_and_the_spike_guard_watches_the_joint_step(tiny_model_dir, tmp_path, monkeypatch):
    """GRADE scales the sequence reward before GAE (docs/DESIGN.md, "GRADE: reward scaler"): the sequence rewards
    GAE's reward placement receives are GRADE's output, row by row; the step guard sees one norm over policy +
    critic and skips nothing on a healthy run."""
    from steadyrl.guards.reward_scaler import GradeConfig
    from steadyrl.guards.spike import SpikeConfig, SpikeGuard

    placed = []
    real = ppo_module.place_rewards

    def spy(sequence_rewards, completion_mask, per_token_kl=None, beta=0.0):
        placed.append(sequence_rewards.detach().clone())
        return real(sequence_rewards, completion_mask, per_token_kl, beta)

    monkeypatch.setattr(ppo_module, "place_rewards", spy)
    grade = RecordingGrade(GradeConfig(warmup=2, clip_start=2))
    guards = dict(
        reward_processor=grade,
        step_guards=[SpikeGuard(SpikeConfig())],
        finite_checks=True,
    )
    trainer = _trainer(tiny_model_dir, tmp_path / "guarded", guards=guards, max_steps=3, beta=0.0)
    trainer.train()
    history = trainer.state.log_history
    scaled, raw = per_step(history, "grade/scaled_mean"), per_step(history, "reward")
    assert len(scaled) == 3 and scaled != raw  # GRADE changed the rewards PPO trained on
    assert len(placed) == len(grade.outputs) == 3
    for got, scaled_rows in zip(placed, grade.outputs, strict=True):
        assert torch.equal(got.float(), torch.nan_to_num(scaled_rows, nan=0.0).float())
    # from the second batch on GRADE whitens: the raw sequence rewards are not what GAE got
    for got, raw_rows in zip(placed[1:], grade.inputs[1:], strict=True):
        assert not torch.allclose(got, raw_rows.float())
    assert all(math.isfinite(v) for v in per_step(history, "ppo/returns_mean"))
    assert per_step(history, "gepo/skipped_steps")[-1] == 0.0
    assert all(math.isfinite(v) for v in per_step(history, "grad_norm"))


def test_lora_ppo_trains_only_adapters_and_value_head_and_resumes_exactly(tiny_model_dir, tmp_path):
    """LoRA policy: the reference is the policy with its adapter disabled (through the wrapper); the critic gets its
    own adapter on its own frozen base copy; base weights never move; resume restores both adapters and the head."""
    from peft import LoraConfig

    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")

    common = dict(max_steps=3, save_steps=2, save_strategy="steps")
    straight = _trainer(tiny_model_dir, tmp_path / "a", guards={"peft_config": lora()}, **common)
    wrapper = straight.policy_and_value
    initial = weights(wrapper)
    straight.train()
    final = weights(wrapper)
    changed = {k for k in final if not torch.equal(initial[k], final[k])}
    assert changed and all("lora_" in k or k.startswith("critic.value_head.") for k in changed)
    assert any(k.startswith("critic.") and "lora_" in k for k in changed)
    assert any(k.startswith("policy.") and "lora_" in k for k in changed)
    kls = per_step(straight.state.log_history, "ppo/kl")
    assert kls[0] == 0.0 and kls[-1] != 0.0  # the disabled-adapter reference differs once the adapter trained

    resumed = _trainer(tiny_model_dir, tmp_path / "b", guards={"peft_config": lora()}, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert_same_weights(weights(resumed.policy_and_value), final)


def test_cli_ppo_with_every_guard_layer_that_applies(tiny_model_dir, tmp_path):
    """`steadyrl train configs/tiny/ppo.yaml` with GEPO (spike skip, finite checks), OPEFO, GRADE and QUATRO's
    entropy floor, adaptive KL and rollout filters on: the run finishes, saves policy + critic, and logs each layer's
    metrics."""
    import json

    from tests.integration.test_cli import steadyrl

    out = tmp_path / "cli"
    proc = steadyrl(
        "train",
        "configs/tiny/ppo.yaml",
        f"model.path={tiny_model_dir}",
        f"trainer.output_dir={out}",
        "trainer.max_steps=4",
        "trainer.save_steps=4",
        "trainer.per_device_train_batch_size=8",
        "trainer.max_completion_length=4",
        "trainer.logging_steps=1",
        "rewards=[{fn: 'tests.integration.helpers:byte_mean'}]",
        "eval.every=0",
        "eval.max_samples=8",
        "guards.gepo.enabled=true",
        "guards.gepo.advantage.enabled=false",
        "guards.opefo.enabled=true",
        "guards.grade.enabled=true",
        "guards.quatro.enabled=true",
        "guards.quatro.kl.enabled=true",
        "guards.quatro.kl.target=1e-9",
        "guards.quatro.filters.zero_variance.enabled=false",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval byte_mean after PPO" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*rows)
    for key in (
        "ppo/value_loss",
        "ppo/explained_variance",
        "grade/scaled_mean",
        "gepo/skipped_steps",
        "quatro/kl_coef",
    ):
        assert key in keys, key
    assert any(k.startswith("quatro/") for k in keys) and any(k.startswith("opefo/") for k in keys)
    assert (out / "checkpoint-4" / "critic.safetensors").is_file()
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "critic" / "config.json").is_file()


def _quatro_replay(replay_ratio: float = 0.3125) -> dict:
    """QUATRO's rollout replay alone (0.3125 x 8 = 2.5 -> 3 replayed rows per micro-batch once warm)."""
    from steadyrl.guards.quatro import QuatroConfig
    from steadyrl.guards.replay import ReplayConfig

    return {"quatro": QuatroConfig(replay=ReplayConfig(replay_ratio=replay_ratio))}


def test_ppo_replay_keeps_gae_tensors_and_replays_the_configured_share(tiny_model_dir, tmp_path):
    """One generation = 2 micro-batches = 1 optimizer step; from the second generation on every micro-batch holds 3
    replayed rows, each with the token advantages, returns, old values and log-probs of the rollout it came from
    (right-padded, zero past its completion), and the run stays finite."""
    from steadyrl.trainers.rollout import REPLAY_STEP_KEY

    trainer = _trainer(
        tiny_model_dir, tmp_path / "replay", guards=_quatro_replay(), max_steps=4, gradient_accumulation_steps=2
    )
    generations: dict[int, dict[str, torch.Tensor]] = {}
    original_generate = trainer._generate_and_score_completions

    def generate(inputs):
        out = original_generate(inputs)
        generations[trainer.state.global_step] = {k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)}
        return out

    trainer._generate_and_score_completions = generate
    losses: list[tuple[int, dict]] = []
    original_record = trainer.loss_station.record_replay

    def record(inputs, logps):
        losses.append((trainer.state.global_step, inputs))
        return original_record(inputs, logps)

    trainer.loss_station.record_replay = record
    trainer.train()

    per_token = ("advantages", "returns", "old_values", "old_per_token_logps", "ref_per_token_logps")
    assert len(losses) == 8 and sorted(generations) == [0, 1, 2, 3]
    for step, inputs in losses:
        sampled = inputs[REPLAY_STEP_KEY]
        replayed = (sampled >= 0).nonzero().flatten().tolist()
        assert len(replayed) == (0 if step == 0 else 3), (step, sampled)
        width = inputs["completion_ids"].shape[1]
        for key in per_token:
            assert inputs[key].shape == (8, width), key
            assert torch.isfinite(inputs[key]).all(), key
        for i in replayed:
            origin = generations[int(sampled[i])]
            assert int(sampled[i]) < step
            n = int(inputs["completion_mask"][i].sum())
            assert n > 0 and bool(inputs["completion_mask"][i, :n].all())
            match = [
                j
                for j in range(origin["completion_ids"].shape[0])
                if int(origin["completion_mask"][j].sum()) == n
                and torch.equal(origin["completion_ids"][j, :n], inputs["completion_ids"][i, :n])
                and torch.equal(origin["advantages"][j, :n], inputs["advantages"][i, :n])
            ]
            assert match, (step, i)
            j = match[0]
            for key in per_token:
                assert torch.equal(inputs[key][i, :n], origin[key][j, :n]), key
                assert not inputs[key][i, n:].any(), key  # right padding (or the rollout's own zeros)
    history = trainer.state.log_history
    assert per_step(history, "quatro/replay_frac") == [0.0] + [3 / 8] * 3
    assert len(per_step(history, "quatro/replay_age_mean")) == 3
    for key in PPO_METRICS:
        assert all(math.isfinite(v) for v in per_step(history, key)), key
    assert all(torch.isfinite(v).all() for v in weights(trainer.policy_and_value).values())


def test_ppo_resume_is_exact_with_replay_on(tiny_model_dir, tmp_path):
    """The replay buffer (rows with their GAE tensors, generator) is saved per rank and restored: resuming from step 2
    reproduces weights, replay metrics and PPO's losses."""
    common = dict(max_steps=4, save_steps=2, save_strategy="steps", gradient_accumulation_steps=2)
    straight = _trainer(tiny_model_dir, tmp_path / "straight", guards=_quatro_replay(), **common)
    straight.train()
    resumed = _trainer(tiny_model_dir, tmp_path / "resumed", guards=_quatro_replay(), **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert resumed.state.global_step == straight.state.global_step == 4
    assert_same_weights(weights(resumed.policy_and_value), weights(straight.policy_and_value))
    assert resumed.rollout.replay.added_rows > 0 and resumed.rollout.replay.replayed_rows > 0
    after = [r for r in straight.state.log_history if r.get("step", 0) > 2 and "loss" in r]
    resumed_rows = [r for r in resumed.state.log_history if r.get("step", 0) > 2 and "loss" in r]
    for key in ("quatro/replay_frac", "quatro/replay_age_mean", "ppo/value_loss", "ppo/returns_mean", "loss"):
        assert per_step(resumed_rows, key) == per_step(after, key) != [], key


def test_brake_moments_scale_the_policys_moments_and_leave_the_critics(tiny_model_dir, tmp_path):
    """PPO with ``brake_moments``: the factor the floor returns after a step (here 0.5, then 2.0, fixed so the test
    does not wait for a collapse) scales the policy's exp_avg (its square: exp_avg_sq); the critic's param groups,
    whose value loss the brake does not scale, keep the moments the step left, exactly."""
    from steadyrl.guards.entropy_floor import EntropyConfig
    from steadyrl.guards.quatro import QuatroConfig

    quatro = QuatroConfig(entropy=EntropyConfig(pg_brake=1.0, brake_moments=0.1))
    trainer = _trainer(tiny_model_dir, tmp_path / "run", guards={"quatro": quatro}, max_steps=2)
    factors = iter(FORCED_MOMENT_FACTORS)
    trainer.step_end.entropy.moment_rescale = lambda: next(factors)
    spy = GroupMomentSpy()
    trainer.add_callback(spy)
    trainer.train()
    assert_brake_moments_scaled(spy.after_step, spy.after_guards)  # decay / no-decay groups of policy and critic


def test_unscorable_and_filtered_rows_train_nothing(tiny_model_dir, tmp_path, monkeypatch):
    """A row whose reward is None and a row QUATRO's filters drop get advantage 0 on every token, stay out of the
    whitening (the trained rows' advantages have mean 0 and std 1 by themselves) and get no value-loss weight."""
    from steadyrl.guards.quatro import QuatroConfig
    from steadyrl.guards.rollout_filters import FilterConfig
    from steadyrl.trainers.rollout import RolloutStation

    def reward(completions, **kw):  # row 1 of every batch is unscorable
        return [None if i == 1 else v for i, v in enumerate(byte_mean(completions))]

    quatro = QuatroConfig(filters=FilterConfig())

    def keep_all_but_row_2(self, output, rewards, lengths, num_generations):
        keep = torch.ones(rewards.shape[0], dtype=torch.bool)
        keep[2] = False
        return keep

    monkeypatch.setattr(RolloutStation, "filter_generation", keep_all_but_row_2)
    trainer = SteadyPPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=[reward],
        args=grpo_args(tmp_path / "run", SteadyPPOConfig, num_generations=1, beta=0.04, max_steps=2),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        ppo=PPOSection(critic_lr=3e-3),
        guards=GuardParts(quatro=quatro),
    )
    rollouts, value_masks = [], []
    add_gae = trainer._add_gae

    def spy_gae(output):
        add_gae(output)
        rollouts.append(
            {k: output[k].clone() for k in ("advantages", "completion_mask", "value_weight") if k in output}
        )

    real_loss = ppo_module.clipped_value_loss

    def spy_loss(values, old_values, returns, mask, cliprange_value=0.2):
        value_masks.append(mask.clone())
        return real_loss(values, old_values, returns, mask, cliprange_value)

    monkeypatch.setattr(trainer, "_add_gae", spy_gae)
    monkeypatch.setattr(ppo_module, "clipped_value_loss", spy_loss)
    trainer.train()
    assert len(rollouts) == 2 and len(value_masks) == 2
    for rollout in rollouts:
        adv, mask = rollout["advantages"], rollout["completion_mask"].bool()
        assert torch.all(adv[1] == 0) and torch.all(adv[2] == 0)
        weight = rollout["value_weight"]
        assert weight.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        trained = mask & weight.bool()[:, None]
        values = adv[trained].double()
        assert abs(values.mean().item()) < 1e-5 and values.std().item() == pytest.approx(1.0, abs=1e-4)
    for value_mask in value_masks:  # TRL shuffles rows: two of eight rows carry no value-loss weight
        assert (value_mask.sum(dim=1) == 0).sum().item() == 2
