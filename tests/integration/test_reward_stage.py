"""Reward-model stage: arithmetic preference pairs, calibration numbers, and a short RewardTrainer run end to end."""

from __future__ import annotations

import json
import logging
import math

import pytest

from steadyrl.tasks.arithmetic import arithmetic_splits
from steadyrl.tasks.preferences import REJECTION_KINDS, arithmetic_preferences, wrong_answer
from steadyrl.trainers.reward_model import (
    ACCURACY_WARNING,
    RewardModelReward,
    encode_pair,
    load_reward_stats,
    pairwise_summary,
    run_reward_stage,
)

# ------------------------------------------------------------------------------------------ preference data


def test_preferences_columns_and_correctness():
    ds = arithmetic_preferences("train", n=400, seed=3)
    assert ds.column_names == ["prompt", "chosen", "rejected", "answer", "kind"]
    assert len(ds) == 400
    for row in ds:
        a, b = row["prompt"].removesuffix("=").split("+")
        assert row["chosen"] == row["answer"] == str(int(a) + int(b))  # canonical answer
        assert row["rejected"] != row["chosen"]
        if row["kind"] == "zero_pad":
            assert row["rejected"] == row["chosen"].zfill(3) and int(row["rejected"]) == int(row["chosen"])
        else:
            assert int(row["rejected"]) != int(row["chosen"])
            assert row["rejected"] == str(int(row["rejected"]))  # canonical format ("0" for 1 - 1)
    assert set(ds["kind"]) == set(REJECTION_KINDS)


def test_preferences_are_deterministic_and_eval_prompts_held_out():
    assert (
        arithmetic_preferences("eval", n=50, seed=1).to_list() == arithmetic_preferences("eval", n=50, seed=1).to_list()
    )
    _, evaluation = arithmetic_splits()
    eval_prompts = {r["prompt"] for r in evaluation}
    assert set(arithmetic_preferences("eval", n=200, seed=0)["prompt"]) == eval_prompts  # one pass, no repeats
    assert not set(arithmetic_preferences("train", n=3000, seed=0)["prompt"]) & eval_prompts
    # one builtin dict for both splits (as steadyrl.data passes it): eval_n sizes the eval split only
    assert len(arithmetic_preferences("eval", n=9000, eval_n=20)) == 20
    assert len(arithmetic_preferences("train", n=30, eval_n=20)) == 30
    with pytest.raises(ValueError, match="valid"):
        arithmetic_preferences("train", n=5, kinds=["off_by_two"])


def test_wrong_answer_kinds_by_hand():
    import random

    rng = random.Random(0)
    assert wrong_answer("95", "zero_pad", 3, rng) == ("095", "zero_pad")
    assert wrong_answer("7", "zero_pad", 3, rng) == ("007", "zero_pad")
    assert wrong_answer("95", "digit_swap", 3, rng) == ("59", "digit_swap")
    assert wrong_answer("0", "off_by_one", 3, rng) == ("1", "off_by_one")  # never negative
    assert wrong_answer("5", "off_by_ten", 3, rng) == ("15", "off_by_ten")
    # kinds that cannot apply fall back to off-by-one: 3-digit zero-pad, swaps of equal digits or a leading zero
    assert wrong_answer("150", "zero_pad", 3, rng)[1] == "off_by_one"
    assert wrong_answer("11", "digit_swap", 3, rng)[1] == "off_by_one"
    assert wrong_answer("10", "digit_swap", 3, rng)[1] == "off_by_one"  # "01" would lead with a zero


# ---------------------------------------------------------------------------------------- calibration math


def test_pairwise_summary_by_hand(caplog):
    with caplog.at_level(logging.WARNING, logger="steadyrl.trainers.reward_model"):
        s = pairwise_summary([2.0, 1.0, 0.0, 3.0], [1.0, 1.0, 1.0, -1.0], ["a", "b", "a", "b"])
    # wins: [T, F (tie), F, T] -> 0.5 < 0.60 -> warning; margins [1, 0, -1, 4] -> mean 1
    assert s["accuracy"] == 0.5 and s["ties"] == 0.25 and s["margin_mean"] == 1.0
    assert s["accuracy_by_kind"] == {"a": 0.5, "b": 0.5}
    # all 8 scores [2, 1, 0, 3, 1, 1, 1, -1]: mean 1, unbiased var = (1+0+1+4+0+0+0+4)/7 = 10/7
    assert s["mean"] == pytest.approx(1.0) and s["std"] == pytest.approx(math.sqrt(10 / 7))
    assert s["chosen_mean"] == 1.5 and s["rejected_mean"] == 0.5
    assert any("below 0.60" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="steadyrl.trainers.reward_model"):
        assert pairwise_summary([1.0, 2.0], [0.0, 0.0])["accuracy"] == 1.0 > ACCURACY_WARNING
    assert not caplog.records


def test_reward_stats_validation(tmp_path):
    assert load_reward_stats({"mean": 1, "std": 2}, tmp_path) == {"mean": 1.0, "std": 2.0}
    with pytest.raises(FileNotFoundError, match=r"reward_stats\.json"):
        load_reward_stats(None, tmp_path / "final")
    with pytest.raises(ValueError, match="std > 0"):
        load_reward_stats({"mean": 0.0, "std": 0.0}, tmp_path)


def test_encode_pair_matches_reward_trainer_format():
    from steadyrl.tasks import build_byte_tokenizer

    tok = build_byte_tokenizer()
    ids = encode_pair(tok, "1+2=", "3")
    assert ids == tok("1+2=3</s>")["input_ids"] and ids[-1] == tok.eos_token_id
    assert encode_pair(tok, "1+2=", "3</s>") == ids  # no second EOS


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_reward_stage_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "rm"
    train = arithmetic_preferences("train", n=256, seed=0)
    evaluation = arithmetic_preferences("eval", n=64, seed=0)
    report = run_reward_stage(
        tiny_model_dir,
        train,
        evaluation,
        out,
        max_steps=32,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        logging_steps=8,
        save_strategy="no",
        activation_checkpointing=False,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    for name in ("calibration.json", "calibration.png", "reward_stats.json", "final/reward_stats.json"):
        assert (out / name).is_file(), name
    assert (out / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "calibration.png").stat().st_size > 5000
    assert isinstance(report["accuracy"], float) and 0.0 <= report["accuracy"] <= 1.0
    assert report["n_pairs"] == 64 and sum(report["pairs_by_kind"].values()) == 64
    stats = json.loads((out / "reward_stats.json").read_text())
    assert math.isfinite(stats["mean"]) and math.isfinite(stats["std"]) and stats["std"] > 0 and stats["n"] == 128
    assert json.loads((out / "calibration.json").read_text())["accuracy"] == report["accuracy"]

    reward = RewardModelReward(out / "final")  # finds final/reward_stats.json
    assert reward.__name__ == "reward_model"
    prompts = evaluation["prompt"][:5]
    scores = reward(prompts=prompts, completions=evaluation["chosen"][:5], completion_ids=[[0]] * 5)
    assert len(scores) == 5 and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    raw = RewardModelReward(out / "final", normalize=False)(prompts, evaluation["chosen"][:5])
    assert scores == pytest.approx([(r - stats["mean"]) / stats["std"] for r in raw], abs=1e-5)
