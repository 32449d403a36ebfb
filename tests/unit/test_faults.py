"""Fault injectors: reproducible, and each hits exactly what it says (hand-made inputs, exact outputs)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers.modeling_outputs import BaseModelOutputWithPast

from steadyrl.faults import (
    FAULT_RANK_ENV,
    FAULT_SCALE_ENV,
    FAULT_STEP_ENV,
    FAULT_VALUE_ENV,
    GradSpikeAtStep,
    InfExpAvgSqAtStep,
    NanLossAtStep,
    _times_nan,
    artefact_offsets,
    exact_match_cauchy,
    exact_match_nonfinite_burst,
    read_fault_log,
    repetition_reward,
    reward_model_artefacts,
)


def test_cauchy_reward_is_reproducible_per_seed_and_step():
    comps, answers = ["5", "6"] * 500, ["5"] * 1000
    step3 = SimpleNamespace(global_step=3)
    a = exact_match_cauchy(comps, answers, scale=1.0, seed=7, trainer_state=step3)
    assert a == exact_match_cauchy(comps, answers, scale=1.0, seed=7, trainer_state=step3)
    assert a != exact_match_cauchy(comps, answers, scale=1.0, seed=7, trainer_state=SimpleNamespace(global_step=4))
    assert a != exact_match_cauchy(comps, answers, scale=1.0, seed=8, trainer_state=step3)
    noise = sorted(abs(r - (c == "5")) for r, c in zip(a, comps, strict=True))
    assert noise[len(noise) // 2] < 2.0 < noise[-1] and noise[-1] > 50  # median |noise| ~1, but extreme tails


def test_zero_scale_is_exact_match():
    assert exact_match_cauchy(["5", "6"], ["5", "5"], scale=0.0) == [1.0, 0.0]


def test_artefacts_hit_their_rate_with_magnitudes_in_range_and_repeat_per_seed_and_step():
    offsets = artefact_offsets(20000, rate=0.05, low=5.0, high=20.0, seed=3, step=8)
    hit = offsets[offsets != 0]
    assert 0.045 < len(hit) / len(offsets) < 0.055
    assert (abs(hit) >= 5.0).all() and (abs(hit) <= 20.0).all()
    assert 0.45 < (hit > 0).mean() < 0.55  # both signs
    assert (artefact_offsets(20000, 0.05, 5.0, 20.0, seed=3, step=8) == offsets).all()
    assert not (artefact_offsets(20000, 0.05, 5.0, 20.0, seed=3, step=9) == offsets).all()
    assert not (artefact_offsets(20000, 0.0, 5.0, 20.0, seed=3, step=8)).any()


def test_reward_model_artefacts_adds_the_offsets_and_logs_training_calls_only(tmp_path, monkeypatch):
    import json

    import steadyrl.trainers.reward_model as rm

    monkeypatch.setattr(rm, "reward_model_score", lambda prompts, completions, path: [1.0, None, -2.0, 0.5])
    log = tmp_path / "rewards.jsonl"
    state = SimpleNamespace(global_step=4)
    args = (["p"] * 4, ["c"] * 4)
    out = reward_model_artefacts(*args, path="rm", rate=0.5, seed=1, log=str(log), trainer_state=state)
    offsets = artefact_offsets(4, 0.5, 5.0, 20.0, seed=1, step=4)
    assert out[1] is None  # unscorable stays unscorable
    assert [out[i] for i in (0, 2, 3)] == [1.0 + offsets[0], -2.0 + offsets[2], 0.5 + offsets[3]]
    reward_model_artefacts(*args, path="rm", rate=0.5, seed=1, log=str(log))  # an eval call: not logged
    (line,) = log.read_text().splitlines()
    assert json.loads(line) == {"step": 4, "prompts": ["p"] * 4, "rewards": out, "artefacts": offsets.tolist()}
    assert reward_model_artefacts(*args, path="rm") == [1.0, None, -2.0, 0.5]  # rate 0: the reward model alone


def test_reward_model_reward_names_both_counts_on_a_length_mismatch():
    from steadyrl.trainers.reward_model import RewardModelReward

    reward = object.__new__(RewardModelReward)  # the check comes before any model is touched
    with pytest.raises(ValueError, match="3 prompts but 2 completions"):
        reward(["p"] * 3, ["c"] * 2)


# ------------------------------------------------------------------------------------- reward-side faults


def test_nonfinite_burst_hits_only_its_window_with_none_nan_and_infs_in_turn():
    comps, answers = ["5", "6", "5", "5"], ["5"] * 4
    clean = [1.0, 0.0, 1.0, 1.0]
    # rollouts of optimizer step k are scored while global_step == k - 1; the window is steps 3 and 4
    at = [SimpleNamespace(global_step=s) for s in range(6)]
    kwargs = dict(fraction=1.0, start=3, steps=2, seed=0)
    outputs = [exact_match_nonfinite_burst(comps, answers, trainer_state=s, **kwargs) for s in at]
    for step in (0, 1, 4, 5):
        assert outputs[step] == clean
    for step in (2, 3):
        none, nan, pos, neg = outputs[step]
        assert none is None and math.isnan(nan) and pos == math.inf and neg == -math.inf


def test_nonfinite_burst_hits_a_fraction_of_rows_reproducibly():
    comps, answers = ["5", "6"] * 4, ["5"] * 8
    step = SimpleNamespace(global_step=0)  # optimizer step 1
    a = exact_match_nonfinite_burst(comps, answers, fraction=0.5, start=1, seed=3, trainer_state=step)
    b = exact_match_nonfinite_burst(comps, answers, fraction=0.5, start=1, seed=3, trainer_state=step)
    bad = [i for i, r in enumerate(a) if r is None or not math.isfinite(r)]
    assert len(bad) == 4 and repr(a) == repr(b)  # repr: nan != nan
    assert all(a[i] == float(comps[i] == "5") for i in range(8) if i not in bad)
    assert [repr(a[i]) for i in bad] == ["None", "nan", "inf", "-inf"]
    assert exact_match_nonfinite_burst(comps, answers, fraction=0.0, start=1, trainer_state=step) == [1.0, 0.0] * 4


def test_repetition_reward_pays_for_one_repeated_character():
    comps = ["aaab", "77", "1212", "ab", "7", "", "000000"]
    assert repetition_reward(comps) == [0.75, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0]
    assert repetition_reward([[{"role": "assistant", "content": "xxxy"}]]) == [0.75]  # conversational


# ------------------------------------------------------------------------------------ trainer-side faults


class TinyLM(torch.nn.Module):
    """Backbone (embedding) -> lm_head, with the one method the NaN-loss hook needs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(5, 3)
        self.lm_head = torch.nn.Linear(3, 5)

    def get_decoder(self) -> torch.nn.Module:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(ids))


