"""PPO math (reward placement, KL, GAE, whitening, value loss) against hand-computed numbers; the critic model."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from steadyrl.ppo.gae import (
    clipped_value_loss,
    gae,
    get_kl_estimator,
    kl_k1,
    kl_k3,
    last_token_index,
    masked_mean_var,
    place_rewards,
    soft_clip,
    whiten,
)

F64 = torch.float64


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


# ------------------------------------------------------------------------------------------- KL estimators


def test_kl_estimators_by_hand():
    logp = t([[-1.0, -2.0, -0.5]])
    ref = t([[-1.0, -1.0, -1.5]])
    # k1 = logp - ref = [0, -1, 1]
    assert kl_k1(logp, ref).tolist() == [[0.0, -1.0, 1.0]]
    # k3 = exp(ref - logp) - (ref - logp) - 1 with ref - logp = [0, 1, -1]
    expected = [0.0, math.e - 1 - 1, math.exp(-1) + 1 - 1]
    assert kl_k3(logp, ref)[0].tolist() == pytest.approx(expected, abs=1e-12)
    assert (kl_k3(logp, ref) >= 0).all()
    assert get_kl_estimator("k3") is kl_k3


def test_unknown_kl_estimator_names_valid_ones():
    with pytest.raises(ValueError, match=r"'k2'.*\['k1', 'k3'\]"):
        get_kl_estimator("k2")


# --------------------------------------------------------------------------------------- reward placement


def test_place_rewards_with_padding_and_kl():
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    kl = t([[0.1, 0.2, 0.3, 5.0], [-0.1, 0.4, 7.0, float("nan")]])  # padding holds garbage, even NaN
    rewards = place_rewards(t([[1.0, 2.0]])[0], mask, kl, beta=0.5)
    # row 0: -0.5*kl on 3 real tokens, +1.0 on the 3rd; row 1: -0.5*kl on 2 real tokens, +2.0 on the 2nd
    expected = [[-0.05, -0.1, -0.15 + 1.0, 0.0], [0.05, -0.2 + 2.0, 0.0, 0.0]]
    assert rewards.tolist() == [pytest.approx(r, abs=1e-12) for r in expected]


def test_place_rewards_without_kl_and_empty_row():
    mask = t([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    rewards = place_rewards(torch.tensor([3.0, 4.0, -1.0]), mask)
    assert rewards.tolist() == [[0.0, 3.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0]]
    assert last_token_index(mask).tolist() == [1, -1, 2]


def test_place_rewards_goes_to_last_real_token_with_holes():
    mask = t([[1, 0, 1, 0]])  # e.g. a masked tool-output token in the middle
    assert place_rewards(torch.tensor([1.0]), mask).tolist() == [[0.0, 0.0, 1.0, 0.0]]


# ----------------------------------------------------------------------------------------------------- GAE


def test_gae_two_rows_of_different_lengths_by_hand():
    rewards = t([[0.0, 0.0, 1.0, 0.0], [-0.1, 2.0, 0.0, 0.0]])
    values = t([[0.5, 0.6, 0.7, 9.0], [1.0, 0.5, 9.0, 9.0]])  # 9.0 = garbage on padding
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 0 (3 tokens):  t=2: delta = 1 + 0 - 0.7 = 0.3                     A2 = 0.3
    #                    t=1: delta = 0 + 0.7 - 0.6 = 0.1   A1 = 0.1 + 0.95 * 0.3   = 0.385
    #                    t=0: delta = 0 + 0.6 - 0.5 = 0.1   A0 = 0.1 + 0.95 * 0.385 = 0.46575
    # row 1 (2 tokens):  t=1: delta = 2 + 0 - 0.5 = 1.5                     A1 = 1.5
    #                    t=0: delta = -0.1 + 0.5 - 1.0 = -0.6  A0 = -0.6 + 0.95 * 1.5 = 0.825
    assert adv[0].tolist() == pytest.approx([0.46575, 0.385, 0.3, 0.0], abs=1e-12)
    assert adv[1].tolist() == pytest.approx([0.825, 1.5, 0.0, 0.0], abs=1e-12)
    # returns = advantages + values on real tokens, 0 on padding
    assert ret[0].tolist() == pytest.approx([0.96575, 0.985, 1.0, 0.0], abs=1e-12)
    assert ret[1].tolist() == pytest.approx([1.825, 2.0, 0.0, 0.0], abs=1e-12)


def test_gae_lam1_gamma1_returns_are_reward_to_go():
    rewards = t([[0.5, -0.25, 0.0, 2.0]])
    values = t([[3.0, -1.0, 0.7, 0.2]])
    adv, ret = gae(rewards, values, torch.ones(1, 4), gamma=1.0, lam=1.0)
    # reward-to-go: [0.5 - 0.25 + 0 + 2, -0.25 + 2, 2, 2] = [2.25, 1.75, 2.0, 2.0], whatever the values are
    assert ret[0].tolist() == pytest.approx([2.25, 1.75, 2.0, 2.0], abs=1e-12)
    assert adv[0].tolist() == pytest.approx([2.25 - 3.0, 1.75 + 1.0, 2.0 - 0.7, 2.0 - 0.2], abs=1e-12)


def test_gae_lam0_is_one_step_td():
    rewards = t([[1.0, 0.0, 2.0]])
    values = t([[0.5, 1.0, 4.0]])
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.0)
    # A_t = r_t + 0.9 * V_{t+1} - V_t, V after the end = 0
    expected = [1.0 + 0.9 * 1.0 - 0.5, 0.0 + 0.9 * 4.0 - 1.0, 2.0 + 0.0 - 4.0]
    assert adv[0].tolist() == pytest.approx(expected, abs=1e-12)  # [1.4, 2.6, -2.0]
    assert ret[0].tolist() == pytest.approx([1.9, 3.6, 2.0], abs=1e-12)


def test_gae_gamma_discounts_by_hand():
    rewards = t([[0.0, 1.0]])
    values = t([[0.0, 0.0]])
    adv, _ = gae(rewards, values, torch.ones(1, 2), gamma=0.5, lam=0.5)
    # t=1: delta = 1 -> A1 = 1;  t=0: delta = 0 + 0.5*0 - 0 = 0 -> A0 = 0 + 0.25 * 1 = 0.25
    assert adv[0].tolist() == pytest.approx([0.25, 1.0])


def test_gae_keeps_float32_and_rejects_bad_shapes():
    adv, ret = gae(torch.ones(2, 3, dtype=torch.bfloat16), torch.zeros(2, 3), torch.ones(2, 3))
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    with pytest.raises(ValueError, match="share one"):
        gae(torch.ones(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


@settings(max_examples=60, deadline=None)
@given(
    real=st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=1, max_size=8),
    holes=st.lists(st.integers(0, 8), max_size=6),
    garbage=st.floats(-1e6, 1e6),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_padding_never_changes_real_advantages(real, holes, garbage, gamma, lam):
    """Inserting masked positions (right padding or holes) with garbage rewards/values changes nothing real."""
    r = torch.tensor([x[0] for x in real], dtype=F64)
    v = torch.tensor([x[1] for x in real], dtype=F64)
    compact_adv, compact_ret = gae(r[None], v[None], torch.ones(1, len(real)), gamma, lam)
    rewards, values, mask = list(r.tolist()), list(v.tolist()), [1.0] * len(real)
    for pos in sorted(holes, reverse=True):  # insert masked slots anywhere, including at the end
        pos = min(pos, len(mask))
        rewards.insert(pos, garbage)
        values.insert(pos, -garbage)
        mask.insert(pos, 0.0)
    m = torch.tensor([mask], dtype=F64)
    adv, ret = gae(torch.tensor([rewards], dtype=F64), torch.tensor([values], dtype=F64), m, gamma, lam)
    real_pos = m[0].bool()
    assert torch.allclose(adv[0, real_pos], compact_adv[0], atol=1e-9)
    assert torch.allclose(ret[0, real_pos], compact_ret[0], atol=1e-9)
    assert (adv[0, ~real_pos] == 0).all() and (ret[0, ~real_pos] == 0).all()


# ------------------------------------------------------------------------------------------------ whitening


def test_whiten_by_hand_unbiased_and_padding_zero():
    x = t([[1.0, 2.0, 100.0], [3.0, -50.0, -50.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # real values [1, 2, 3]: mean 2, unbiased var = (1 + 0 + 1) / 2 = 1
    mean, var = masked_mean_var(x, mask)
    assert (mean.item(), var.item()) == (2.0, 1.0)
    w = whiten(x, mask, eps=0.0)
    assert w.tolist() == [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_whiten_single_token_is_zero_and_stats_override():
    assert whiten(t([[5.0, 1.0]]), t([[1, 0]])).tolist() == [[0.0, 0.0]]
    stats = (torch.tensor(1.0, dtype=F64), torch.tensor(4.0, dtype=F64))  # e.g. all-reduced across ranks
    assert whiten(t([[5.0, 3.0]]), t([[1, 1]]), stats=stats, eps=0.0).tolist() == [[2.0, 1.0]]


def test_soft_clip_bounds_and_keeps_zero():
    x = torch.tensor([0.0, 1.0, -100.0])
    y = soft_clip(x, 3.0)
    assert y[0].item() == 0.0
    assert y[1].item() == pytest.approx(3 * math.tanh(1 / 3))
    assert y[2].item() == pytest.approx(-3.0) and y.abs().max() <= 3.0
    with pytest.raises(ValueError, match="clip_scale"):
        soft_clip(x, 0.0)


# ----------------------------------------------------------------------------------------------- value loss


def test_clipped_value_loss_branch_selection_by_hand():
    values = t([[1.0, 0.5, 2.0, 50.0]]).requires_grad_()
    old = t([[0.5, 0.5, 1.0, 0.0]])
    returns = t([[2.0, 0.0, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0]])  # the 4th token is padding and must not count
    loss, clipfrac = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # tok0: V moved +0.5 -> clipped 0.7; (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> max 1.69 (clipped branch)
    # tok1: V = V_old -> both 0.25 -> 0.25 (not counted as clipped)
    # tok2: V moved +1.0 -> clipped 1.2; (2-0)^2 = 4, (1.2-0)^2 = 1.44 -> max 4 (unclipped branch)
    # loss = 0.5 * (1.69 + 0.25 + 4) / 3 = 0.99; clipfrac = 1/3
    assert loss.item() == pytest.approx(0.99, abs=1e-12)
    assert clipfrac.item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dV: tok0 uses the clipped branch (no gradient through the clamp), tok1: 0.5*2*(0.5-0)/3, tok2: 0.5*2*2/3
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5 / 3, 2.0 / 3, 0.0], abs=1e-12)


# -------------------------------------------------------------------------------------------------- critic


def test_critic_from_policy_zero_head_and_round_trip(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from steadyrl.ppo.value import CriticModel

    critic = CriticModel.from_pretrained(tiny_model_dir)
    assert critic.init_source == "policy"
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    values = critic(ids, mask)
    assert values.shape == (2, 4) and torch.equal(values, torch.zeros(2, 4))  # zero-init head
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(critic.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)

    with torch.no_grad():
        critic.value_head.summary.weight.normal_()
        critic.value_head.summary.bias.fill_(0.25)
    before = critic(ids, mask)
    critic.save_pretrained(tmp_path / "critic")
    loaded = CriticModel.from_pretrained(tmp_path / "critic")
    assert loaded.init_source == "policy"
    assert torch.equal(loaded(ids, mask), before)
    assert not torch.equal(before, torch.zeros(2, 4))


def test_critic_from_reward_model_takes_score_head_and_stats(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from steadyrl.ppo.value import CriticModel

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.config.pad_token_id = 0
    rm.save_pretrained(tmp_path / "rm")
    ids = torch.tensor([[5, 6, 7, 8]])
    scores = rm(input_ids=ids).logits[0, 0]  # score at the last token
    critic = CriticModel.from_pretrained(tmp_path / "rm", reward_stats={"mean": 0.5, "std": 2.0})
    assert critic.init_source == "reward_model+score_head"
    values = critic(ids, torch.ones_like(ids))
    assert values[0, -1].item() == pytest.approx((scores.item() - 0.5) / 2.0, abs=1e-5)


def test_lora_critic_trains_adapter_and_head_and_round_trips(tiny_model_dir, tmp_path):
    from peft import LoraConfig

    from steadyrl.ppo.value import CriticModel

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    critic = CriticModel.from_pretrained(tiny_model_dir, peft_config=cfg)
    torch.nn.init.normal_(critic.value_head.summary.weight, std=0.02)  # a head that is not 0, so values differ
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("value_head.") for n in trainable)
    assert {"value_head.summary.weight", "value_head.summary.bias"} <= trainable
    ids = torch.tensor([[5, 6, 7]])
    before = critic(ids, torch.ones_like(ids))
    critic.save_pretrained(tmp_path / "lora_critic")
    loaded = CriticModel.from_pretrained(tmp_path / "lora_critic")
    assert torch.allclose(loaded(ids, torch.ones_like(ids)), before, atol=1e-6)
