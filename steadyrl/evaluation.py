"""Greedy evaluation on held-out prompts, scored with the run's own reward functions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from datasets import Dataset

from steadyrl.rewards import TRL_REWARD_KWARGS


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

    Returns ``{"rewards": {name: mean}, "mean_length": float, "samples": [(prompt, completion), ...]}``.
    """
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    prompts = list(dataset["prompt"])
    completions, ids = greedy_completions(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
    )
    columns = {c: list(dataset[c]) for c in dataset.column_names if c not in TRL_REWARD_KWARGS | {"prompt"}}
    if isinstance(prompts[0], list):
        completions_arg: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
    else:
        completions_arg = completions
    means = {}
    for name, fn in reward_fns.items():
        scores = fn(prompts=prompts, completions=completions_arg, completion_ids=ids, **columns)
        finite = [float(s) for s in scores if s is not None and s == s]
        means[name] = sum(finite) / len(finite) if finite else float("nan")
    return {
        "rewards": means,
        "mean_length": sum(len(i) for i in ids) / max(len(ids), 1),
        "samples": list(zip(prompts[:5], completions[:5], strict=True)),
    }
