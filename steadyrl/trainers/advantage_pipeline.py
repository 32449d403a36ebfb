"""Rewards -> advantages, tensor in, tensor out, in two steps (``RolloutStation.advantages`` calls them):

1. ``scale(batch)``: (N, num_funcs) -> (N,): TRL's weighted sum, rows the filters dropped NaN, then the reward
   processor (GRADE; its KL factor of beta comes out here). NaN marks an unscorable row.
2. ``advantages(rewards, keep, G)``: (N,) -> (N,): per group of G rows, the advantage function (GEPO's: TRL's
   mean/std, median/MAD on groups with a far outlier; else TRL's); filtered rows leave their group and get 0.

Observe mode: ``observe_rewards``: the processor runs and logs, the raw rewards go on; ``observe_advantages``: the
advantage function is only compared with TRL's normalisation, which trains. PPO's ``SequenceRewardPipeline``: step
2 returns the sequence reward itself; GAE makes token advantages later.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.base import AdvantageFunction, RewardProcessor
from steadyrl.guards.robust_advantage import GEPOAdvantage
from steadyrl.guards.rollout_filters import masked_group_advantages
from steadyrl.metrics import (
    GEPO_ADV_MAX_ABS,
    GEPO_ADV_STD,
    GEPO_NONFINITE_REWARDS,
    GEPO_ROBUST_GROUPS,
    GEPO_WOULD_ADV_DIFF_MEAN,
    GEPO_WOULD_CLIP_ROWS,
    GEPO_WOULD_ROBUST_GROUPS,
    GRADE_KL_FACTOR_WOULD,
)


def weighted_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(N, num_funcs) -> (N,): TRL's weighted sum; NaN where every function is NaN or inf (TRL would let one inf
    zero its whole group's advantages)."""
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
    """GRPO's rewards -> advantages. ``advantage_fn``: grouped (P, G) -> (P, G), default TRL's group normalisation
    with ``scale_rewards``; ``kl_compensation``: (lo, hi) clamp of GRADE's KL factor, or None."""

    always = False  # True: replaces TRL's advantages even with no guard part (PPO's sequence rewards)

    def __init__(
        self, reward_processor: RewardProcessor | None = None, advantage_fn: AdvantageFunction | None = None,
        scale_rewards: str = "group", kl_compensation: tuple[float, float] | None = None, observe_rewards: bool = False,
        observe_advantages: bool = False,
    ) -> None:  # fmt: skip
        if kl_compensation is not None and reward_processor is None:
            raise ValueError("kl_compensation needs a reward processor with kl_compensation()")
        self.reward_processor = reward_processor
        self.trl_advantages = partial(group_normalized_advantages, scale_rewards=scale_rewards)
        if isinstance(advantage_fn, GEPOAdvantage):  # its groups without a far outlier get TRL's advantage
            advantage_fn = dataclasses.replace(advantage_fn, scale_rewards=scale_rewards)
        self.advantage_fn = advantage_fn or partial(group_normalized_advantages, scale_rewards=scale_rewards)
        self.kl_compensation = kl_compensation
        self.observe_rewards, self.observe_advantages = observe_rewards, observe_advantages

    def scale(self, batch: RewardBatch) -> ScaledRewards:
        """(N, num_funcs) -> (N,) scaled rewards, with the metrics of the step (in logging order)."""
        metrics = {GEPO_NONFINITE_REWARDS: float((~torch.isfinite(batch.rewards_per_func)).sum())}
        rewards = weighted_rewards(batch.rewards_per_func, batch.reward_weights)
        if batch.keep is not None:
            rewards = rewards.masked_fill(~batch.keep.to(rewards.device), torch.nan)
        kl_factor = None
        if self.reward_processor is not None:
            scaled = self.reward_processor(rewards.clone(), batch.prompts, batch.num_generations)
            metrics.update(getattr(self.reward_processor, "metrics", dict)())
            if self.kl_compensation is not None:
                kl_factor = self.reward_processor.kl_compensation(*self.kl_compensation)
            if self.observe_rewards:  # observe mode: the scaler's state and metrics move on, the raw rewards train
                if kl_factor is not None:
                    metrics[GRADE_KL_FACTOR_WOULD] = kl_factor
                return ScaledRewards(rewards, metrics, None)
            rewards = scaled
        return ScaledRewards(rewards, metrics, kl_factor)

    def advantages(
        self, rewards: torch.Tensor, keep: torch.Tensor | None, num_generations: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scaled rewards (N,) -> advantages (N,) and their metrics. ``keep``: dropped rows get 0 and leave their
        group's statistics (``masked_group_advantages``)."""
        advantages = computed = self._grouped(self.advantage_fn, rewards, keep, num_generations)
        if self.observe_advantages:  # the advantage function only observes: TRL's group normalisation trains
            advantages = self._grouped(self.trl_advantages, rewards, keep, num_generations)
        metrics = {
            GEPO_ADV_STD: float(advantages.std()) if advantages.numel() > 1 else 0.0,
            GEPO_ADV_MAX_ABS: float(advantages.abs().max()),
        }
        if isinstance(self.advantage_fn, GEPOAdvantage):
            robust = float(self.advantage_fn.robust_groups)
            metrics[GEPO_WOULD_ROBUST_GROUPS if self.observe_advantages else GEPO_ROBUST_GROUPS] = robust
        if self.observe_advantages:
            metrics.update(compare_advantages(computed, advantages, getattr(self.advantage_fn, "clip_scale", None)))
        return advantages, metrics

    @staticmethod
    def _grouped(
        fn: AdvantageFunction, rewards: torch.Tensor, keep: torch.Tensor | None, num_generations: int
    ) -> torch.Tensor:
        if keep is None:
            return fn(rewards.view(-1, num_generations)).reshape(-1)
        return masked_group_advantages(rewards, keep, num_generations, fn)


def compare_advantages(
    would: torch.Tensor, trained: torch.Tensor, clip_scale: float | None, shrink: float = 0.1
) -> dict[str, float]:
    """Observe mode: (N,) observing advantages against the (N,) trained ones: ``gepo/would_adv_diff_mean`` (mean
    |would - trained|) and, for a tanh clip ``a = c tanh(z / c)``, ``gepo/would_clip_rows``: rows whose pre-clip
    ``z = c atanh(a / c)`` it shrinks by more than ``shrink`` (|a| < (1 - shrink) |z|)."""
    out = {GEPO_WOULD_ADV_DIFF_MEAN: float((would.double() - trained.double()).abs().mean()) if would.numel() else 0.0}
    if clip_scale is not None:
        a = would.double()
        z = clip_scale * torch.atanh((a / clip_scale).clamp(-1 + 1e-15, 1 - 1e-15))
        out[GEPO_WOULD_CLIP_ROWS] = float((a.abs() < (1 - shrink) * z.abs()).sum())
    return out


class SequenceRewardPipeline(AdvantagePipeline):
    """PPO: step 2 gives the *sequence reward* of each row, no group statistics. An unscorable or filtered row is
    NaN: ``SteadyPPOTrainer`` gives it advantage 0 and leaves it out of the whitening and the value loss."""

    always = True

    def advantages(
        self, rewards: torch.Tensor, keep: torch.Tensor | None, num_generations: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        out = rewards.clone()
        if keep is not None:
            out[~keep.to(out.device)] = float("nan")
        return out, {}
