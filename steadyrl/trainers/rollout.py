"""Station 1 of a TRL step, rewards -> advantages: what steadyrl does inside ``_calculate_rewards``,
``_generate_and_score_completions`` and ``_prepare_inputs``.

The entropy floor's reward gate, QUATRO's rollout filters and replay mixing, and the advantage pipeline (GRADE's
scaling, GEPO's advantages; ``advantage_pipeline``). No trainer here: a ``RuntimeContext`` and the ``GuardParts``
in, values out (advantages, the mixed micro-batches, GRADE's factor of beta, which the trainer writes through
``trl_state``). Values handed from ``_calculate_rewards`` to its caller wait in ``HookScratch``.
"""

from __future__ import annotations

from typing import Any

import torch

from steadyrl.metrics import GUARD_PART_GEPO_ADVANTAGES, GUARD_PART_QUATRO_FILTERS, GUARD_PART_QUATRO_MEASURE
from steadyrl.metrics import GUARD_PART_QUATRO_REPLAY as REPLAY
from steadyrl.trainers.advantage_pipeline import AdvantagePipeline, RewardBatch, weighted_rewards
from steadyrl.trainers.context import RuntimeContext
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.scratch import HookScratch


class RolloutStation:
    """Rewards -> advantages for one generation batch. ``rewrites``: steadyrl computes the advantages (else TRL's
    stay untouched); ``pipeline``: GRPO's ``AdvantagePipeline`` or PPO's ``SequenceRewardPipeline``."""

    def __init__(self, ctx: RuntimeContext, parts: GuardParts, pipeline: AdvantagePipeline, scratch: HookScratch):
        self.ctx, self.parts, self.pipeline, self.scratch = ctx, parts, pipeline, scratch
        self.quatro = parts.quatro
        self.rewrites = parts.rewrites_advantages or pipeline.always

    def replay_on(self, training: bool) -> bool:
        return self.quatro is not None and self.quatro.replay_on and training

    def on_rewards(
        self, rewards_per_func: torch.Tensor, prompts: list[Any], completion_ids: list[Any], weights: torch.Tensor,
        training: bool,
    ) -> None:  # fmt: skip
        """After TRL scored a generation batch ((N, num_funcs), gathered): the floor's learning gate reads the
        rewards; the matrix, the gathered prompts and this rank's completion lengths wait for the advantages."""
        quatro = self.quatro
        if quatro is not None and quatro.wants_rewards and training:
            with self.ctx.timer(GUARD_PART_QUATRO_MEASURE):
                quatro.record_reward(quatro.gate_rewards(rewards_per_func, weights))
        if not self.rewrites:
            return
        with self.ctx.timer("pipeline"):
            self.scratch.scores = (rewards_per_func, self.ctx.gather_object(list(prompts)))
            if quatro is not None and quatro.filters_on:
                lengths = [len(ids) for ids in completion_ids]  # this rank's, unpadded
                self.scratch.completion_lengths = torch.tensor(lengths, dtype=torch.long)

    def mix(self, fresh: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """TRL's fresh micro-batches of one generation -> the same number mixed with replayed rows."""
        assert self.quatro is not None
        with self.ctx.timer(REPLAY):
            return self.quatro.mix_generation(fresh, step)

    def on_scored(
        self, output: dict[str, Any], rows: int, weights: torch.Tensor, num_generations: int, training: bool
    ) -> float | None:
        """After TRL's ``_generate_and_score_completions``: filters, then this rank's ``rows`` of the advantages
        into ``output`` (with ``dropped_rows: exclude`` also the dropped rows out of its completion mask). Returns
        GRADE's KL factor of beta, or None to leave beta alone."""
        if not self.rewrites:
            return None
        assert self.scratch.scores is not None, "_calculate_rewards did not run before advantages"
        (rewards_per_func, prompts), self.scratch.scores = self.scratch.scores, None
        start, local = self.ctx.rank * rows, rows
        keep = None
        with self.ctx.timer("pipeline"):
            completion_lengths, self.scratch.completion_lengths = self.scratch.completion_lengths, None
            if completion_lengths is not None and training:
                assert self.quatro is not None
                with self.ctx.timer(GUARD_PART_QUATRO_FILTERS):
                    rewards = weighted_rewards(rewards_per_func, weights)
                    keep = self.quatro.filter_generation(output, rewards, completion_lengths, num_generations)
            batch = RewardBatch(rewards_per_func, prompts, num_generations, weights, keep)
            advantages, kl_factor = self.advantages(batch)
            output["advantages"] = advantages[start : start + local].to(output["advantages"].device)
            if keep is not None:
                assert self.quatro is not None
                with self.ctx.timer(GUARD_PART_QUATRO_FILTERS):
                    self.quatro.mask_dropped_rows(output, keep[start : start + local])
        return kl_factor

    def advantages(self, batch: RewardBatch) -> tuple[torch.Tensor, float | None]:
        """Gathered rewards -> (N,) advantages and GRADE's KL factor of beta (None: leave beta alone); ``keep``
        rows dropped by the filters are unscorable for the reward processor, leave their group and get 0."""
        with self.ctx.timer("grade" if self.parts.reward_processor is not None else "pipeline"):
            scaled = self.pipeline.scale(batch)
            self.ctx.log_metrics(scaled.metrics)
        gepo = self.parts.advantage_fn is not None or self.parts.observe_advantage_fn is not None
        with self.ctx.timer(GUARD_PART_GEPO_ADVANTAGES if gepo else "pipeline"):
            advantages, metrics = self.pipeline.advantages(scaled.rewards, batch.keep, batch.num_generations)
            self.ctx.log_metrics(metrics)
        return advantages, scaled.kl_factor
