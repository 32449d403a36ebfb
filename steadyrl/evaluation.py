"""Greedy evaluation on held-out prompts, scored with the run's own reward functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from datasets import Dataset

from steadyrl.rewards import TRL_REWARD_KWARGS
from steadyrl.tasks.arithmetic import exact_match


@torch.no_grad()
def greedy_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int,
    batch_size: int,
) -> tuple[list[str], list[list[int]]]:
    """Greedy-decode each prompt (text, or a message list rendered with the chat template)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list) else p
        for p in prompts
    ]
    completions: list[str] = []
    ids: list[list[int]] = []
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True).to(device)
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
            for row in new.tolist():
                ids.append([t for t in row if t != tokenizer.pad_token_id])
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return completions, ids


def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    answers: Sequence[str],
    *,
    batch_size: int = 64,
    max_new_tokens: int = 6,
) -> tuple[float, list[str]]:
    """Greedy-decode every prompt and return (exact-match accuracy, completions)."""
    completions, _ = greedy_completions(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)
    scores = exact_match(completions, answers)
    return (sum(scores) / len(scores) if scores else 0.0), completions


def greedy_scores(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Dataset,
    reward_fns: dict[str, Callable[..., list[float | None]]],
    *,
    max_new_tokens: int,
    batch_size: int,
    reward_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Greedy completions of every row of ``dataset`` and each reward's score for each of them.

    Rewards are called as TRL calls them: ``fn(prompts=, completions=, completion_ids=, **columns)`` with the
    dataset's other columns, plus ``reward_kwargs`` (e.g. ``trainer_state``). Conversational prompts get
    their completions as ``[{"role": "assistant", "content": ...}]``.
    Returns ``{"prompts", "completions", "completion_ids", "scores": {name: [float | None per row]}}``;
    an empty dataset gives empty lists and calls neither the model nor the rewards.
    """
    if len(dataset) == 0:
        return {"prompts": [], "completions": [], "completion_ids": [], "scores": {name: [] for name in reward_fns}}
    prompts = list(dataset["prompt"])
    completions, ids = greedy_completions(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    columns = {c: list(dataset[c]) for c in dataset.column_names if c not in TRL_REWARD_KWARGS | {"prompt"}}
    if isinstance(prompts[0], list):
        completions_arg: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
    else:
        completions_arg = completions
    scores = {
        name: list(
            fn(prompts=prompts, completions=completions_arg, completion_ids=ids, **columns, **(reward_kwargs or {}))
        )
        for name, fn in reward_fns.items()
    }
    return {"prompts": prompts, "completions": completions, "completion_ids": ids, "scores": scores}


def finite_scores(scores: Sequence[float | None]) -> list[float]:
    """The scores that count towards a mean: ``None`` (unscorable) and NaN left out."""
    return [float(s) for s in scores if s is not None and s == s]


def evaluate_rewards(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Dataset,
    reward_fns: dict[str, Callable[..., list[float | None]]],
    *,
    max_new_tokens: int = 16,
    batch_size: int = 64,
    max_samples: int | None = None,
) -> dict[str, Any]:
    """Mean of each reward over greedy completions of ``dataset['prompt']``; also mean completion length.

    Returns ``{"rewards": {name: mean}, "mean_length": float, "truncated_share": float, "samples": [(prompt,
    completion), ...]}``; ``truncated_share`` is the share of completions that reached ``max_new_tokens`` without
    an end-of-sequence token (cut off, as TRL's ``completions/clipped_ratio`` counts them in training).
    """
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    out = greedy_scores(model, tokenizer, dataset, reward_fns, max_new_tokens=max_new_tokens, batch_size=batch_size)
    means = {}
    for name, scores in out["scores"].items():
        finite = finite_scores(scores)
        means[name] = sum(finite) / len(finite) if finite else float("nan")
    ids = out["completion_ids"]
    eos = tokenizer.eos_token_id
    truncated = sum(len(i) >= max_new_tokens and (not i or i[-1] != eos) for i in ids)
    return {
        "rewards": means,
        "mean_length": sum(len(i) for i in ids) / max(len(ids), 1),
        "truncated_share": truncated / max(len(ids), 1),
        "samples": list(zip(out["prompts"][:5], out["completions"][:5], strict=True)),
    }
