"""Embedded default: a tiny byte-level LLaMA and the arithmetic task (no hub access)."""

from steadyrl.tasks.arithmetic import (
    answer_anywhere,
    answer_length,
    arithmetic_dataset,
    arithmetic_splits,
    digit_credit,
    exact_match,
    numeric_match,
)
from steadyrl.tasks.tiny_model import build_byte_tokenizer, build_tiny_model

__all__ = ["answer_anywhere", "answer_length", "arithmetic_dataset", "arithmetic_splits", "build_byte_tokenizer",
           "build_tiny_model", "digit_credit", "exact_match", "numeric_match"]  # fmt: skip
