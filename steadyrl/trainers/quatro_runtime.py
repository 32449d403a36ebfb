"""QUATRO inside a running trainer: when the KL and entropy controllers observe, what they set, where the rollout
filters cut and how replay mixes old rows into training micro-batches (docs/DESIGN.md, the "QUATRO" sections).

No trainer here: a ``RuntimeContext`` and the settings of ``QuatroSetup``; it *returns* what should change
(``QuatroControls``: the ``quatro_kl`` factor of beta, the entropy coefficient, the clip-range scale), which the
trainer writes through ``trl_state``. The stations call it: ``rollout`` (the floor's reward gate, the filters, replay
mixing), ``loss`` (TRL's kl and entropy per micro-batch, token-weighted; the replay metrics), ``step_end`` (the
controllers observe the step's means). PPO (``kl_from_rollouts``) measures the KL once per generation batch, where
it is placed in the reward, and the controller observes once per generation batch.

Replay needs every row's sampling log-probs: ``trl_state.ensure_sampling_logps`` fills them where TRL left none (a
no-grad forward before any update, so a run with replay is not bit-identical to one without even before anything is
replayed). Mixed micro-batches carry ``REPLAY_STEP_KEY``; ``num_items_in_batch`` is recounted over the mixed rows.

Observe mode: the controllers observe, ``controls()`` is empty and the would-be values are logged under ``would``
names; the filters log their keep mask; replay is inactive. State: controllers and the filter's length history are
equal on every rank (guard state of the main process); the replay buffer is per rank (``rank_state_dict``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.entropy_floor import EntropyFloor
from steadyrl.guards.kl_controller import AdaptiveKL
from steadyrl.guards.quatro import QuatroConfig
from steadyrl.guards.replay import ReplayBuffer, replay_importance_ratio_sum
from steadyrl.guards.rollout_filters import FILTER_REASONS, FilterResult, RolloutFilter, TokenBatch
from steadyrl.metrics import (
    EVENT_ENTROPY_FLOOR_WARNING,
    EVENT_FILTER_WARNING,
    QUATRO_CLIP_SCALE_WOULD,
    QUATRO_ENTROPY_BONUS,
    QUATRO_FILTERED_SHARE,
    QUATRO_FLOOR_ACTIVE,
    QUATRO_KL_COEF,
    QUATRO_KL_FACTOR,
    QUATRO_MOMENT_SCALE,
    QUATRO_REPLAY_AGE_MEAN,
    QUATRO_REPLAY_FRAC,
    QUATRO_REPLAY_RATIO_MEAN,
    quatro_filtered,
    would,
)
from steadyrl.trainers.advantage_pipeline import weighted_rewards
from steadyrl.trainers.context import RuntimeContext

logger = logging.getLogger("steadyrl.quatro")
FILTER_WARNING_EVERY = 50  # steps between two logged filter warnings (an event is an fsync'ed line)

# TRL 1.16 ``_compute_loss``: the loss types whose ``epsilon_low/high`` are PPO's clip range (``torch.clamp(coef_1,
# 1 - epsilon_low, 1 + epsilon_high)``); cispo uses epsilon_high as a truncation bound, sapo and vespo not at all.
CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# Per-row key of a mixed training micro-batch: the optimizer step a replayed row was sampled at, -1 on fresh rows.
REPLAY_STEP_KEY = "steady_replay_step"


@dataclass(frozen=True)
class QuatroSetup:
    """The trainer settings QUATRO reads once, at bind time."""

    beta: float  # the base KL coefficient (trainer.beta before any factor)
    seed: int  # args.seed; the replay buffer is seeded with seed + rank
    pad_token_id: int
    loss_type: str
    entropy_coef: float = 0.0  # TRL's own coefficient, kept: the floor's bonus adds to it
    use_adaptive_entropy: bool = False
    kl_from_rollouts: bool = False  # PPO: the KL is in the reward, measured at the rollout
    reward_names: tuple[str, ...] = ()  # the reward functions' names, in the columns' order (GRPO)


@dataclass(frozen=True)
class QuatroControls:
    """What QUATRO wants in TRL's state; None = leave that part alone."""

    kl_factor: float | None = None  # the ``quatro_kl`` factor of beta
    entropy_coef: float | None = None  # TRL's entropy_coef
    clip_scale: float | None = None  # epsilon_low/high = their initial values x this


