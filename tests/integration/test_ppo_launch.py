"""PPO under real 2-process CPU launches (DDP, DeepSpeed ZeRO-2): identical policy and critic weights on both ranks."""

from __future__ import annotations

import pytest
import torch

from tests.integration.helpers import assert_same_weights
from tests.integration.rank_dump import assert_brake_moments_scaled
from tests.integration.test_launch import launch

pytestmark = pytest.mark.slow

# one completion per prompt (the critic is the baseline), one PPO epoch, KL in the reward, no periodic eval
PPO_LAUNCH = (
    "trainer.num_generations=1",
    "trainer.num_iterations=1",
    "trainer.beta=0.04",
    "ppo.critic_lr=3.0e-3",
    "eval.every=0",
)


@pytest.mark.parametrize("accelerate_config", ["multi_cpu.yaml", "zero2.yaml"], ids=["ddp", "zero2"])
def test_ppo_two_processes_agree_on_policy_and_critic(tiny_model_dir, tmp_path, accelerate_config):
    out = tmp_path / "ppo"
    dumps, proc = launch(
        accelerate_config,
        tiny_model_dir,
        out,
        *PPO_LAUNCH,
        config="ppo.yaml",
    )
    assert [d["world_size"] for d in dumps] == [2, 2] and [d["global_step"] for d in dumps] == [2, 2]
    rank0, rank1 = dumps[0]["weights"], dumps[1]["weights"]
    assert any(k.startswith("critic.") for k in rank0) and any(k.startswith("policy.") for k in rank0)
    assert_same_weights(rank0, rank1)
    assert torch.count_nonzero(rank0["critic.value_head.summary.weight"]) > 0  # the zero-initialised head trained
    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "steadyrl_complete.json").is_file() and (checkpoint / "critic.safetensors").is_file()
    # final/ holds the bare policy (loadable as a causal LM) and the critic, both equal to the trained weights
    from transformers import AutoModelForCausalLM

    from steadyrl.ppo.value import CriticModel

    policy = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    assert_same_weights(policy, {k.removeprefix("policy."): v for k, v in rank0.items() if k.startswith("policy.")})
    critic = CriticModel.from_pretrained(out / "final" / "critic").state_dict()
    assert_same_weights(critic, {k.removeprefix("critic."): v for k, v in rank0.items() if k.startswith("critic.")})
    assert "eval byte_mean after PPO" in proc.stdout


def test_lora_ppo_under_zero2_trains_adapters_and_critic_only(tiny_model_dir, tmp_path):
    """LoRA on the policy under 2-process ZeRO-2: both ranks agree, the policy's base weights stay frozen, the
    adapters (LoRA B starts at zero) and the critic's zero-initialised value head train."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    dumps, _ = launch(
        "zero2.yaml",
        tiny_model_dir,
        tmp_path / "lora",
        *PPO_LAUNCH,
        "peft.r=4",
        "peft.lora_alpha=8",
        "peft.lora_dropout=0.0",
        config="ppo.yaml",
    )
    rank0, rank1 = dumps[0]["weights"], dumps[1]["weights"]
    assert_same_weights(rank0, rank1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    # the frozen base under each LoRA layer, mapped back to the plain model's names: the policy's and the critic's
    frozen = {}
    for key, value in rank0.items():
        if ".base_layer." in key:
            name = key.replace(".base_layer", "")
            name = name.removeprefix("policy.base_model.model.").replace("critic.backbone.base_model.model.", "model.")
            frozen[key] = (name, value)
    assert any(k.startswith("policy.") for k in frozen) and any(k.startswith("critic.") for k in frozen)
    moved = [k for k, (name, value) in frozen.items() if not torch.equal(base[name], value)]
    assert not moved, f"LoRA base weights must not move: {moved[:3]}"
    lora_b = [v for k, v in rank0.items() if "lora_B" in k]
    assert lora_b and any(torch.count_nonzero(v) > 0 for v in lora_b)
    assert torch.count_nonzero(rank0["critic.value_head.summary.weight"]) > 0


def test_brake_moments_under_zero2_scale_the_policys_partition_and_leave_the_critics(tiny_model_dir, tmp_path):
    """PPO under DeepSpeed ZeRO-2 with the entropy floor's ``brake_moments`` (its factor forced to 0.5 then 2.0 by
    ForcedBrakeMoments): on each rank, the policy's partition of Adam's moments is scaled by the factor (its square
    for exp_avg_sq) and the critic's is left as the step made it. This rests on DeepSpeed keeping the
    ``steadyrl_unbraked`` key on the param groups it builds from flat partitions; the ranks still agree."""
    out = tmp_path / "ppo"
    dumps, _ = launch(
        "zero2.yaml",
        tiny_model_dir,
        out,
        *PPO_LAUNCH,
        "guards.quatro.enabled=true",
        "guards.quatro.kl.enabled=false",
        "guards.quatro.filters.zero_variance.enabled=false",
        "guards.quatro.entropy.pg_brake=1.0",
        "guards.quatro.entropy.brake_moments=0.01",
        "callbacks=[tests.integration.rank_dump:RankDump, tests.integration.rank_dump:ForcedBrakeMoments]",
        config="ppo.yaml",
    )
    assert [d["zero_stage"] for d in dumps] == [2, 2]
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])
    for rank in (0, 1):
        spy = torch.load(out / "brake_spy" / f"rank{rank}.pt", weights_only=False)
        assert_brake_moments_scaled(spy["after_step"], spy["after_guards"])
