"""PeriodicEval without a Trainer: schedule, numbers, RNG and mode preservation, logging, refusals."""

from __future__ import annotations

import logging
import math
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from steadyrl.callbacks.periodic_eval import PeriodicEval, contiguous_shard, preserved_rng, sample_mean_se
from steadyrl.evaluation import eval_scores, evaluate_rewards
from steadyrl.tasks.arithmetic import arithmetic_dataset, exact_match


def half_none(completions: list[Any], **_: Any) -> list[float | None]:
    """0.25 on even rows, unscorable (None) on odd ones: the mean counts only the scored rows -> 0.25."""
    return [0.25 if i % 2 == 0 else None for i in range(len(completions))]


def ones(completions: list[Any], **_: Any) -> list[float]:
    return [1.0] * len(completions)


def first_char_code(completions: list[Any], **_: Any) -> list[float]:
    """A reward that varies for a random model: the first character's code point (0 for empty)."""
    return [float(ord(c[0])) if c else 0.0 for c in completions]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def eval_ds():
    return arithmetic_dataset("eval", max_operand=9, eval_size=12)


def state(step: int, main: bool = True) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, is_world_process_zero=main, log_history=[])


def make(eval_ds, tokenizer, **kwargs: Any) -> PeriodicEval:
    defaults: dict[str, Any] = dict(every=2, max_new_tokens=3, batch_size=4)
    defaults.update(kwargs)
    rewards = defaults.pop("rewards", {"exact_match": exact_match, "half": half_none, "ones": ones})
    return PeriodicEval(eval_ds, rewards, tokenizer, **defaults)


def test_constructor_rejects_bad_settings(eval_ds, tiny):
    _, tok = tiny
    with pytest.raises(ValueError, match="every=0"):
        make(eval_ds, tok, every=0)
    with pytest.raises(ValueError, match=r"metric 'acc' is not one of the rewards \['exact_match', 'half', 'ones'\]"):
        make(eval_ds, tok, metric="acc")
    with pytest.raises(TypeError, match=r"\['rm'\] are not callable"):
        make(eval_ds, tok, rewards={"rm": "path/to/reward-model"})
    with pytest.raises(ValueError, match="reward_weights names"):
        make(eval_ds, tok, reward_weights={"exact_match": 1.0})
    with pytest.raises(ValueError, match="'prompt' column"):
        make(eval_ds.rename_column("prompt", "question"), tok)
    assert make(eval_ds, tok).metric == "exact_match"  # default: the first reward


def test_runs_after_every_nth_step_and_at_train_end(eval_ds, tiny):
    _, tok = tiny
    for eval_on_start, expected in ((False, [2, 4]), (True, [0, 2, 4])):
        cb = make(eval_ds, tok, eval_on_start=eval_on_start)
        cb.evaluate = lambda model, trainer_state=None: ({"eval/x": 1.0}, [])  # type: ignore[method-assign]
        st = state(0)
        for step in range(4):  # a 4-step run: on_step_begin sees global_step 0..3, on_train_end 4
            st.global_step = step
            cb.on_step_begin(None, st, None, model=None)
        st.global_step = 4
        cb.on_train_end(None, st, None, model=None)
        assert [row["step"] for row in st.log_history] == expected


def test_same_step_is_evaluated_once(eval_ds, tiny):
    model, tok = tiny
    cb = make(eval_ds, tok)
    st = state(2)
    cb.on_step_begin(None, st, None, model=model)
    cb.on_train_end(None, st, None, model=model)  # e.g. training stopped right after step 2
    assert len(st.log_history) == 1


def test_numbers_match_evaluate_rewards_and_hand_values(eval_ds, tiny):
    model, tok = tiny
    rewards = {"exact_match": exact_match, "code": first_char_code, "half": half_none, "ones": ones}
    cb = make(eval_ds, tok, rewards=rewards, max_samples=10)
    metrics, samples = cb.evaluate(model)
    reference = evaluate_rewards(model, tok, eval_ds, rewards, max_new_tokens=3, batch_size=4, max_samples=10)
    assert metrics["eval/num_samples"] == 10
    for name in rewards:
        assert metrics[f"eval/reward/{name}"] == pytest.approx(reference["rewards"][name], rel=1e-12)
    assert metrics["eval/reward/half"] == 0.25 and metrics["eval/reward/ones"] == 1.0
    assert metrics["eval/mean_length"] == pytest.approx(reference["mean_length"], rel=1e-12)
    assert 0 < metrics["eval/mean_length"] <= 3
    assert metrics["eval/reward"] == metrics["eval/accuracy"] == metrics["eval/reward/exact_match"]
    assert 0.0 <= metrics["eval/accuracy"] <= 1.0
    assert [p for p, _, _ in samples] == list(eval_ds["prompt"][:3])

    weighted = make(
        eval_ds,
        tok,
        rewards=rewards,
        max_samples=10,
        metric="half",
        reward_weights={"exact_match": 0.0, "code": 0.0, "half": 2.0, "ones": -1.0},
    )
    m, _ = weighted.evaluate(model)
    assert m["eval/reward"] == pytest.approx(2 * 0.25 - 1.0) and m["eval/accuracy"] == 0.25
    assert m["eval/accuracy_se"] == 0.0  # every scored row 0.25: no spread
    # the standard error of the metric by hand: the per-row codes' sample std / sqrt(n)
    codes = make(eval_ds, tok, rewards={"code": first_char_code}, max_samples=10)
    m, _ = codes.evaluate(model)
    scores = torch.tensor(
        first_char_code(
            eval_scores(model, tok, eval_ds.select(range(10)), {"c": first_char_code}, max_new_tokens=3, batch_size=4)[
                "completions"
            ]
        )
    )
    assert m["eval/accuracy"] == pytest.approx(scores.mean().item())
    assert m["eval/accuracy_se"] == pytest.approx((scores.std() / 10**0.5).item(), rel=1e-9)