class QuatroRuntime:
    """QUATRO's schedule inside the trainer. Stateful: ``state_dict`` goes to the checkpoint's guard state.

    ``observe``: compute and log every decision, change nothing in TRL's state (see the module docstring)."""

    def __init__(self, config: QuatroConfig, observe: bool = False) -> None:
        self.config = config
        self.observe = observe
        self.kl: AdaptiveKL | None = None  # made in bind(): needs the trainer's beta
        self.entropy = EntropyFloor(config.entropy) if config.entropy is not None else None
        self.filter = RolloutFilter(config.filters) if config.filters is not None else None
        self.replay: ReplayBuffer | None = None  # made in bind(): seeded per rank, pads with the tokenizer's id
        self.ctx = RuntimeContext()
        self.scales_clip = False  # set in bind(): the loss type's epsilon is PPO's clip range
        self._moment_factor = 1.0  # brake_moments: this step's factor for Adam's moments (take_moment_factor)
        self._entries: list[tuple[float, float, float]] = []  # (kl, entropy, tokens) per micro-batch of this step
        self.base_entropy_coef = 0.0  # set in bind(): the user's trainer.entropy_coef; the floor's bonus adds to it
        self.kl_from_rollouts = False  # set in bind(): PPO measures the KL at the rollout (it is in the reward)
        self._rollout_kl: list[tuple[float, float]] = []  # (kl, tokens) per generation batch of this step (PPO)
        self._rewards: list[float] = []  # mean training reward per generation batch of this step (the floor's gate)
        self.gate_column: int | None = None  # set in bind(): the reward column the gate reads (gate_reward); None: all
        # per kind of filter warning ("filters", "no_signal"): step of the last one logged, and the batches over
        # the share since then (counted in the next one)
        self._warned_at: dict[str, int] = {}
        self._unwarned: dict[str, int] = {}

    @property
    def filters_on(self) -> bool:
        return self.filter is not None

    @property
    def replay_on(self) -> bool:
        return self.config.replay is not None and self.config.replay.enabled and not self.observe

    # ------------------------------------------------------------------ setup

    def bind(self, ctx: RuntimeContext, setup: QuatroSetup) -> None:
        """Called from the trainer's ``__init__`` (before any resume loads state into the controllers). The trainer
        then switches TRL's entropy bonus on when ``self.entropy`` is set and applies ``controls()``."""
        self.ctx = ctx
        self.kl_from_rollouts = setup.kl_from_rollouts
        if self.observe:
            self._bind_observing(setup)
        if self.replay_on:
            self.replay = ReplayBuffer(self.config.replay, seed=setup.seed + ctx.rank, pad_token_id=setup.pad_token_id)
        if self.config.kl is not None and setup.beta == 0.0:
            # TRL's default: no KL term, no reference model, nothing to anchor. Start where TRL starts.
            logger.info(
                "trainer.beta is 0 (TRL's default): no KL term, so guards.quatro.kl has nothing to control and stays "
                "inactive for this run; set trainer.beta > 0 (e.g. 0.04) to anchor the policy to the reference model"
            )
        elif self.config.kl is not None:
            self.kl = AdaptiveKL(self.config.kl, setup.beta)
        gate_reward = self.entropy.config.gate_reward if self.entropy is not None else None
        if gate_reward is not None:
            if gate_reward not in setup.reward_names:
                raise ValueError(
                    f"guards.quatro.entropy.gate_reward={gate_reward!r} is not one of this trainer's reward functions "
                    f"{list(setup.reward_names)}; name one of them (rewards[].name) or drop gate_reward"
                )
            self.gate_column = setup.reward_names.index(gate_reward)
        if self.entropy is not None and setup.use_adaptive_entropy:
            # The user's explicit TRL setting wins: TRL's controller owns entropy_coef, the floor steps aside.
            logger.warning(
                "trainer.use_adaptive_entropy is on: TRL's adaptive entropy controller drives entropy_coef, so the "
                "QUATRO entropy floor is off for this run (to use the floor instead, set "
                "trainer.use_adaptive_entropy=false)"
            )
            self.entropy, self.gate_column = None, None
        self.base_entropy_coef = setup.entropy_coef
        if self.entropy is not None and not self.observe:
            self.scales_clip = setup.loss_type in CLIP_LOSS_TYPES
            if not self.scales_clip:
                logger.warning(
                    "loss_type=%s has no PPO clip range: the entropy floor raises the bonus but cannot lower epsilon",
                    setup.loss_type,
                )

    def _bind_observing(self, setup: QuatroSetup) -> None:
        self.scales_clip = self.entropy is not None and setup.loss_type in CLIP_LOSS_TYPES  # the would-be scale
        parts = [n for n in ("kl", "entropy", "filters") if getattr(self.config, n) is not None]
        logger.info(
            "QUATRO observe mode (%s): decisions are computed and logged, TRL's beta=%g, entropy_coef=%g and "
            "epsilon stay unchanged and every row trains",
            ", ".join(parts) or "nothing enabled", setup.beta, setup.entropy_coef,
        )  # fmt: skip
        if self.config.replay is not None and self.config.replay.enabled:
            logger.info(
                "guards.quatro.replay is inactive in observe mode: no sampling log-probs, no mixing (replayed rows "
                "would change training)"
            )

    def controls(self) -> QuatroControls:
        """What the trainer writes into TRL: the controllers' outputs in act mode, nothing in observe mode."""
        return QuatroControls() if self.observe else self.would_controls()

    def would_controls(self) -> QuatroControls:
        """The controllers' current outputs (beta factor, entropy coefficient, clip scale), applied or not."""
        return QuatroControls(
            kl_factor=self.kl.factor if self.kl is not None else None,
            entropy_coef=self.base_entropy_coef + self.entropy.bonus if self.entropy is not None else None,
            clip_scale=self.entropy.clip_scale() if self.entropy is not None and self.scales_clip else None,
        )

    # ------------------------------------------------------------------ measurements

    def record_micro_batch(self, inputs: dict[str, Any], kl: float, entropy: float) -> None:
        """After a training micro-batch's loss: keep TRL's just-logged KL and entropy (NaN: not logged) with the
        global token count."""
        tokens = float(self.ctx.reduce_sum(loss_mask(inputs).sum().float().reshape(1)).item())
        self._entries.append((float(kl), float(entropy), tokens))

    @property
    def wants_rewards(self) -> bool:
        """Whether the entropy floor's learning gate reads the training rewards (``record_reward``)."""
        return self.entropy is not None and self.entropy.config.learning_gate

    def gate_rewards(self, rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(N, num_funcs) -> (N,): what the learning gate reads, the ``gate_reward`` column when one is named, else
        TRL's weighted sum."""
        if self.gate_column is not None:
            return rewards_per_func[:, self.gate_column]
        return weighted_rewards(rewards_per_func, weights)

    def record_reward(self, rewards: torch.Tensor) -> None:
        """A training generation batch's rewards, gathered over ranks ((N,), NaN = unscorable): their mean goes to
        the entropy floor's learning gate at the end of this optimizer step."""
        finite = rewards[torch.isfinite(rewards)]
        if finite.numel():
            self._rewards.append(float(finite.double().mean()))

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

    def on_step_end(self) -> tuple[QuatroControls, dict[str, float]]:
        """After each optimizer step: the controllers observe the step's means. Returns the new controls and the
        metrics to log (NaN = not measured yet, e.g. the floor before its baseline: the trainer leaves them out)."""
        step = self.ctx.global_step()
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
            rewards, self._rewards = self._rewards, []
            warning = self.entropy.observe(entropy_mean, sum(rewards) / len(rewards) if rewards else math.nan)
            if warning is not None and self.observe:  # nothing was applied: the bonus cannot have failed
                logger.info("step %d: observe mode: entropy floor would be active and the entropy fell", step)
            elif warning is not None:
                logger.warning("step %d: %s", step, warning)
                self.ctx.emit_event(EVENT_ENTROPY_FLOOR_WARNING, message=warning)
            self._moment_factor = self.entropy.moment_rescale()
            metrics.update(self.entropy.metrics())
        if self.observe:
            metrics = self._would_metrics(metrics)
        return self.controls(), metrics

    def take_moment_factor(self) -> float:
        """The factor this step's ``brake_moments`` puts on Adam's ``exp_avg`` (squared on ``exp_avg_sq``), for the
        trainer to apply before the next update; 1.0 when off, unchanged, or observing. Reading it clears it."""
        factor, self._moment_factor = self._moment_factor, 1.0
        return 1.0 if self.observe else factor

    def _would_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Observe mode: the values QUATRO would set under their ``would`` names; measurements keep theirs."""
        out = {would(k) if k in _DECISIONS else k: v for k, v in metrics.items() if k != QUATRO_KL_FACTOR}
        if self.entropy is not None:
            clip_scale = self.would_controls().clip_scale
            out[QUATRO_CLIP_SCALE_WOULD] = clip_scale if clip_scale is not None else 1.0
        return out

    # ------------------------------------------------------------------ filters

    def filter_rows(
        self,
        rewards: torch.Tensor,
        prompt_ids: TokenBatch | Sequence[Sequence[int]],
        completion_ids: TokenBatch | Sequence[Sequence[int]],
        num_generations: int,
    ) -> FilterResult:
        """Gathered generation batch -> which rows to keep; logs ``quatro/filtered/<reason>`` and the warning."""
        assert self.filter is not None
        result = self.filter(rewards, prompt_ids, completion_ids, num_generations)
        if self.observe:
            self.ctx.log_metrics(_would_filter_metrics(result))
            if result.warning is not None:
                logger.info("step %d: observe mode (nothing dropped): %s", self.ctx.global_step(), result.warning)
            return result
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
        return result

    def _warn(self, kind: str, warning: str) -> None:
        """Log and record a filter warning: the first of its kind, then at most one per ``FILTER_WARNING_EVERY``
        steps with the count of the batches in between that were over the share too (each step's counts are in the
        metrics)."""
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

    def filter_generation(
        self, output: dict[str, Any], rewards: torch.Tensor, completion_lengths: torch.Tensor, num_generations: int
    ) -> torch.Tensor | None:
        """QUATRO's rollout filters over the whole generation batch: (N,) bool keep mask, identical on all ranks;
        None in observe mode (the mask was computed and logged; every row trains).

        ``output``: TRL's scored batch of this rank (its padded prompt ids and mask, its right-padded completion
        ids); ``rewards``: (N,) weighted rewards, gathered; ``completion_lengths``: (rows,) this rank's completion
        lengths, so that row i's completion is ``output["completion_ids"][i, :completion_lengths[i]]`` (TRL's
        unpadded ids: its ``completion_mask`` can be zeroed by ``mask_truncated_completions``). The ids are gathered
        here, as tensors (``gather_token_batches``).
        """
        prompts, completions = gather_token_batches(
            self.ctx, output["prompt_ids"], output["prompt_mask"], output["completion_ids"], completion_lengths
        )
        keep = self.filter_rows(rewards, prompts, completions, num_generations).keep
        return None if self.observe else keep

    def mask_dropped_rows(self, output: dict[str, Any], keep_local: torch.Tensor) -> None:
        """With ``filters.dropped_rows: exclude``, dropped rows of this rank leave the loss: completion mask 0
        (advantage is already 0). With the default ``zero_advantage`` nothing changes here: a dropped row trains
        with advantage 0 (only the KL term and the entropy bonus see it) and still counts in every normaliser, so
        the kept rows get exactly the weight they get without filters and filtering does not shift their
        effective learning rate (nor the gradient norm the spike guard watches).

        Under ``exclude``:

        ``num_items_in_batch`` (TRL: the generation batch's loss tokens over all ranks, the normaliser of
        dapo/cispo/vespo) is recounted without them. The other loss types normalise per micro-batch: bnpo by the
        micro-batch's mask sum (dropped rows leave it), grpo/sapo by a per-row mean averaged over all B rows (a
        dropped row still counts as a row with loss 0, like a zero-advantage row), dr_grpo by the constant
        B x max_completion_length (unchanged).
        """
        assert self.filter is not None
        if self.filter.config.dropped_rows != "exclude":
            return
        mask = output["completion_mask"]
        output["completion_mask"] = mask * keep_local.to(device=mask.device, dtype=mask.dtype).unsqueeze(1)
        if "num_items_in_batch" in output:
            old = output["num_items_in_batch"]
            output["num_items_in_batch"] = self.ctx.gather(loss_mask(output).sum()).sum().to(old.dtype)

    # ------------------------------------------------------------------ replay

    def mix_generation(self, micro_batches: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
        """TRL's fresh micro-batches of one generation -> the same number of mixed ones (see the module docstring)."""
        assert self.replay is not None
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
            local = sum(loss_mask(batch).sum() for batch in out)
            old = micro_batches[0]["num_items_in_batch"]
            total = self.ctx.gather(local).sum().to(dtype=old.dtype, device=old.device)
            for batch in out:
                batch["num_items_in_batch"] = total
        return out

    def record_replay(self, inputs: dict[str, Any], per_token_logps: torch.Tensor | None) -> None:
        """After a training micro-batch's loss: replay share, age and importance ratio, summed over ranks.

        A collective: every rank calls it for every training micro-batch while replay is on.
        """
        mask = loss_mask(inputs)
        sampled = inputs.get(REPLAY_STEP_KEY)
        if sampled is None:  # a micro-batch mixed before replay was on (e.g. resumed from a run without it)
            sampled = torch.full((mask.shape[0],), -1, dtype=torch.long, device=mask.device)
        rows = sampled >= 0
        ages = float((self.ctx.global_step() - sampled[rows]).sum())
        ratio_sum, tokens = 0.0, 0.0
        old = inputs.get("old_per_token_logps")
        if per_token_logps is not None and old is not None:
            ratio_sum, tokens = (float(v) for v in replay_importance_ratio_sum(per_token_logps, old, mask, rows))
        local = [float(rows.sum()), float(rows.numel()), ages, ratio_sum, tokens]
        local_t = torch.tensor(local, dtype=torch.float64, device=self.ctx.device)
        replayed, total, age_sum, ratio_total, ratio_tokens = self.ctx.reduce_sum(local_t).tolist()
        self.ctx.log_metric(QUATRO_REPLAY_FRAC, replayed / total if total > 0 else 0.0)
        if replayed > 0:
            self.ctx.log_metric(QUATRO_REPLAY_AGE_MEAN, age_sum / replayed)
        if ratio_tokens > 0:
            self.ctx.log_metric(QUATRO_REPLAY_RATIO_MEAN, ratio_total / ratio_tokens)

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

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's replay buffer (each rank replays its own rows)."""
        return {"version": 1, "replay": self.replay.state_dict() if self.replay is not None else None}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("replay")
        if self.replay is not None and saved is not None:
            self.replay.load_state_dict(saved)
        elif self.replay is not None:
            logger.warning("the checkpoint has no QUATRO replay buffer for this rank: it starts empty")


