"""The real-model task: short arithmetic word problems posed as chat messages, scored with math-verify.

``Sam has 23 marbles. He finds 15 more. Then he gives away 9. How many marbles does Sam have now?``: a start amount
and ``steps`` operations (add, take away, with ``allow_multiply`` "N times as many"), answers in ``[0, 999]``. The
first ``eval_size`` distinct identities (numbers and operations) drawn from a seeded generator are the eval split;
train never repeats one. Rewards: ``math_answer`` (math-verify's anchored answer or else the last number equals the
gold number) and ``concise_answer`` (at most ``max_words`` words, ending on a number; docs/DESIGN.md).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from datasets import Dataset

from steadyrl.tasks.arithmetic import _completion_text as completion_text

NAMES = (
    ("Sam", "He"), ("Mia", "She"), ("Leo", "He"), ("Ava", "She"), ("Noah", "He"), ("Zoe", "She"),
    ("Omar", "He"), ("Lina", "She"), ("Ivan", "He"), ("Maya", "She"), ("Ken", "He"), ("Rosa", "She"),
)  # fmt: skip
ITEMS = ("marbles", "apples", "stickers", "coins", "books", "cards", "pencils", "shells", "stamps", "cookies")
INSTRUCTION = "Answer with just the final number."

_GAIN = ("finds {n} more", "buys {n} more", "gets {n} more from a friend", "is given {n} more")
_LOSS = ("gives away {n}", "loses {n}", "uses {n}", "sells {n}")
_TIMES = ("ends up with {n} times as many",)

Identity = tuple[int, tuple[tuple[str, int], ...]]


def _draw(rng: random.Random, steps: int, max_start: int, max_operand: int, allow_multiply: bool) -> Identity:
    """A start amount and ``steps`` operations whose running total stays in [0, 999]."""
    while True:
        total = start = rng.randint(2, max_start)
        ops: list[tuple[str, int]] = []
        for _ in range(steps):
            kind = rng.choice(["+", "-"] + (["*"] if allow_multiply and total <= 99 else []))
            if kind == "+":
                n = rng.randint(2, max_operand)
                total += n
            elif kind == "-":
                if total < 3:
                    break
                n = rng.randint(1, min(max_operand, total - 1))
                total -= n
            else:
                n = rng.randint(2, 4)
                total *= n
            ops.append((kind, n))
        if len(ops) == steps and 0 <= total <= 999:
            return start, tuple(ops)


def answer_of(identity: Identity) -> int:
    """The number a problem asks for: its start amount with every operation applied in order."""
    total, ops = identity
    for kind, n in ops:
        total = total + n if kind == "+" else total - n if kind == "-" else total * n
    return total


def _story(identity: Identity, rng: random.Random) -> str:
    start, ops = identity
    (name, pronoun), item = rng.choice(NAMES), rng.choice(ITEMS)
    sentences = [f"{name} has {start} {item}."]
    for i, (kind, n) in enumerate(ops):
        phrase = rng.choice({"+": _GAIN, "-": _LOSS, "*": _TIMES}[kind]).format(n=n)
        lead = pronoun if i == 0 else f"Then {pronoun.lower()}"
        sentences.append(f"{lead} {phrase}.")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences)


def word_problem_splits(steps: int = 2, max_start: int = 50, max_operand: int = 30, allow_multiply: bool = False,
                        train_size: int = 4000, eval_size: int = 200, seed: int = 1234,
                        ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """(train, eval) rows: ``prompt`` (one user message), ``answer`` (the number as text), ``problem``."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    rng, seen, rows, attempts = random.Random(seed), set(), [], 0
    while len(rows) < eval_size + train_size:
        attempts += 1
        if attempts > 50 * (eval_size + train_size):
            raise ValueError(f"only {len(rows)} distinct problems exist for steps={steps}, max_start={max_start}, "
                             f"max_operand={max_operand}; lower train_size/eval_size or widen the ranges")  # fmt: skip
        identity = _draw(rng, steps, max_start, max_operand, allow_multiply)
        if identity in seen:
            continue
        seen.add(identity)
        problem = _story(identity, rng)
        prompt = [{"role": "user", "content": f"{problem} {INSTRUCTION}"}]
        rows.append({"prompt": prompt, "answer": str(answer_of(identity)), "problem": problem})
    return rows[eval_size:], rows[:eval_size]


def word_problem_dataset(split: str = "train", **kwargs: Any) -> Dataset:
    """The train or eval split as a ``datasets.Dataset`` (columns ``prompt``, ``answer``, ``problem``)."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r} for the word-problem task; use 'train' or 'eval'")
    train, evaluation = word_problem_splits(**kwargs)
    return Dataset.from_list(train if split == "train" else evaluation)


def math_answer(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """1.0 when math-verify extracts the gold number from the completion, else 0.0 (see the module doc)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    scores = []
    for completion, gold in zip(completions, answer, strict=True):
        gold_parsed = parse(gold, extraction_config=[ExprExtractionConfig()])
        predicted = parse(completion_text(completion), extraction_config=extraction, extraction_mode="first_match")
        scores.append(float(bool(predicted) and verify(gold_parsed, predicted)))
    return scores


_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?\D{0,12}$")


def concise_answer(completions: Sequence[Any], max_words: int = 12, **_: Any) -> list[float]:
    """1.0 when the completion has at most ``max_words`` words and ends on a number (``29``, ``18 + 11 = 29.``,
    ``29 marbles.``), else 0.0. A completion cut off at the length limit rarely ends on a number."""
    texts = [completion_text(completion).strip() for completion in completions]
    return [float(0 < len(text.split()) <= max_words and _LAST_NUMBER.search(text) is not None) for text in texts]
