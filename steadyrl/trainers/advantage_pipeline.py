"""Rewards -> advantages: the gathered reward matrix of one generation batch in, one value per row out.

Tensor in, tensor out; no Trainer here. ``SteadyGRPOTrainer.compute_advantages`` calls it in two steps whose order
matters (the trainer writes GRADE's KL factor of ``beta`` in between):

1. ``scale(batch)``: (N, num_funcs) -> (N,): TRL's weighted sum (``weighted_rewards``), rows QUATRO's filters
   dropped set to NaN, then the reward processor (GRADE). NaN marks an unscorable row.
2. ``advantages(rewards, keep, G)``: (N,) -> (N,): per prompt group of G rows, the advantage function (GEPO's
   median/MAD, else TRL's own mean/std normalisation); filtered rows leave their group and get 0.

PPO plugs in ``SequenceRewardPipeline``: step 2 returns the scaled sequence reward itself (NaN -> 0); GAE turns it
into token advantages later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.base import AdvantageFunction, RewardProcessor
from steadyrl.guards.rollout_filters import masked_group_advantages
from steadyrl.metrics import GEPO_ADV_MAX_ABS, GEPO_ADV_STD, GEPO_NONFINITE_REWARDS


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, num_funcs) -> (N,): TRL's weighted sum (``sum_then_normalize``); NaN where every function is NaN.

    inf is as unscorable as NaN: TRL would let one inf zero its whole group's advantages.
    """
    nonfinite = ~torch.isfinite(rewards_per_func) & ~torch.isnan(rewards_per_func)
    if nonfinite.any():
        rewards_per_func = rewards_per_func.masked_fill(nonfinite, torch.nan)
    weights = weights.to(rewards_per_func.device)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


@dataclass(frozen=True)
class RewardBatch:
    """One generation batch, gathered over all ranks: rows are completions, G consecutive rows one prompt."""

    rewards_per_func: torch.Tensor  # (N, num_funcs), NaN = the function could not score the row
    prompts: list[Any]  # N entries, one per row
    num_generations: int  # G
    reward_weights: torch.Tensor  # (num_funcs,)
    keep: torch.Tensor | None = None  # (N,) bool from QUATRO's filters; None = keep all


@dataclass
class ScaledRewards:
    rewards: torch.Tensor  # (N,), NaN = unscorable
    metrics: dict[str, float] = field(default_factory=dict)
    kl_factor: float | None = None  # GRADE's KL compensation: the ``grade`` factor of beta (None: leave it)


class AdvantagePipeline:
    """GRPO's rewards -> advantages (see the module docstring).

    reward_processor: GRADE (``RewardProcessor``) or None; advantage_fn: grouped (P, G) -> (P, G), default TRL's
    group normalisation with ``scale_rewards``; kl_compensation: (lo, hi) clamp of GRADE's KL factor, or None.
    """

    def __init__(
        self,
        reward_processor: RewardProcessor | None = None,
        advantage_fn: AdvantageFunction | None = None,
        scale_rewards: str = "group",
        kl_compensation: tuple[float, float] | None = None,
    ) -> None:
        if kl_compensation is not None and reward_processor is None:
            raise ValueError("kl_compensation needs a reward processor with kl_compensation()")
        self.reward_processor = reward_processor
        self.advantage_fn = advantage_fn or partial(group_normalized_advantages, scale_rewards=scale_rewards)
        self.kl_compensation = kl_compensation

    def scale(self, batch: RewardBatch) -> ScaledRewards:
        """(N, num_funcs) -> (N,) scaled rewards, with the metrics of the step (in logging order)."""
        metrics = {GEPO_NONFINITE_REWARDS: float((~torch.isfinite(batch.rewards_per_func)).sum())}
        rewards = weighted_rewards(batch.rewards_per_func, batch.reward_weights)
        if batch.keep is not None:
            rewards = rewards.masked_fill(~batch.keep.to(rewards.device), torch.nan)
        kl_factor = None
        if self.reward_processor is not None:
            rewards = self.reward_processor(rewards, batch.prompts, batch.num_generations)
            metrics.update(getattr(self.reward_processor, "metrics", dict)())
            if self.kl_compensation is not None:
                kl_factor = self.reward_processor.kl_compensation(*self.kl_compensation)
        return ScaledRewards(rewards, metrics, kl_factor)

    def advantages(
        self, rewards: torch.Tensor, keep: torch.Tensor | None, num_generations: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scaled rewards (N,) -> advantages (N,) and their metrics. ``keep``: dropped rows get 0 and leave their
        group's statistics (``masked_group_advantages``)."""
        if keep is None:
            advantages = self.advantage_fn(rewards.view(-1, num_generations)).reshape(-1)
        else:
            advantages = masked_group_advantages(rewards, keep, num_generations, self.advantage_fn)
        metrics = {
            GEPO_ADV_STD: float(advantages.std()) if advantages.numel() > 1 else 0.0,
            GEPO_ADV_MAX_ABS: float(advantages.abs().max()),
        }
        return advantages, metrics


class SequenceRewardPipeline(AdvantagePipeline):
    """PPO: step 2 gives the *sequence reward* of each row (unscorable and filtered rows 0), no group statistics."""

    def advantages(
        self, rewards: torch.Tensor, keep: torch.Tensor | None, num_generations: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return torch.nan_to_num(rewards, nan=0.0), {}