def test_sample_mean_se_by_hand():
    assert sample_mean_se(3.0, 3.0, 4.0) == pytest.approx(((3 - 9 / 4) / 3 / 4) ** 0.5)  # 0/1 scores 1, 1, 1, 0
    assert math.isnan(sample_mean_se(1.0, 1.0, 1.0))


def test_sampled_mode_draws_per_step_repeats_a_step_and_leaves_greedy_alone(eval_ds, tiny):
    model, tok = tiny
    rewards = {"code": first_char_code}
    greedy = make(eval_ds, tok, rewards=rewards, max_new_tokens=4)
    sampled = make(
        eval_ds, tok, rewards=rewards, max_new_tokens=4, sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0}, seed=3
    )
    texts = {}
    for name, cb in (("greedy", greedy), ("sampled", sampled)):
        for step in (2, 4, 2):
            st = state(step)
            cb._last_step = None
            texts.setdefault(name, []).append(cb.evaluate(model, trainer_state=st)[1])
    g, s = texts["greedy"], texts["sampled"]
    assert g[0] == g[1] == g[2]  # greedy: the same completions at every step
    assert s[0] == s[2] and s[0] != s[1]  # sampled: a resume re-draws its step's eval, another step another one
    assert s[0] != g[0]


def test_rng_and_train_mode_are_restored(eval_ds, tiny):
    model, tok = tiny

    def rng_hungry(completions: list[Any], **_: Any) -> list[float]:
        torch.rand(100)
        random.random()
        return [0.0] * len(completions)

    cb = make(eval_ds, tok, rewards={"hungry": rng_hungry})
    model.train()
    torch.manual_seed(7)
    random.seed(7)
    cb.run(model, state(2))
    after = (torch.rand(3), random.random())
    torch.manual_seed(7)
    random.seed(7)
    assert torch.equal(after[0], torch.rand(3)) and after[1] == random.random()
    assert model.training


def test_preserved_rng_restores_after_an_error():
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    with pytest.raises(RuntimeError), preserved_rng():
        torch.rand(50)
        raise RuntimeError
    assert torch.equal(torch.rand(2), expected)


def test_log_fn_gets_the_row_else_log_history(eval_ds, tiny, caplog):
    model, tok = tiny
    rows: list[dict[str, float]] = []
    st = state(4)
    with caplog.at_level(logging.INFO, logger="steadyrl.eval"):
        make(eval_ds, tok, log_fn=rows.append, num_samples_to_log=2).run(model, st)
    assert len(rows) == 1 and st.log_history == []
    assert set(rows[0]) == {
        "eval/reward",
        "eval/accuracy",
        "eval/accuracy_se",
        "eval/reward/exact_match",
        "eval/reward/half",
        "eval/reward/ones",
        "eval/mean_length",
        "eval/num_samples",
    }
    assert sum("eval sample at step 4" in r.getMessage() for r in caplog.records) == 2

    caplog.clear()
    st = state(6, main=False)
    with caplog.at_level(logging.INFO, logger="steadyrl.eval"):
        make(eval_ds, tok).run(model, st)
    assert st.log_history == [{**rows[0], "step": 6}]  # same model and data: the same numbers
    assert not caplog.records  # only the main process writes the summary and samples


def test_rewards_get_trl_kwargs(eval_ds, tiny):
    model, tok = tiny
    seen: dict[str, Any] = {}

    def logging_reward(completions, answer, trainer_state, log_metric, log_extra, **_):
        seen.update(trainer_state=trainer_state, answers=len(answer))
        log_metric("x", 1.0)  # no-ops during eval: nothing may reach the training metric buffers
        return [0.0] * len(completions)

    st = state(2)
    make(eval_ds, tok, rewards={"r": logging_reward}).run(model, st)
    assert seen == {"trainer_state": st, "answers": 12}


def test_sharded_parameters_are_refused(eval_ds, tiny):
    model, tok = tiny
    param = next(model.parameters())
    param.ds_id = 0  # what DeepSpeed ZeRO-3 puts on its partitioned parameters
    try:
        with pytest.raises(NotImplementedError, match="ZeRO-3"):
            make(eval_ds, tok).on_train_begin(None, state(0), None, model=model)
        with pytest.raises(NotImplementedError, match="ZeRO-3"):
            make(eval_ds, tok).evaluate(model)
    finally:
        del param.ds_id


def test_empty_dataset_calls_nothing():
    def boom(**_: Any) -> list[float]:
        raise AssertionError("must not be called")

    out = eval_scores(None, None, Dataset.from_dict({"prompt": []}), {"r": boom}, max_new_tokens=1, batch_size=1)
    assert out == {"prompts": [], "completions": [], "completion_ids": [], "scores": {"r": []}}


def test_contiguous_shard_matches_datasets_and_allows_empty_shards():
    ds = Dataset.from_dict({"i": list(range(10))})
    for world in (1, 2, 3, 4):
        for rank in range(world):
            start, stop = contiguous_shard(10, rank, world)
            assert list(range(start, stop)) == ds.shard(world, rank, contiguous=True)["i"]
    assert [contiguous_shard(1, r, 3) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]
