"""QUATRO inside a running SteadyGRPOTrainer: when the KL and entropy controllers observe, what they set, where the
rollout filters cut and how rollout replay mixes old rows into training micro-batches.

The pure pieces (``steadyrl.guards.quatro``) know nothing about the Trainer; this module wires them in:

- measurements: after every training micro-batch loss (``SteadyGRPOTrainer._compute_loss``) the runtime records
  TRL's just-logged ``kl`` and ``entropy`` (each already a token mean over all ranks) with the micro-batch's token
  count over all ranks; at the optimizer step's end the step mean is the token-weighted mean of those entries.
  Micro-batches whose every row the filters dropped have no tokens and do not count (TRL logs 0 for them).
- adaptive KL (after each optimizer step): ``AdaptiveKL.observe(step mean KL)``, then
  ``trainer.set_beta_factor("quatro_kl", factor)``. The effective coefficient is
  ``trainer.beta = beta_base x quatro_kl x grade`` (GRADE's KL compensation, when on, is the other factor).
  PPO (a trainer with ``kl_in_reward = True``) has no loss-side KL: its loss runs with beta 0, TRL logs no ``kl``.
  There the KL is measured once per generation batch, where PPO places ``-beta * kl_t`` in the token rewards
  (``record_rollout_kl``: the token mean over all ranks' loss tokens of the rollout), and the controller observes
  *once per generation batch*: at the end of the optimizer step that generated it, the token-weighted mean of the
  rollouts generated during that step (one in the usual layout). Steps that train on an earlier rollout
  (``num_iterations > 1`` or ``steps_per_generation > gradient_accumulation_steps``) bring no new measurement and
  do not observe, so ``update_every`` counts generation batches in PPO, and a rollout's KL is never counted twice.
  The new coefficient applies from the next rollout's reward placement on (like GRPO's, from the next step's loss).
- entropy floor (after each optimizer step): ``EntropyFloor.observe(step mean entropy)``, then TRL's own entropy
  bonus coefficient ``trainer.entropy_coef = floor.bonus`` (TRL's ``_entropy_bonus_enabled`` is switched on at
  bind time, with coefficient 0 the term adds exactly 0) and, for the loss types whose epsilon is PPO's clip range
  (``CLIP_LOSS_TYPES``), ``epsilon_low/high = initial x floor.clip_scale()``. Both apply from the next step on.
- filters (per generation batch, train mode): the gathered weighted rewards and token ids of the whole generation
  batch go through ``RolloutFilter``; ``SteadyGRPOTrainer`` then computes advantages with
  ``masked_group_advantages`` and zeroes the completion mask of this rank's dropped rows.
- replay (per rank, train mode; ``ReplayBuffer`` seeded with ``args.seed + rank``):
  1. sampling log-probs: after every generation batch is scored (``SteadyGRPOTrainer._generate_and_score_completions``)
     ``ensure_sampling_logps`` fills ``old_per_token_logps`` where TRL left it None (TRL computes it only when it
     believes the data is off-policy: ``gradient_accumulation_steps % (steps_per_generation x num_iterations) != 0``,
     or vLLM's importance sampling correction). It is one no-grad forward of the current model over the generation
     batch, TRL's own ``_get_per_token_logps_and_entropies`` with TRL's arguments, before any optimizer step, i.e.
     the log-probs of the policy that sampled the rows. Fresh rows then train with ratio exp(current - these),
     1 up to float rounding on their first pass (TRL's ``per_token_logps.detach()`` gives exactly 1), so a run with
     replay on is not bit-identical to one without it even before anything is replayed.
  2. mixing (``SteadyGRPOTrainer._prepare_inputs``, only on the calls where TRL generated, i.e. once per
     ``steps_per_generation x num_iterations`` micro-steps): every micro-batch TRL just split off is mixed with
     rows of earlier generations (``ReplayBuffer.mix``), then the fresh micro-batches are added to the buffer, so
     a micro-batch never replays rows of its own generation. The mixed micro-batches replace TRL's buffered ones
     (so all ``num_iterations`` passes train on the same mixed rows). ``num_items_in_batch`` (the dapo/cispo/vespo
     normaliser, summed over ranks) is recounted over the mixed rows; every mixed micro-batch carries
     ``REPLAY_STEP_KEY`` (B,): the optimizer step a replayed row was sampled at, -1 on fresh rows.
  3. metrics (each training micro-batch's loss, summed over ranks): ``quatro/replay_frac`` (replayed rows / rows),
     ``quatro/replay_age_mean`` (optimizer steps between sampling and this loss, replayed rows only) and
     ``quatro/replay_ratio_mean`` (token mean of exp(loss log-probs - stored sampling log-probs) over the replayed
     rows' loss tokens: the importance ratio TRL's loss forms for them, before clipping; a token mean also under
     ``importance_sampling_level: sequence``). The last two are left out of the log when nothing was replayed.
  Interplay: whether TRL computes the old log-probs itself (e.g. ``num_iterations > 1`` with one generation per
  optimizer step) or ``ensure_sampling_logps`` does, every row, fresh or replayed, is ratio-corrected against its
  own sampling policy in every pass, so any ``steps_per_generation`` / ``num_iterations`` combination works.
  Replayed rows keep their reference log-probs (the reference never moves, so they stay exact; present when
  beta != 0 at generation) and their advantage (computed within their own group at sampling time). With vLLM's
  importance sampling correction a replayed row also keeps its ``importance_sampling_ratio`` (the vLLM-vs-trainer
  mismatch at its sampling time; TRL multiplies it into the per-token loss, next to the policy-drift ratio
  exp(current - old)) and its ``sampling_per_token_logps``. PPO clipping bounds the ratio of stale rows as usual.
  PPO (``SteadyPPOTrainer``): its GAE runs inside ``_generate_and_score_completions``, before the mixing, so a
  replayed row also keeps its (B, T) token advantages, ``old_values`` and ``returns`` (value clipping around its own
  sampling-time values); rows are ranked by the mean |token advantage| over their loss tokens.

State: the controllers and the filter's length history are identical on every rank and saved with the guard
state of the main process; the replay buffer (rows and generator) is per rank (``rank_state_dict``, saved in the
rank files next to TRL's buffered micro-batches, which keep their ``REPLAY_STEP_KEY``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from steadyrl.guards.quatro import (
    AdaptiveKL,
    EntropyFloor,
    FilterResult,
    QuatroConfig,
    ReplayBuffer,
    RolloutFilter,
    replay_importance_ratio_sum,
)
from steadyrl.metrics import (
    EVENT_ENTROPY_FLOOR_WARNING,
    EVENT_FILTER_WARNING,
    QUATRO_BETA,
    QUATRO_REPLAY_AGE_MEAN,
    QUATRO_REPLAY_FRAC,
    QUATRO_REPLAY_RATIO_MEAN,
)

logger = logging.getLogger("steadyrl.quatro")

# TRL 1.16 ``_compute_loss``: the loss types whose ``epsilon_low/high`` are PPO's clip range (``torch.clamp(coef_1,
# 1 - epsilon_low, 1 + epsilon_high)``); cispo uses epsilon_high as a truncation bound, sapo and vespo not at all.
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# Per-row key of a mixed training micro-batch: the optimizer step a replayed row was sampled at, -1 on fresh rows.
REPLAY_STEP_KEY = "steady_replay_step"


class QuatroRuntime:
    """QUATRO's schedule inside the trainer. Stateful: ``state_dict`` goes to the checkpoint's guard state."""

    def __init__(self, config: QuatroConfig) -> None:
        self.config = config
        self.kl: AdaptiveKL | None = None  # made in bind(): needs the trainer's beta
        self.entropy = EntropyFloor(config.entropy) if config.entropy is not None else None
        self.filter = RolloutFilter(config.filters) if config.filters is not None else None
        self.replay: ReplayBuffer | None = None  # made in bind(): seeded per rank, pads with the tokenizer's id
        self.trainer: Any = None
        self._epsilon0: tuple[float, float] | None = None
        self._entries: list[tuple[float, float, float]] = []  # (kl, entropy, tokens) per micro-batch of this step
        self.kl_from_rollouts = False  # set in bind(): PPO measures the KL at the rollout (it is in the reward)
        self._rollout_kl: list[tuple[float, float]] = []  # (kl, tokens) per generation batch of this step (PPO)

    @property
    def filters_on(self) -> bool:
        return self.filter is not None

    @property
    def replay_on(self) -> bool:
        return self.config.replay is not None and self.config.replay.enabled

    # ------------------------------------------------------------------ setup

    def bind(self, trainer: Any) -> None:
        """Called from the trainer's ``__init__`` (before any resume loads state into the controllers)."""
        self.trainer = trainer
        self.kl_from_rollouts = bool(getattr(trainer, "kl_in_reward", False))
        if self.replay_on:
            tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            seed = int(trainer.args.seed) + trainer.accelerator.process_index
            self.replay = ReplayBuffer(self.config.replay, seed=seed, pad_token_id=pad)
        if self.config.kl is not None:
            self.kl = AdaptiveKL(self.config.kl, trainer.beta_base)  # raises (naming the fix) on beta 0
        if self.entropy is not None:
            if trainer.use_adaptive_entropy:
                raise ValueError(
                    "guards.quatro.entropy and trainer.use_adaptive_entropy both drive TRL's entropy_coef; keep one"
                )
            if trainer.entropy_coef != 0.0:
                logger.warning(
                    "trainer.entropy_coef=%g is replaced by the QUATRO entropy floor's bonus (0 until the floor is "
                    "active)",
                    trainer.entropy_coef,
                )
            trainer._entropy_bonus_enabled = True  # TRL fixes it at init; the floor's bonus needs the term
            if trainer.loss_type in CLIP_LOSS_TYPES:
                self._epsilon0 = (float(trainer.epsilon_low), float(trainer.epsilon_high))
            else:
                logger.warning(
                    "loss_type=%s has no PPO clip range: the entropy floor raises the bonus but cannot lower epsilon",
                    trainer.loss_type,
                )
        self._apply()

    def _apply(self) -> None:
        """Push the controllers' current outputs into the trainer (beta factor, entropy_coef, epsilon)."""
        trainer = self.trainer
        if trainer is None:
            return
        if self.kl is not None:
            trainer.set_beta_factor("quatro_kl", self.kl.factor)
        if self.entropy is not None:
            trainer.entropy_coef = self.entropy.bonus
            if self._epsilon0 is not None:
                scale = self.entropy.clip_scale()
                trainer.epsilon_low, trainer.epsilon_high = (e * scale for e in self._epsilon0)

    # ------------------------------------------------------------------ measurements

    def record_micro_batch(self, inputs: dict[str, Any]) -> None:
        """After a training micro-batch's loss: keep TRL's just-logged KL and entropy with the global token count."""
        trainer = self.trainer
        metrics = trainer._metrics["train"]
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        tokens = float(trainer.accelerator.reduce(mask.sum().float().reshape(1), reduction="sum").item())
        kl = metrics["kl"][-1] if trainer.beta != 0.0 and metrics.get("kl") else math.nan
        entropy = metrics["entropy"][-1] if metrics.get("entropy") else math.nan
        self._entries.append((float(kl), float(entropy), tokens))

    def record_rollout_kl(self, kl_mean: float, tokens: float) -> None:
        """PPO: a training generation batch's mean per-token KL to the reference (token mean over all ranks' loss
        tokens, NaN when it has none) and that token count; observed at the end of this optimizer step."""
        self._rollout_kl.append((float(kl_mean), float(tokens)))

    def _rollout_kl_mean(self) -> float | None:
        """Token-weighted KL of the generation batches of this step; None when the step generated none."""
        rollouts, self._rollout_kl = self._rollout_kl, []
        if not rollouts:
            return None
        pairs = [(v, w) for v, w in rollouts if w > 0 and math.isfinite(v)]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if total > 0 else math.nan

    def _step_means(self) -> tuple[float, float]:
        """Token-weighted KL and entropy of this optimizer step's micro-batches (NaN without tokens)."""
        out = []
        for k in (0, 1):
            pairs = [(e[k], e[2]) for e in self._entries if e[2] > 0 and math.isfinite(e[k])]
            total = sum(w for _, w in pairs)
            out.append(sum(v * w for v, w in pairs) / total if total > 0 else math.nan)
        self._entries = []
        return out[0], out[1]

    # ------------------------------------------------------------------ after each optimizer step

    def on_step_end(self) -> None:
        trainer, step = self.trainer, self.trainer.state.global_step
        kl_mean, entropy_mean = self._step_means()
        metrics: dict[str, float] = {}
        if self.kl is not None:
            if self.kl_from_rollouts:  # PPO: once per generation batch, none on steps that reuse a rollout
                rollout_kl = self._rollout_kl_mean()
                if rollout_kl is not None:
                    self.kl.observe(rollout_kl)
            else:
                self.kl.observe(kl_mean)
            metrics.update(self.kl.metrics())
        if self.entropy is not None:
            warning = self.entropy.observe(entropy_mean)
            if warning is not None:
                logger.warning("step %d: %s", step, warning)
                trainer.emit_event(EVENT_ENTROPY_FLOOR_WARNING, message=warning)
            metrics.update(self.entropy.metrics())
        self._apply()
        if self.kl is not None:
            metrics[QUATRO_BETA] = trainer.beta  # the effective coefficient, every factor included
        for name, value in metrics.items():
            if math.isfinite(value):  # NaN = not measured yet (floor before its baseline): left out of the log
                trainer._guard_metric(name, value)

    # ------------------------------------------------------------------ filters

    def filter_rows(
        self,
        rewards: torch.Tensor,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        num_generations: int,
    ) -> FilterResult:
        """Gathered generation batch -> which rows to keep; logs ``quatro/filtered/<reason>`` and the warning."""
        assert self.filter is not None
        result = self.filter(rewards, prompt_ids, completion_ids, num_generations)
        for name, value in result.metrics().items():
            self.trainer._guard_metric(name, value)
        if result.warning is not None:
            logger.warning("step %d: %s", self.trainer.state.global_step, result.warning)
            self.trainer.emit_event(EVENT_FILTER_WARNING, message=result.warning)
        return result

    # ------------------------------------------------------------------ replay

    def ensure_sampling_logps(self, output: dict[str, Any]) -> None:
        """Give a scored generation batch its sampling policy's ``old_per_token_logps`` where TRL left them out.

        Called right after generation and scoring, before any optimizer step: the current model is the sampling
        policy. The same call TRL makes when it computes them itself (``_generate_and_score_completions``).
        """
        if output.get("old_per_token_logps") is not None:
            return
        from trl.models.utils import disable_gradient_checkpointing

        trainer = self.trainer
        completion_ids = output["completion_ids"]
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
            logps, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model,
                input_ids,
                attention_mask,
                completion_ids.size(1),
                batch_size=trainer.args.per_device_train_batch_size,
            )
        output["old_per_token_logps"] = logps

    def mix_generation(self, micro_batches: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """TRL's fresh micro-batches of one generation -> the same number of mixed ones (see the module docstring)."""
        assert self.replay is not None
        trainer = self.trainer
        mixed = [self.replay.mix(batch, step) for batch in micro_batches]
        for batch in micro_batches:
            self.replay.add(batch, step)
        out = []
        for batch, info in mixed:
            rows = batch["completion_ids"].shape[0]
            sampled = torch.full((rows,), -1, dtype=torch.long, device=batch["completion_ids"].device)
            if info.indices:
                sampled[info.indices] = torch.tensor([step - age for age in info.ages], dtype=torch.long).to(sampled)
            batch[REPLAY_STEP_KEY] = sampled
            out.append(batch)
        if "num_items_in_batch" in micro_batches[0]:  # recount the normaliser over the mixed rows (all ranks)
            local = sum(_loss_mask(batch).sum() for batch in out)
            old = micro_batches[0]["num_items_in_batch"]
            total = trainer.accelerator.gather(local).sum().to(dtype=old.dtype, device=old.device)
            for batch in out:
                batch["num_items_in_batch"] = total
        return out

    def record_replay(self, inputs: dict[str, Any], per_token_logps: torch.Tensor | None) -> None:
        """After a training micro-batch's loss: replay share, age and importance ratio, summed over ranks.

        A collective: every rank calls it for every training micro-batch while replay is on.
        """
        trainer = self.trainer
        mask = _loss_mask(inputs)
        sampled = inputs.get(REPLAY_STEP_KEY)
        if sampled is None:  # a micro-batch mixed before replay was on (e.g. resumed from a run without it)
            sampled = torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)
        rows = sampled >= 0
        ages = float((trainer.state.global_step - sampled[rows]).sum())
        ratio_sum, tokens = 0.0, 0.0
        old = inputs.get("old_per_token_logps")
        if per_token_logps is not None and old is not None:
            ratio_sum, tokens = (float(v) for v in replay_importance_ratio_sum(per_token_logps, old, mask, rows))
        local = [float(rows.sum()), float(rows.numel()), ages, ratio_sum, tokens]
        local_t = torch.tensor(local, dtype=torch.float64, device=trainer.accelerator.device)
        replayed, total, age_sum, ratio_total, ratio_tokens = trainer.accelerator.reduce(local_t, "sum").tolist()
        trainer._guard_metric(QUATRO_REPLAY_FRAC, replayed / total if total > 0 else 0.0)
        if replayed > 0:
            trainer._guard_metric(QUATRO_REPLAY_AGE_MEAN, age_sum / replayed)
        if ratio_tokens > 0:
            trainer._guard_metric(QUATRO_REPLAY_RATIO_MEAN, ratio_total / ratio_tokens)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "kl": self.kl.state_dict() if self.kl is not None else None,
            "entropy": self.entropy.state_dict() if self.entropy is not None else None,
            "filter": self.filter.state_dict() if self.filter is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in ("kl", "entropy", "filter"):
            obj, saved = getattr(self, name), state.get(name)
            if obj is not None and saved is not None:
                obj.load_state_dict(saved)
            elif obj is not None:
                logger.warning("the checkpoint has no QUATRO %s state: it starts fresh", name)
        self._entries = []
        self._rollout_kl = []
        self._apply()

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's replay buffer (each rank replays its own rows)."""
        return {"version": 1, "replay": self.replay.state_dict() if self.replay is not None else None}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("replay")
        if self.replay is not None and saved is not None:
            self.replay.load_state_dict(saved)
        elif self.replay is not None:
            logger.warning("the checkpoint has no QUATRO replay buffer for this rank: it starts empty")


def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss counts: completion mask, times the tool mask when there is one."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if inputs.get("tool_mask") is not None else mask