def gather_token_batches(
    ctx: RuntimeContext,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_lengths: torch.Tensor,
) -> tuple[TokenBatch, TokenBatch]:
    """This rank's prompts ((rows, P) ids with their mask, any padding side) and completions ((rows, C) right-padded
    ids with their lengths) -> the whole generation batch's, on the CPU, rows in rank order (``ctx.gather``'s, the
    order of the gathered rewards), so every rank filters the same rows.

    Two collectives, no Python lists: the ranks' widths, then one flat tensor of every rank's rows padded to the
    widest ([completion length, prompt mask, prompt ids, completion ids] per row). On one process, none: the rows
    are this rank's, as they are.
    """
    if ctx.processes == 1:
        lengths = completion_lengths.to(device="cpu", dtype=torch.long)
        return TokenBatch.from_mask(prompt_ids.cpu(), prompt_mask.cpu()), TokenBatch(completion_ids.cpu(), lengths)
    device = completion_ids.device
    widths = torch.tensor([prompt_ids.shape[1], completion_ids.shape[1]], dtype=torch.long, device=device)
    prompt_width, completion_width = ctx.gather(widths).view(-1, 2).amax(dim=0).tolist()

    def widen(t: torch.Tensor, width: int) -> torch.Tensor:
        return torch.nn.functional.pad(t.to(device=device, dtype=torch.long), (0, width - t.shape[1]))

    rows = torch.cat(
        [
            completion_lengths.to(device=device, dtype=torch.long)[:, None],
            widen(prompt_mask, prompt_width),
            widen(prompt_ids, prompt_width),
            widen(completion_ids, completion_width),
        ],
        dim=1,
    )
    gathered = ctx.gather(rows.reshape(-1)).view(-1, rows.shape[1]).cpu()
    lengths, mask, prompts, completions = gathered.split([1, prompt_width, prompt_width, completion_width], dim=1)
    return TokenBatch.from_mask(prompts, mask), TokenBatch(completions, lengths[:, 0])


def _would_filter_metrics(result: FilterResult) -> dict[str, float]:
    """A filter result under observe mode's names: rows each filter would drop, and their share (the count of
    zero-variance groups is a measurement and keeps its name)."""
    return {would(k) if k in _FILTERED else k: v for k, v in result.metrics().items()}


# what QUATRO sets (observe mode logs them under their ``would`` names); the other metrics are measurements
_DECISIONS = frozenset({QUATRO_KL_COEF, QUATRO_ENTROPY_BONUS, QUATRO_FLOOR_ACTIVE, QUATRO_MOMENT_SCALE})
_FILTERED = frozenset({*(quatro_filtered(reason) for reason in FILTER_REASONS), QUATRO_FILTERED_SHARE})


def loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss counts: completion mask, times the tool mask when there is one."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if inputs.get("tool_mask") is not None else mask