def _args(tmp_path):
    return SimpleNamespace(output_dir=str(tmp_path))


def test_nan_loss_hits_only_the_first_training_forward_with_grad_of_its_step(tmp_path):
    model, ids = TinyLM(), torch.tensor([[1, 2, 3]])
    fault = NanLossAtStep(step=2, rank=None)
    fault.on_step_begin(_args(tmp_path), SimpleNamespace(global_step=0), None, model=model)  # step 1: nothing
    assert torch.isfinite(model(ids)).all() and not fault.fired
    fault.on_step_end(_args(tmp_path), SimpleNamespace(global_step=1), None)
    fault.on_step_begin(_args(tmp_path), SimpleNamespace(global_step=1), None, model=model)  # step 2 begins
    with torch.no_grad():
        assert torch.isfinite(model(ids)).all()  # generation / old log-probs pass through
    model.eval()
    assert torch.isfinite(model(ids)).all()  # eval mode passes through
    model.train()
    logits = model(ids)
    assert torch.isnan(logits).all() and fault.fired  # the loss pass
    logits.pow(2).sum().backward()
    assert all(torch.isnan(p.grad).all() for p in model.lm_head.parameters())
    assert torch.isfinite(model(ids)).all()  # the hook removed itself: the next micro-batch is clean
    assert not model.embed._forward_hooks
    assert read_fault_log(tmp_path) == [{"fault": "nan_loss", "step": 2, "rank": 0}]
    fault.on_step_begin(_args(tmp_path), SimpleNamespace(global_step=1), None, model=model)  # fires once only
    assert torch.isfinite(model(ids)).all()


def test_nan_poisons_the_hidden_states_of_every_backbone_output_type():
    hidden, past = torch.ones(1, 2, 3), torch.zeros(1)
    out = _times_nan(BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=None))
    assert torch.isnan(out.last_hidden_state).all() and torch.isnan(out[0]).all()
    first, second = _times_nan((hidden, past))
    assert torch.isnan(first).all() and torch.equal(second, past)
    assert torch.isnan(_times_nan(hidden)).all() and torch.equal(hidden, torch.ones(1, 2, 3))  # not in place


def test_trainer_faults_read_step_rank_value_and_scale_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(FAULT_STEP_ENV, "7")
    monkeypatch.setenv(FAULT_RANK_ENV, "1")
    monkeypatch.setenv(FAULT_VALUE_ENV, "nan")
    monkeypatch.setenv(FAULT_SCALE_ENV, "250")
    nan_loss, corrupt, spike = NanLossAtStep(), InfExpAvgSqAtStep(), GradSpikeAtStep()
    assert (nan_loss.step, nan_loss.rank) == (7, 1)
    assert (corrupt.step, corrupt.rank, corrupt.key) == (7, 1, "exp_avg_sq") and math.isnan(corrupt.value)
    assert (spike.step, spike.rank, spike.scale) == (7, 1, 250.0)
    monkeypatch.setenv("RANK", "0")  # not the faulty rank: nothing happens
    model = TinyLM()
    nan_loss.on_step_begin(_args(tmp_path), SimpleNamespace(global_step=6), None, model=model)
    assert torch.isfinite(model(torch.tensor([[1]]))).all() and not nan_loss.fired
    for name in (FAULT_STEP_ENV, FAULT_RANK_ENV, FAULT_VALUE_ENV, FAULT_SCALE_ENV):
        monkeypatch.delenv(name)
    corrupt, spike = InfExpAvgSqAtStep(), GradSpikeAtStep()
    assert (corrupt.step, corrupt.rank, corrupt.value, spike.scale) == (3, None, math.inf, 1e4)


