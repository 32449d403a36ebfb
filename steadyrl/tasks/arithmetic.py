"""The embedded arithmetic task: prompts like ``37+58=``, answer ``95``.

Train and eval sets are disjoint by construction: every ordered pair ``(a, b)`` is assigned to eval or
train by a seeded permutation, so a held-out prompt never appears in training, whatever the sizes.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from datasets import Dataset


def arithmetic_splits(
    max_operand: int = 99,
    eval_size: int = 200,
    seed: int = 1234,
    zero_pad_fraction: float = 0.0,
    hedge_fraction: float = 0.0,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """All ``a+b=`` problems with operands in ``[0, max_operand]`` as (train, eval) rows: ``prompt`` (``"37+58="``),
    ``answer`` (``"95"``) and ``completion`` (the SFT demonstration; ``zero_pad_fraction`` of them zero-padded to the
    widest answer, ``"095"``, a format ``exact_match`` rejects: the gap the embedded GRPO demo closes;
    ``hedge_fraction`` of them hedge between the answer and an off-by-one neighbour in random order, ``"96,95"``,
    as instruction-tuned models hedge: what a lenient verifier (``answer_anywhere``) over-pays)."""
    for name, value in (("zero_pad_fraction", zero_pad_fraction), ("hedge_fraction", hedge_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1]")
    pairs = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(pairs)
    if eval_size >= len(pairs):
        raise ValueError(f"eval_size={eval_size} leaves no training problems out of {len(pairs)}")
    width = len(str(2 * max_operand))
    pad, hedge = random.Random(seed + 1), random.Random(seed + 2)  # separate streams: hedging leaves padding alone
    rows = []
    for a, b in pairs:
        answer = str(a + b)
        padded = pad.random() < zero_pad_fraction
        candidates = [a + b]
        if hedge_fraction and hedge.random() < hedge_fraction:
            neighbour = a + b + 1 if a + b == 0 or hedge.random() < 0.5 else a + b - 1
            candidates = [a + b, neighbour] if hedge.random() < 0.5 else [neighbour, a + b]
        completion = ",".join(str(c).zfill(width) if padded else str(c) for c in candidates)
        rows.append({"prompt": f"{a}+{b}=", "answer": answer, "completion": completion})
    return rows[eval_size:], rows[:eval_size]


def arithmetic_dataset(split: str = "train", **kwargs: Any) -> Dataset:
    """The train or eval split as a ``datasets.Dataset`` (columns ``prompt``, ``answer``, ``completion``)."""
    train, evaluation = arithmetic_splits(**kwargs)
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r} for the arithmetic task; use 'train' or 'eval'")
    return Dataset.from_list(train if split == "train" else evaluation)


def _completion_text(completion: Any) -> str:
    """A completion as plain text: TRL passes strings, or message lists for conversational data."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def exact_match(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion (surrounding whitespace stripped) equals the answer, else 0.0."""
    return [float(_completion_text(c).strip() == a) for c, a in zip(completions, answer, strict=True)]


def numeric_match(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 when the completion is the right number in any format (``"095"`` for 95 counts), else 0.0."""
    texts = [_completion_text(c).strip() for c in completions]
    return [float(text.isdigit() and int(text) == int(a)) for text, a in zip(texts, answer, strict=True)]


def answer_anywhere(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """A lenient verifier: 1.0 when any number in the completion is the answer as written canonically (``"96,95"``
    for 95 counts, ``"095"`` does not), else 0.0. It pays hedging: the reward-hacking scenario's training reward."""
    return [float(a in re.findall(r"\d+", _completion_text(c))) for c, a in zip(completions, answer, strict=True)]


def answer_length(completions: Sequence[Any], **_: Any) -> list[float]:
    """The completion's length in characters (surrounding whitespace stripped): with a small weight, the length
    preference of a learned reward model, which a policy games by padding its answer (here: by hedging)."""
    return [float(len(_completion_text(c).strip())) for c in completions]


def digit_credit(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """Share of positions where completion and answer agree, over the longer length (``"96"`` vs ``"95"`` -> 0.5)."""
    scores = []
    for c, a in zip(completions, answer, strict=True):
        text = _completion_text(c).strip()
        longest = max(len(text), len(a))
        scores.append(sum(x == y for x, y in zip(text, a, strict=False)) / longest if longest else 0.0)
    return scores
