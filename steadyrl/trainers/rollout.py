"""Station 1 of a TRL step, rewards -> advantages (``_calculate_rewards``, ``_generate_and_score_completions``,
``_prepare_inputs``). It owns the rollout filters (``guards.quatro.filters``), replay (``guards.quatro.replay``) and
the entropy floor's reward gate (each training batch's mean reward goes to ``StepNotes``), and runs the advantage
pipeline (GRADE, GEPO). Values out: advantages, the mixed micro-batches, GRADE's factor of beta.

Replay needs every row's sampling log-probs (``trl_state.ensure_sampling_logps``: a no-grad forward, so a run with
replay differs from one without from the start); mixed micro-batches carry ``REPLAY_STEP_KEY`` and a recounted
``num_items_in_batch``. Observe mode: the filters log their mask under ``would`` names, every row trains; no replay.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from steadyrl.guards.replay import ReplayBuffer
from steadyrl.guards.rollout_filters import FILTER_REASONS, RolloutFilter, TokenBatch
from steadyrl.metrics import (
    EVENT_FILTER_WARNING,
    GUARD_PART_GEPO_ADVANTAGES,
    GUARD_PART_QUATRO_FILTERS,
    GUARD_PART_QUATRO_MEASURE,
    QUATRO_FILTERED_SHARE,
    quatro_filtered,
    would,
)
from steadyrl.metrics import GUARD_PART_QUATRO_REPLAY as REPLAY
from steadyrl.trainers.advantage_pipeline import AdvantagePipeline, RewardBatch, weighted_rewards
from steadyrl.trainers.context import RuntimeContext, StepNotes, TrainerSettings
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.scratch import HookScratch

logger = logging.getLogger("steadyrl.quatro")
FILTER_WARNING_EVERY = 50  # steps between two logged filter warnings (an event is an fsync'ed line)
# Per-row key of a mixed training micro-batch: the optimizer step a replayed row was sampled at, -1 on fresh rows.
REPLAY_STEP_KEY = "steady_replay_step"
_FILTERED = frozenset({*(quatro_filtered(reason) for reason in FILTER_REASONS), QUATRO_FILTERED_SHARE})


class RolloutStation:
    """Rewards -> advantages for one generation batch. ``rewrites``: steadyrl computes the advantages (else TRL's
    stay); ``pipeline``: GRPO's or PPO's; ``floor``: the step end's entropy floor, whose learning gate reads rewards."""

    def __init__(
        self, ctx: RuntimeContext, parts: GuardParts, pipeline: AdvantagePipeline, scratch: HookScratch,
        notes: StepNotes | None = None, settings: TrainerSettings | None = None, floor: Any = None,
    ) -> None:  # fmt: skip
        self.ctx, self.parts, self.pipeline, self.scratch = ctx, parts, pipeline, scratch
        self.notes = notes if notes is not None else StepNotes()
        q, s = parts.quatro, settings or TrainerSettings(0.0, 0, 0, "")
        self.observe = "quatro" in parts.observe
        self.filter = RolloutFilter(q.filters) if q is not None and q.filters is not None else None
        replay = q is not None and q.replay is not None and q.replay.enabled and not self.observe
        self.replay = ReplayBuffer(q.replay, seed=s.seed + ctx.rank, pad_token_id=s.pad_token_id) if replay else None
        self.gate_column: int | None = None  # the reward column the learning gate reads (gate_reward); None: all
        self.floor = floor if floor is not None and floor.config.learning_gate else None
        gate_reward = q.entropy.gate_reward if q is not None and q.entropy is not None else None
        if gate_reward is not None:
            names = s.reward_names
            if gate_reward not in names:
                raise ValueError(
                    f"guards.quatro.entropy.gate_reward={gate_reward!r} is not one of this trainer's reward functions "
                    f"{list(names)}; name one of them (rewards[].name) or drop gate_reward"
                )
            self.gate_column = names.index(gate_reward) if floor is not None else None
        # per kind of filter warning ("filters", "no_signal"): step of the last one logged, batches over since then
        self._warned_at: dict[str, int] = {}
        self._unwarned: dict[str, int] = {}
        self.rewrites = parts.rewrites_advantages or pipeline.always

    def replay_on(self, training: bool) -> bool:
        return self.replay is not None and training

    def on_rewards(
        self, rewards_per_func: torch.Tensor, prompts: list[Any], completion_ids: list[Any], weights: torch.Tensor,
        training: bool,
    ) -> None:  # fmt: skip
        """After TRL scored a generation batch ((N, num_funcs), gathered): the learning gate reads the rewards; the
        matrix, the gathered prompts and this rank's completion lengths wait for the advantages (``HookScratch``)."""
        if self.floor is not None and training:
            with self.ctx.timer(GUARD_PART_QUATRO_MEASURE):
                self.record_reward(self.gate_rewards(rewards_per_func, weights))
        if not self.rewrites:
            return
        with self.ctx.timer("pipeline"):
            self.scratch.scores = (rewards_per_func, self.ctx.gather_object(list(prompts)))
            if self.filter is not None:
                lengths = [len(ids) for ids in completion_ids]  # this rank's, unpadded
                self.scratch.completion_lengths = torch.tensor(lengths, dtype=torch.long)

    def gate_rewards(self, rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(N, num_funcs) -> (N,): what the learning gate reads, the ``gate_reward`` column, else TRL's weighted sum."""
        if self.gate_column is not None:
            return rewards_per_func[:, self.gate_column]
        return weighted_rewards(rewards_per_func, weights)

    def record_reward(self, rewards: torch.Tensor) -> None:
        """A training batch's gathered rewards ((N,), NaN = unscorable): their mean goes to the learning gate."""
        finite = rewards[torch.isfinite(rewards)]
        if finite.numel():
            self.notes.rewards.append(float(finite.double().mean()))

    def on_scored(
        self, output: dict[str, Any], rows: int, weights: torch.Tensor, num_generations: int, training: bool
    ) -> float | None:
        """After TRL's ``_generate_and_score_completions``: filters, then this rank's ``rows`` of the advantages into
        ``output`` (and the dropped rows' mask). Returns GRADE's KL factor of beta, or None to leave beta alone."""
        if not self.rewrites:
            return None
        assert self.scratch.scores is not None, "_calculate_rewards did not run before advantages"
        (rewards_per_func, prompts), self.scratch.scores = self.scratch.scores, None
        start, local = self.ctx.rank * rows, rows
        keep = None
        with self.ctx.timer("pipeline"):
            completion_lengths, self.scratch.completion_lengths = self.scratch.completion_lengths, None
            if completion_lengths is not None and training:
                with self.ctx.timer(GUARD_PART_QUATRO_FILTERS):
                    rewards = weighted_rewards(rewards_per_func, weights)
                    keep = self.filter_generation(output, rewards, completion_lengths, num_generations)
            batch = RewardBatch(rewards_per_func, prompts, num_generations, weights, keep)
            advantages, kl_factor = self.advantages(batch)
            output["advantages"] = advantages[start : start + local].to(output["advantages"].device)
            if keep is not None:
                with self.ctx.timer(GUARD_PART_QUATRO_FILTERS):
                    self.mask_dropped_rows(output, keep[start : start + local])
        return kl_factor

    def advantages(self, batch: RewardBatch) -> tuple[torch.Tensor, float | None]:
        """Gathered rewards -> (N,) advantages (rows the filters dropped get 0) and GRADE's KL factor of beta."""
        with self.ctx.timer("grade" if self.parts.reward_processor is not None else "pipeline"):
            scaled = self.pipeline.scale(batch)
            self.ctx.log_metrics(scaled.metrics)
        with self.ctx.timer(GUARD_PART_GEPO_ADVANTAGES if self.parts.advantage_fn is not None else "pipeline"):
            advantages, metrics = self.pipeline.advantages(scaled.rewards, batch.keep, batch.num_generations)
            self.ctx.log_metrics(metrics)
        return advantages, scaled.kl_factor

    def filter_generation(
        self, output: dict[str, Any], rewards: torch.Tensor, completion_lengths: torch.Tensor, num_generations: int
    ) -> torch.Tensor | None:
        """The filters over the whole generation batch: (N,) bool keep mask, equal on all ranks (None: observe mode);
        logs ``quatro/filtered/<reason>`` and the warnings. ``rewards``: (N,) weighted, gathered;
        ``completion_lengths``: this rank's rows' (TRL's ``completion_mask`` can be zeroed by truncation)."""
        assert self.filter is not None
        prompts, completions = gather_token_batches(
            self.ctx, output["prompt_ids"], output["prompt_mask"], output["completion_ids"], completion_lengths
        )
        result = self.filter(rewards, prompts, completions, num_generations)
        if self.observe:  # rows each filter would drop and their share; the zero-variance count is a measurement
            self.ctx.log_metrics({would(k) if k in _FILTERED else k: v for k, v in result.metrics().items()})
            if result.warning is not None:
                logger.info("step %d: observe mode (nothing dropped): %s", self.ctx.global_step(), result.warning)
            return None
        self.ctx.log_metrics(result.metrics())
        if result.warning is not None:
            self._warn("filters", result.warning)
        n_rows, share = result.keep.numel(), self.filter.config.max_drop_share
        grouped = rewards.detach().reshape(-1, num_generations)  # the rewards themselves, before any filter
        silent = int((grouped == grouped[:, :1]).all(dim=1).sum()) * num_generations  # NaN: never equal
        if n_rows and silent / n_rows > share:  # not a filter's doing: the reward gives these groups no signal
            self._warn(
                "no_signal",
                f"{silent} of {n_rows} rollouts ({silent / n_rows:.0%} > {share:.0%}) are in groups whose rewards are "
                "all equal: no learning signal (advantage 0, as in plain GRPO). Normal for prompts the policy always "
                "or never solves; if it lasts, check the reward function and the prompts' difficulty",
            )
        return result.keep

    def _warn(self, kind: str, warning: str) -> None:
        """Log and record a filter warning: the first of its kind, then at most one per ``FILTER_WARNING_EVERY``
        steps, counting the batches in between."""
        step = self.ctx.global_step()
        last = self._warned_at.get(kind)
        if last is not None and 0 <= step - last < FILTER_WARNING_EVERY:
            self._unwarned[kind] = self._unwarned.get(kind, 0) + 1
            return
        if self._unwarned.get(kind):
            warning += f" ({self._unwarned[kind]} more batch(es) over the share since step {last})"
        self._warned_at[kind], self._unwarned[kind] = step, 0
        logger.warning("step %d: %s", step, warning)
        self.ctx.emit_event(EVENT_FILTER_WARNING, message=warning)

    def mask_dropped_rows(self, output: dict[str, Any], keep_local: torch.Tensor) -> None:
        """With ``filters.dropped_rows: exclude`` this rank's dropped rows leave the loss (completion mask 0) and
        ``num_items_in_batch`` is recounted without them; the default ``zero_advantage`` changes nothing here (the
        row trains with advantage 0 and still counts in every normaliser; docs/DESIGN.md, "QUATRO: rollout filters")."""
        assert self.filter is not None
        if self.filter.config.dropped_rows != "exclude":
            return
        mask = output["completion_mask"]
        output["completion_mask"] = mask * keep_local.to(device=mask.device, dtype=mask.dtype).unsqueeze(1)
        if "num_items_in_batch" in output:
            old = output["num_items_in_batch"]
            output["num_items_in_batch"] = self.ctx.gather(loss_mask(output).sum()).sum().to(old.dtype)

    def mix(self, micro_batches: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """TRL's fresh micro-batches of one generation -> the same number mixed with replayed rows."""
        assert self.replay is not None
        with self.ctx.timer(REPLAY):
            mixed = [self.replay.mix(batch, step) for batch in micro_batches]
            for batch in micro_batches:
                self.replay.add(batch, step)
            out = []
            for batch, info in mixed:
                rows = batch["completion_ids"].shape[0]
                sampled = torch.full((rows,), -1, dtype=torch.long, device=batch["completion_ids"].device)
                if info.indices:
                    ages = torch.tensor([step - age for age in info.ages], dtype=torch.long)
                    sampled[info.indices] = ages.to(sampled)
                batch[REPLAY_STEP_KEY] = sampled
                out.append(batch)
            if "num_items_in_batch" in micro_batches[0]:  # recount the normaliser over the mixed rows (all ranks)
                local = sum(loss_mask(batch).sum() for batch in out)
                old = micro_batches[0]["num_items_in_batch"]
                total = self.ctx.gather(local).sum().to(dtype=old.dtype, device=old.device)
                for batch in out:
                    batch["num_items_in_batch"] = total
            return out


def gather_token_batches(
    ctx: RuntimeContext, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_lengths: torch.Tensor,
) -> tuple[TokenBatch, TokenBatch]:  # fmt: skip
    """This rank's prompts ((rows, P) ids with their mask, any padding side) and completions ((rows, C) right-padded
    ids with their lengths) -> the whole generation batch's, on the CPU, rows in rank order (``ctx.gather``'s), so
    every rank filters the same rows. Two collectives (the widths, then every row padded to the widest); none on one
    process."""
    if ctx.processes == 1:
        lengths = completion_lengths.to(device="cpu", dtype=torch.long)
        return TokenBatch.from_mask(prompt_ids.cpu(), prompt_mask.cpu()), TokenBatch(completion_ids.cpu(), lengths)
    device = completion_ids.device
    widths = torch.tensor([prompt_ids.shape[1], completion_ids.shape[1]], dtype=torch.long, device=device)
    prompt_width, completion_width = ctx.gather(widths).view(-1, 2).amax(dim=0).tolist()

    def widen(t: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(t.to(device=device, dtype=torch.long), (0, width - t.shape[1]))

    lengths = completion_lengths.to(device=device, dtype=torch.long)[:, None]
    parts = [lengths, widen(prompt_mask, prompt_width), widen(prompt_ids, prompt_width)]
    rows = torch.cat([*parts, widen(completion_ids, completion_width)], dim=1)
    gathered = ctx.gather(rows.reshape(-1)).view(-1, rows.shape[1]).cpu()
    lengths, mask, prompts, completions = gathered.split([1, prompt_width, prompt_width, completion_width], dim=1)
    return TokenBatch.from_mask(prompts, mask), TokenBatch(completions, lengths[:, 0])


def loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss counts: completion mask, times the tool mask when there is one."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if inputs.get("tool_mask") is not None else mask