def test_inf_exp_avg_sq_writes_one_entry_at_its_step_and_reports_the_end_state(tmp_path):
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2]])).sum().backward()
    optimizer.step()
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    fault = InfExpAvgSqAtStep(step=2, rank=None)
    fault.on_step_end(_args(tmp_path), SimpleNamespace(global_step=1), None, optimizer=optimizer)
    assert not fault.fired
    fault.on_step_end(_args(tmp_path), SimpleNamespace(global_step=2), None, optimizer=optimizer)
    first = next(iter(optimizer.state.values()))
    assert first["exp_avg_sq"].view(-1)[0] == math.inf
    changed = [(id(p), k, int((v != before[id(p)][k]).sum())) for p, s in optimizer.state.items() for k, v in s.items()]
    assert [c for c in changed if c[2]] == [(id(next(iter(optimizer.state))), "exp_avg_sq", 1)]
    fault.on_train_end(_args(tmp_path), SimpleNamespace(global_step=4), None, optimizer=optimizer)
    assert read_fault_log(tmp_path) == [
        {"fault": "inf_exp_avg_sq", "step": 2, "rank": 0, "value": "inf"},
        {"fault": "train_end", "step": 4, "rank": 0, "nonfinite_state_entries": 1},
    ]


def _gradient_probe() -> tuple[torch.nn.Module, Any]:
    """A TinyLM with a frozen embedding and ``grads()``: one backward pass, the trainable gradients it left."""
    model, ids = TinyLM(), torch.tensor([[1, 2, 3]])
    model.embed.weight.requires_grad_(False)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(ids).pow(2).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    return model, grads


def test_grad_spike_scales_every_trainable_gradient_during_its_step_only(tmp_path):
    model, grads = _gradient_probe()
    reference = grads()
    fault = GradSpikeAtStep(step=3, scale=1e4, rank=None)
    fault.on_step_begin(_args(tmp_path), SimpleNamespace(global_step=2), None, model=model)
    spiked = grads()
    assert spiked.keys() == reference.keys() == {"lm_head.weight", "lm_head.bias"}
    assert all(torch.equal(spiked[n], reference[n] * 1e4) for n in reference)
    fault.on_step_end(_args(tmp_path), SimpleNamespace(global_step=3), None)
    assert all(torch.equal(g, reference[n]) for n, g in grads().items())  # hooks gone
    assert read_fault_log(tmp_path) == [{"fault": "grad_spike", "step": 3, "rank": 0, "scale": 1e4}]


def test_micro_batch_spike_scales_only_the_first_micro_batch_of_its_step(tmp_path):
    from steadyrl.faults import MicroBatchSpikeAtStep

    model, grads = _gradient_probe()
    reference = grads()
    fault = MicroBatchSpikeAtStep(step=3, scale=1e3, rank=None)
    fault.on_step_begin(_args(tmp_path), SimpleNamespace(global_step=2), None, model=model)
    first, second = grads(), grads()  # two micro-batches of step 3: only the first is poisoned
    assert all(torch.equal(first[n], reference[n] * 1e3) for n in reference)
    assert all(torch.equal(second[n], reference[n]) for n in reference)
    fault.on_step_end(_args(tmp_path), SimpleNamespace(global_step=3), None)
    assert read_fault_log(tmp_path) == [{"fault": "micro_batch_spike", "step": 3, "rank": 0, "scale": 1e3}]


def test_the_word_problems_burst_scores_with_math_verify_outside_its_window():
    from steadyrl.faults import math_answer_nonfinite_burst

    comps, answers = ["The answer is 12", "I think 7", "12", "so 40"], ["12", "12", "12", "40"]
    before = math_answer_nonfinite_burst(comps, answers, start=3, steps=1, trainer_state=SimpleNamespace(global_step=0))
    assert before == [1.0, 0.0, 1.0, 1.0]
    during = math_answer_nonfinite_burst(comps, answers, fraction=0.5, start=3, steps=1, seed=1,
                                         trainer_state=SimpleNamespace(global_step=2))  # fmt: skip
    assert sorted(repr(v) for v in during if v is None or not math.isfinite(v)) == ["None", "nan"]
