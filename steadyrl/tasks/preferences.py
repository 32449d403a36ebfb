"""Preference pairs for the reward-model stage, built from the arithmetic task (docs/DESIGN.md "Reward-model stage").

One Bradley-Terry pair per row in TRL ``RewardTrainer``'s explicit-prompt format (``answer`` and ``kind``, which
the calibration report reads, are ignored by it): ``{"prompt": "37+58=", "chosen": "95", "rejected": "96", "answer":
"95", "kind": "off_by_one"}``. ``rejected`` is ``off_by_one`` (+-1), ``off_by_ten`` (+-10; never negative),
``digit_swap`` (``95`` -> ``59``, no leading zero) or ``zero_pad`` (``095``); a kind that cannot apply to an answer
falls back to ``off_by_one``, so the kinds' shares are close to, not exactly, ``weights``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from datasets import Dataset

from steadyrl.tasks.arithmetic import arithmetic_splits

REJECTION_KINDS = ("off_by_one", "off_by_ten", "digit_swap", "zero_pad")


def _offset(value: int, step: int, rng: random.Random) -> str:
    if value - step < 0:
        return str(value + step)
    return str(value + (step if rng.random() < 0.5 else -step))


def _digit_swap(answer: str, rng: random.Random) -> str | None:
    pairs = [(i, j) for i in range(len(answer)) for j in range(i + 1, len(answer)) if answer[i] != answer[j]]
    rng.shuffle(pairs)
    for i, j in pairs:
        chars = list(answer)
        chars[i], chars[j] = chars[j], chars[i]
        if chars[0] != "0":
            return "".join(chars)
    return None


def wrong_answer(answer: str, kind: str, width: int, rng: random.Random) -> tuple[str, str]:
    """A rejected completion for ``answer``: (text, kind actually used, after the fallback to ``off_by_one``)."""
    if kind not in REJECTION_KINDS:
        raise ValueError(f"unknown rejection kind {kind!r}; valid: {list(REJECTION_KINDS)}")
    value = int(answer)
    if kind == "zero_pad" and len(answer) < width:
        return answer.zfill(width), kind
    if kind == "digit_swap":
        swapped = _digit_swap(answer, rng)
        if swapped is not None:
            return swapped, kind
    if kind == "off_by_ten":
        return _offset(value, 10, rng), kind
    return _offset(value, 1, rng), "off_by_one"


def arithmetic_preferences(split: str = "train", n: int = 2000, seed: int = 0, *,
                           kinds: Sequence[str] = REJECTION_KINDS, weights: Sequence[float] | None = None,
                           max_operand: int = 99, eval_size: int = 200, split_seed: int = 1234,
                           eval_n: int | None = None) -> Dataset:  # fmt: skip
    """``n`` pairs on the ``split`` problems of the arithmetic task (``eval_n`` for the eval split). ``seed`` draws the
    problems (without replacement until the split is used up) and the mistakes; ``split_seed``, ``max_operand`` and
    ``eval_size`` must match the SFT run's task so eval prompts stay unseen (the defaults do)."""
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r} for the arithmetic preferences; use 'train' or 'eval'")
    if split == "eval" and eval_n is not None:
        n = eval_n
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    for kind in kinds:
        if kind not in REJECTION_KINDS:
            raise ValueError(f"unknown rejection kind {kind!r}; valid: {list(REJECTION_KINDS)}")
    if not kinds:
        raise ValueError("kinds must name at least one rejection kind")
    if weights is not None and (len(weights) != len(kinds) or min(weights) < 0 or sum(weights) <= 0):
        raise ValueError(f"weights must be {len(kinds)} non-negative numbers with a positive sum, got {weights}")
    train, evaluation = arithmetic_splits(max_operand=max_operand, eval_size=eval_size, seed=split_seed)
    problems = train if split == "train" else evaluation
    width = len(str(2 * max_operand))
    rng, rows, order = random.Random(seed), [], []
    while len(rows) < n:
        if not order:
            order = list(range(len(problems)))
            rng.shuffle(order)
        problem = problems[order.pop()]
        kind = rng.choices(list(kinds), weights=weights)[0]
        answer = problem["answer"]
        rejected, used = wrong_answer(answer, kind, width, rng)
        row = {"prompt": problem["prompt"], "chosen": answer, "rejected": rejected, "answer": answer, "kind": used}
        rows.append(row)
    return Dataset.from_list(rows)
