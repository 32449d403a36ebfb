"""Evaluation on held-out prompts (greedy, or sampled with the training settings), scored with the run's own reward
functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset

from steadyrl.rewards import TRL_REWARD_KWARGS, RewardFn
from steadyrl.rewards.guarded import call_reward


@torch.no_grad()
def decode_completions(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int,
    batch_size: int,
    sampling: Mapping[str, Any] | None = None,
) -> tuple[list[str], list[list[int]]]:
    """(texts, token ids without padding) of each prompt (a message list through the chat template), greedy-decoded,
    or sampled with ``sampling`` (``generate``'s ``temperature`` / ``top_p`` / ``top_k``; the caller seeds torch)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) if isinstance(p, list) else p
             for p in prompts]  # fmt: skip
    completions: list[str] = []
    ids: list[list[int]] = []
    old_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        for start in range(0, len(texts), batch_size):
            enc = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True).to(device)
            decoding = {"do_sample": True, **sampling} if sampling is not None else {"do_sample": False}
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                **decoding,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
            ids.extend([t for t in row if t != tokenizer.pad_token_id] for row in new.tolist())
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return completions, ids


def eval_scores(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Dataset,
    reward_fns: dict[str, RewardFn],
    *,
    max_new_tokens: int,
    batch_size: int,
    reward_kwargs: dict[str, Any] | None = None,
    sampling: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``{"prompts", "completions", "completion_ids", "scores": {name: [float | None per row]}}`` for completions
    (greedy, or ``decode_completions``' ``sampling``) of every row, each reward called as TRL calls it (the dataset's
    other columns, ``reward_kwargs``; conversational completions as assistant messages). An empty dataset calls
    neither the model nor the rewards."""
    if len(dataset) == 0:
        return {"prompts": [], "completions": [], "completion_ids": [], "scores": {name: [] for name in reward_fns}}
    prompts = list(dataset["prompt"])
    sizes = {"max_new_tokens": max_new_tokens, "batch_size": batch_size}
    completions, ids = decode_completions(model, tokenizer, prompts, **sizes, sampling=sampling)
    columns = {c: list(dataset[c]) for c in dataset.column_names if c not in TRL_REWARD_KWARGS | {"prompt"}}
    chat = isinstance(prompts[0], list)
    completions_arg = [[{"role": "assistant", "content": c}] for c in completions] if chat else completions
    kwargs = {"prompts": prompts, "completions": completions_arg, "completion_ids": ids}
    extra = {**kwargs, **columns, **(reward_kwargs or {})}
    scores = {name: list(call_reward(fn, **extra)) for name, fn in reward_fns.items()}
    return {"prompts": prompts, "completions": completions, "completion_ids": ids, "scores": scores}


def finite_scores(scores: Sequence[float | None]) -> list[float]:
    """The scores that count towards a mean: ``None`` (unscorable) and NaN left out."""
    return [float(s) for s in scores if s is not None and s == s]


def evaluate_rewards(model: torch.nn.Module, tokenizer: Any, dataset: Dataset, reward_fns: dict[str, RewardFn], *,
                     max_new_tokens: int = 16, batch_size: int = 64, max_samples: int | None = None,
                     ) -> dict[str, Any]:  # fmt: skip
    """``{"rewards": {name: mean over greedy completions}, "mean_length", "truncated_share" (reached ``max_new_tokens``
    without EOS, as TRL's ``completions/clipped_ratio``), "samples": the first 5 (prompt, completion)}``."""
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    out = eval_scores(model, tokenizer, dataset, reward_fns, max_new_tokens=max_new_tokens, batch_size=batch_size)
    finite = {name: finite_scores(scores) for name, scores in out["scores"].items()}
    means = {name: sum(f) / len(f) if f else float("nan") for name, f in finite.items()}
    ids, eos = out["completion_ids"], tokenizer.eos_token_id
    truncated = sum(len(i) >= max_new_tokens and (not i or i[-1] != eos) for i in ids)
    return {"rewards": means, "mean_length": sum(len(i) for i in ids) / max(len(ids), 1),
            "truncated_share": truncated / max(len(ids), 1),
            "samples": list(zip(out["prompts"][:5], out["completions"][:5], strict=True))}  # fmt: skip
