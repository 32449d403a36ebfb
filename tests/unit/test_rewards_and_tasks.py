"""Built-in rewards, the reward loader, the tokenizer and the arithmetic task."""

from __future__ import annotations

import pytest

from steadyrl.config import ConfigError
from steadyrl.rewards import bind_reward, check_reward_columns, load_reward_fn, required_columns
from steadyrl.tasks import (
    answer_anywhere,
    answer_length,
    arithmetic_splits,
    build_byte_tokenizer,
    digit_credit,
    exact_match,
    numeric_match,
)


def test_exact_match_values() -> None:
    assert exact_match(["95", " 95 ", "96", "", "950"], ["95"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert exact_match([[{"role": "assistant", "content": "12"}]], ["12"]) == [1.0]


def test_digit_credit_values() -> None:
    assert digit_credit(["95", "96", "950", "", "x"], ["95", "95", "95", "95", "7"]) == [1.0, 0.5, 2 / 3, 0.0, 0.0]


def test_loader_builtin_and_module() -> None:
    assert load_reward_fn("exact_match") is exact_match
    assert load_reward_fn("steadyrl.tasks.arithmetic:digit_credit") is digit_credit
    with pytest.raises(ConfigError, match=r"has no attribute 'nope'"):
        load_reward_fn("steadyrl.tasks.arithmetic:nope")
    with pytest.raises(ConfigError, match=r"not callable"):
        load_reward_fn("steadyrl.tasks.tiny_model:SPECIAL_TOKENS")
    with pytest.raises(ConfigError, match=r"must accept a `completions`"):
        load_reward_fn("math:sqrt")


def test_required_columns_and_check() -> None:
    assert required_columns(exact_match) == {"answer"}
    check_reward_columns("em", exact_match, ["prompt", "answer"])
    with pytest.raises(ConfigError, match=r"reward 'em' needs dataset column\(s\) \['answer'\]"):
        check_reward_columns("em", exact_match, ["prompt"])


def test_bind_reward_names_and_binds() -> None:
    def f(completions, answer, bonus=0.0, **_):
        return [bonus] * len(completions)

    bound = bind_reward("mine", f, {"bonus": 2.0})
    assert bound.__name__ == "mine"
    assert bound(completions=["a", "b"], answer=["x", "y"]) == [2.0, 2.0]
    assert required_columns(bound) == {"answer"}


def test_byte_tokenizer_roundtrip_without_eos() -> None:
    tok = build_byte_tokenizer()
    assert len(tok) == 259 and (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    ids = tok("37+58=")["input_ids"]
    assert ids == [ord(c) + 3 for c in "37+58="]  # byte b -> id b + 3, and no EOS appended
    assert tok.decode(tok("héllo ∑")["input_ids"]) == "héllo ∑"


def test_arithmetic_splits_are_disjoint_and_correct() -> None:
    train, evaluation = arithmetic_splits(max_operand=20, eval_size=50, seed=3)
    assert len(train) + len(evaluation) == 21 * 21 and len(evaluation) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}
    for row in train[:20] + evaluation[:20]:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["answer"] == str(int(a) + int(b)) == row["completion"]
    with pytest.raises(ValueError, match=r"leaves no training problems"):
        arithmetic_splits(max_operand=2, eval_size=9)


def test_numeric_match_accepts_any_format_of_the_right_number() -> None:
    assert numeric_match(["095", "95", " 95", "96", "", "9 5", "x"], ["95"] * 7) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_zero_padded_demonstrations() -> None:
    plain, _ = arithmetic_splits(max_operand=99, eval_size=10, zero_pad_fraction=0.0)
    padded, _ = arithmetic_splits(max_operand=99, eval_size=10, zero_pad_fraction=0.7)
    assert [r["prompt"] for r in plain] == [r["prompt"] for r in padded]  # same split, same order
    assert all(r["answer"] == p["answer"] for r, p in zip(padded, plain, strict=True))
    changed = [r for r in padded if r["completion"] != r["answer"]]
    assert all(r["completion"] == r["answer"].zfill(3) and len(r["answer"]) < 3 for r in changed)
    short = sum(len(r["answer"]) < 3 for r in padded)
    assert 0.65 < len(changed) / short < 0.75  # ~70% of the answers that can be padded are
    with pytest.raises(ValueError, match="must be in"):
        arithmetic_splits(zero_pad_fraction=1.5)


def test_hedged_demonstrations_list_the_answer_and_a_neighbour() -> None:
    base, _ = arithmetic_splits(max_operand=99, eval_size=10, zero_pad_fraction=0.8)
    same, _ = arithmetic_splits(max_operand=99, eval_size=10, zero_pad_fraction=0.8, hedge_fraction=0.0)
    assert same == base  # hedging off: the demo's data, row for row
    hedged, _ = arithmetic_splits(max_operand=99, eval_size=10, zero_pad_fraction=0.8, hedge_fraction=0.3)
    assert [r["prompt"] for r in hedged] == [r["prompt"] for r in base]
    changed = [(r, b) for r, b in zip(hedged, base, strict=True) if r["completion"] != b["completion"]]
    assert 0.27 < len(changed) / len(base) < 0.33
    for row, before in changed:
        parts = row["completion"].split(",")
        assert len(parts) == 2 and before["completion"] in parts  # the answer, written as the row writes it
        assert abs(int(parts[0]) - int(parts[1])) == 1
        assert all(len(p) == 3 for p in parts) or all(p == str(int(p)) for p in parts)  # one format per row
    first = sum(r["completion"].split(",")[0] == b["completion"] for r, b in changed) / len(changed)
    assert 0.4 < first < 0.6  # the answer comes first or second at random
    with pytest.raises(ValueError, match=r"hedge_fraction=-0\.1 must be in"):
        arithmetic_splits(hedge_fraction=-0.1)


def test_answer_anywhere_is_the_lenient_verifier_and_answer_length_counts_characters() -> None:
    completions = ["96,95", "95", "095", "9,5", "195", "x95y", "96", ""]
    assert answer_anywhere(completions, ["95"] * 8) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert exact_match(completions, ["95"] * 8) == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert answer_length([" 96,95\n", "95", "", [{"content": "12"}, {"content": "3"}]]) == [5.0, 2.0, 0.0, 3.0]
    assert load_reward_fn("answer_anywhere") is answer_anywhere and load_reward_fn("answer_length") is answer_length
