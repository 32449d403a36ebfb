"""TRL's GRPO group advantage (``multi_objective_aggregation: sum_then_normalize``) as a pure function over
tensors, so that a reward processor can be placed in front of it without changing anything else.
"""

from __future__ import annotations

import torch

ADVANTAGE_EPS = 1e-4  # TRL's epsilon in (r - mean) / (std + eps)


def group_normalized_advantages(grouped_rewards: torch.Tensor, scale_rewards: str = "group") -> torch.Tensor:
    """TRL's GRPO advantage: (r - group mean) / (std + 1e-4), NaN rows -> 0.

    grouped_rewards: (num_prompts, G), NaN = unscorable -> advantages: same shape.
    scale_rewards: "group" (std within each group), "batch" (std over the whole batch) or "none" (centre only).
    """
    from trl.trainer.utils import nanstd  # here: trl takes seconds to import, and the config loader imports this module

    group_size = grouped_rewards.shape[1]
    mean = torch.nanmean(grouped_rewards, dim=1, keepdim=True)
    advantages = grouped_rewards - mean
    if scale_rewards == "group":
        std = nanstd(grouped_rewards, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        advantages = advantages / (std + ADVANTAGE_EPS)
    elif scale_rewards == "batch":
        flat = grouped_rewards.reshape(-1)
        std = nanstd(flat) if flat.numel() > 1 else torch.zeros(())
        advantages = advantages / (std + ADVANTAGE_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; valid: 'group', 'batch', 'none'")
    return torch.nan_to_num(advantages, nan=0.0)
