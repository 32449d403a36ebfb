"""Bad data rows (steadyrl.data_rows, data.on_bad_row): each kind found with its row and column; error or skip."""

from __future__ import annotations

import logging

import pytest
from datasets import Dataset

from steadyrl.config import ConfigError
from steadyrl.data_rows import check_rows, prompt_text

ROWS = [
    {"prompt": "1+1=", "answer": "2"},
    {"prompt": "", "answer": "3"},  # 1: empty prompt
    {"prompt": "2+2=", "answer": None},  # 2: a jsonl line without "answer"
    {"prompt": " \n\t", "answer": "5"},  # 3: whitespace prompt
    {"prompt": "12345678+1=", "answer": "12345679"},  # 4: 11 characters: too long for a limit of 8
    {"prompt": "3+3=", "answer": "6"},
]
NEEDS = {"answer": ["exact_match"]}


def chars(prompts, tokenizer):
    """A stand-in tokenizer count: one token per character."""
    return [len(prompt_text(p)) for p in prompts]


def test_first_bad_row_is_an_error_naming_source_row_and_column() -> None:
    with pytest.raises(ConfigError) as info:
        check_rows(Dataset.from_list(ROWS), "data/train.jsonl", "error", NEEDS)
    assert str(info.value) == (
        "data/train.jsonl: row 1, column 'prompt': empty prompt ('') (3 bad rows in all). Fix the data, or set "
        "data.on_bad_row: skip to drop such rows at load"
    )


def test_each_kind_of_bad_row_with_its_message() -> None:
    cases = [
        (ROWS[2], "row 0, column 'answer': empty (None), and reward 'exact_match' needs it."),
        (ROWS[3], "row 0, column 'prompt': empty prompt (' \\n\\t')."),
        (ROWS[4], "row 0, column 'prompt': prompt of 11 tokens, over the 8 that fit (context 12 - "
         "trainer.max_completion_length 4)."),
        ({"prompt": [{"role": "user", "content": "  "}], "answer": "1"}, "row 0, column 'prompt': empty prompt ("),
    ]  # fmt: skip
    for row, message in cases:
        with pytest.raises(ConfigError) as info:
            check_rows(Dataset.from_list([row]), "f.jsonl", "error", NEEDS, object(), 12, 4, count_tokens=chars)
        assert str(info.value).startswith(f"f.jsonl: {message}")


def test_skip_drops_the_bad_rows_and_logs_the_counts(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        kept = check_rows(Dataset.from_list(ROWS), "f.jsonl", "skip", NEEDS, object(), 12, 4, count_tokens=chars)
    assert kept["prompt"] == ["1+1=", "3+3="]
    assert (
        "data.on_bad_row=skip: dropped 4 of 6 rows of f.jsonl (empty prompt: 2, empty 'answer': 1, prompt too long: "
        "1); first: row 1, empty prompt ('')"
    ) in caplog.text


def test_clean_data_comes_back_unchanged_and_no_length_check_without_a_context() -> None:
    ds = Dataset.from_list([ROWS[0], ROWS[4], ROWS[5]])
    assert check_rows(ds, "f.jsonl", "error", NEEDS) is ds
    assert check_rows(ds, "f.jsonl", "error", {}, object(), None, 4, count_tokens=chars) is ds


def test_on_bad_row_is_validated(tmp_path) -> None:
    from steadyrl.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("model: {path: m}\ndata: {path: d, on_bad_row: drop}\ntrainer: {output_dir: o}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"data.on_bad_row (set in {path}): must be one of ['error', 'skip'], got 'drop'"


def test_prompt_tokens_are_counted_with_the_runs_tokenizer() -> None:
    from steadyrl.data_rows import prompt_token_counts
    from steadyrl.tasks import build_byte_tokenizer

    assert prompt_token_counts(["37+58=", "héllo"], build_byte_tokenizer()) == [6, 6]  # bytes; 'é' is two
