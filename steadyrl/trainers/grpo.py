"""SteadyGRPOTrainer: ``trl.GRPOTrainer`` with four extension points and state that survives resume.

With no reward processor, no advantage function and no step guard it *is* ``trl.GRPOTrainer``: every hook
calls the parent and returns its result untouched (tested: identical rewards and weights).

The hooked TRL methods are listed in ``steadyrl.trainers.hooks``; none of their bodies is copied here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import time
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.base import (
    AdvantageFunction,
    RewardProcessor,
    StepDecision,
    StepGuard,
    combine_decisions,
)
from steadyrl.guards.quatro import masked_group_advantages
from steadyrl.metrics import (
    EVENT_SKIP,
    GEPO_ADV_MAX_ABS,
    GEPO_ADV_STD,
    GEPO_NONFINITE_LOGPROBS,
    GEPO_NONFINITE_LOSS,
    GEPO_NONFINITE_RATIOS,
    GEPO_NONFINITE_REWARDS,
    GEPO_SKIPPED_STEPS,
    GRADE_BETA,
    GRADE_KL_FACTOR,
    GUARD_SECONDS,
    gepo_skipped,
)
from steadyrl.trainers.opefo_runtime import OpefoRuntime
from steadyrl.trainers.quatro_runtime import QuatroRuntime

logger = logging.getLogger(__name__)

GUARD_STATE_FILE = "steadyrl_state.pt"
RANK_STATE_FILE = "steadyrl_rank{rank}.pt"
COMPLETE_MARKER = "steadyrl_complete.json"
STAGING_DIR = ".staging"


class SteadyGRPOTrainer(GRPOTrainer):
    """GRPO with pluggable reward processing, advantages and optimizer-step guards.

    Extra keyword arguments (all optional; the guard layers fill them in):
        reward_processor: raw rewards of the whole generation batch -> scaled rewards (``RewardProcessor``).
        advantage_fn: grouped rewards (num_prompts, G) -> advantages (``AdvantageFunction``). Default when only
            a reward processor is set: TRL's own group normalisation with ``args.scale_rewards``.
        step_guards: objects with ``decide(grad_norm, step)`` / ``on_skip(...)`` (``StepGuard``), asked before
            every optimizer step with the global pre-clip gradient norm.
        stateful: extra named objects with ``state_dict``/``load_state_dict`` saved in every checkpoint.
        logprob_min: clamp every per-token log-prob (policy, old and reference) at this floor (seed 000 §6.1:
            -100); None leaves TRL's values untouched.
        finite_checks: count non-finite log-probs, importance ratios and losses per step (``gepo/nonfinite_*``).
        opefo: the OPEFO optimizer layer (``OpefoRuntime``): error feedback of skipped gradients, second-moment
            floor, snapshots and automatic rollback. Needs at least one step guard (the skip it feeds back).
        kl_compensation: (lo, hi): multiply the KL coefficient by the reward processor's ``kl_compensation(lo,
            hi)`` (GRADE: raw_std / scaled_std) after every generation batch, so the KL term keeps its weight
            relative to the rescaled rewards. ``beta_factors`` holds every factor; ``beta`` is their product
            times ``beta_base``.
        quatro: the QUATRO loop layer (``QuatroRuntime``): adaptive KL coefficient (the ``quatro_kl`` factor of
            ``beta``), entropy floor (TRL's entropy bonus and clip range), rollout quality filters (dropped rows get
            zero advantage and a zero completion mask), rollout replay (each generation's micro-batches mixed with
            earlier rows that keep their sampling log-probs; the buffer is per rank, in the rank files).
    """

    def __init__(
        self,
        *args: Any,
        reward_processor: RewardProcessor | None = None,
        advantage_fn: AdvantageFunction | None = None,
        step_guards: list[StepGuard] | None = None,
        stateful: dict[str, Any] | None = None,
        logprob_min: float | None = None,
        finite_checks: bool = False,
        kl_compensation: tuple[float, float] | None = None,
        opefo: OpefoRuntime | None = None,
        quatro: QuatroRuntime | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.reward_processor = reward_processor
        self.advantage_fn = advantage_fn
        self.step_guards = list(step_guards or [])
        self.stateful: dict[str, Any] = dict(stateful or {})
        for name, obj in (("reward_processor", reward_processor), ("advantage_fn", advantage_fn)):
            if obj is not None and hasattr(obj, "state_dict"):
                self.stateful.setdefault(name, obj)
        for i, guard in enumerate(self.step_guards):
            if hasattr(guard, "state_dict"):
                self.stateful.setdefault(f"step_guard_{i}", guard)
        self._steady_scores: tuple[torch.Tensor, list[Any]] | None = None
        self.steady_counters: dict[str, float] = defaultdict(float)
        self.logprob_min = logprob_min
        self.finite_checks = finite_checks
        self._steady_loss_inputs: dict[str, Any] | None = None
        if kl_compensation is not None and (reward_processor is None or self.beta == 0.0):
            raise ValueError("kl_compensation needs a reward processor with kl_compensation() and beta > 0")
        self.kl_compensation = kl_compensation
        self.beta_base = self.beta
        self.beta_factors: dict[str, float] = {}
        self.guard_seconds = 0.0
        self.opefo = opefo
        self.rank_stateful: dict[str, Any] = {}
        if opefo is not None:
            self.stateful.setdefault("opefo", opefo)
            self.rank_stateful["opefo"] = opefo
        self.quatro = quatro
        self._quatro_completion_ids: list[Any] | None = None
        self._steady_loss_logps: torch.Tensor | None = None
        if quatro is not None:
            quatro.bind(self)
            self.stateful.setdefault("quatro", quatro)
            if quatro.replay_on:
                self.rank_stateful["quatro"] = quatro
        self._steady_staging: Path | None = None
        # First in line: guards act on a finished step before any other callback (logging, user code) sees it.
        self.callback_handler.callbacks.insert(0, _GuardClock(self))

    def emit_event(self, kind: str, step: int | None = None, **fields: Any) -> None:
        """A discrete event (skip, rollback, ...) for callbacks that record them (``MetricsLog.event``).

        ``step``: the optimizer step it belongs to, numbered like the log rows (the step that ends with
        ``global_step == step``); default ``global_step``.
        """
        for callback in self.callback_handler.callbacks:
            if callable(getattr(callback, "event", None)):
                callback.event(self.state.global_step if step is None else step, kind, **fields)

    @contextlib.contextmanager
    def guard_timer(self) -> Iterator[None]:
        """Adds the wall time of the block to ``guard_seconds`` (the overhead figure of bench_overhead.py)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.guard_seconds += time.perf_counter() - start

    def set_beta_factor(self, name: str, value: float) -> None:
        """One multiplicative factor of the KL coefficient (GRADE compensation, QUATRO's controller, ...)."""
        self.beta_factors[name] = value
        self.beta = self.beta_base * math.prod(self.beta_factors.values())

    # ------------------------------------------------------------------ 1+2: rewards -> advantages

    def _rewrites_advantages(self) -> bool:
        filters = self.quatro is not None and self.quatro.filters_on
        return self.reward_processor is not None or self.advantage_fn is not None or filters

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._rewrites_advantages():
            # rewards_per_func is already gathered over processes; gather the prompts to match its rows.
            with self.guard_timer():
                self._steady_scores = (rewards_per_func, gather_object(list(prompts)))
                if self.quatro is not None and self.quatro.filters_on:
                    self._quatro_completion_ids = [list(ids) for ids in completion_ids_list]  # unpadded, this rank
        return rewards_per_func

    def _replay_on(self) -> bool:
        return self.quatro is not None and self.quatro.replay_on and self.model.training

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self._replay_on() or self._buffered_inputs is buffered:
            return inputs  # no replay, or TRL served a micro-batch it had buffered (already mixed)
        # TRL just generated and split a generation batch: mix each of its micro-batches with replayed rows.
        fresh = self._buffered_inputs
        with self.guard_timer():
            self._buffered_inputs = self.quatro.mix_generation(fresh, self.state.global_step)
        return self._buffered_inputs[next(i for i, batch in enumerate(fresh) if batch is inputs)]

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._replay_on():
            with self.guard_timer():
                self.quatro.ensure_sampling_logps(output)  # replayed rows need their sampling policy's log-probs
        if not self._rewrites_advantages():
            return output
        assert self._steady_scores is not None, "_calculate_rewards did not run before advantages"
        rewards_per_func, prompts = self._steady_scores
        self._steady_scores = None
        mode = "train" if self.model.training else "eval"
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        local = len(inputs)
        start = self.accelerator.process_index * local
        keep = None
        with self.guard_timer():
            completion_ids, self._quatro_completion_ids = self._quatro_completion_ids, None
            if completion_ids is not None and mode == "train":
                keep = self._filter_rows(output, rewards_per_func, completion_ids, num_generations)
            advantages = self.compute_advantages(rewards_per_func, prompts, num_generations, keep=keep)
            output["advantages"] = advantages[start : start + local].to(output["advantages"].device)
            if keep is not None:
                self._mask_dropped_rows(output, keep[start : start + local])
        return output

    def _filter_rows(
        self, output: dict[str, Any], rewards_per_func: torch.Tensor, completion_ids: list[Any], num_generations: int
    ) -> torch.Tensor:
        """QUATRO's rollout filters over the whole generation batch: (N,) bool keep mask, identical on all ranks."""
        rows = zip(output["prompt_ids"], output["prompt_mask"], strict=True)
        prompt_ids = [row[mask.bool()].tolist() for row, mask in rows]
        prompts, completions = gather_object(prompt_ids), gather_object(completion_ids)
        rewards = self._weighted_rewards(rewards_per_func)
        return self.quatro.filter_rows(rewards, prompts, completions, num_generations).keep

    def _mask_dropped_rows(self, output: dict[str, Any], keep_local: torch.Tensor) -> None:
        """Dropped rows of this rank leave the loss: completion mask 0 (advantage is already 0).

        ``num_items_in_batch`` (TRL: the generation batch's loss tokens over all ranks, the normaliser of
        dapo/cispo/vespo) is recounted without them. The other loss types normalise per micro-batch: bnpo by the
        micro-batch's mask sum (dropped rows leave it), grpo/sapo by a per-row mean averaged over all B rows (a
        dropped row still counts as a row with loss 0, like a zero-advantage row), dr_grpo by the constant
        B x max_completion_length (unchanged).
        """
        mask = output["completion_mask"]
        output["completion_mask"] = mask * keep_local.to(device=mask.device, dtype=mask.dtype).unsqueeze(1)
        if "num_items_in_batch" in output:
            loss_mask = output["completion_mask"]
            if output.get("tool_mask") is not None:
                loss_mask = loss_mask * output["tool_mask"]
            old = output["num_items_in_batch"]
            output["num_items_in_batch"] = self.accelerator.gather(loss_mask.sum()).sum().to(old.dtype)

    def _weighted_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """(N, num_funcs) -> (N,): TRL's weighted sum (``sum_then_normalize``); NaN where every function is NaN.

        inf is as unscorable as NaN: TRL would let one inf zero its whole group's advantages.
        """
        nonfinite = ~torch.isfinite(rewards_per_func) & ~torch.isnan(rewards_per_func)
        if nonfinite.any():
            rewards_per_func = rewards_per_func.masked_fill(nonfinite, torch.nan)
        weights = self.reward_weights.to(rewards_per_func.device)
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        return rewards

    def scaled_rewards(
        self, rewards_per_func: torch.Tensor, prompts: list[Any], num_generations: int, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """Gathered rewards (N, num_funcs) -> (N,): weighted sum, filtered rows NaN, then the reward processor
        (GRADE, with its KL compensation factor of ``beta``). NaN marks unscorable rows."""
        self._guard_metric(GEPO_NONFINITE_REWARDS, float((~torch.isfinite(rewards_per_func)).sum()))
        rewards = self._weighted_rewards(rewards_per_func)
        if keep is not None:
            rewards = rewards.masked_fill(~keep.to(rewards.device), torch.nan)
        if self.reward_processor is not None:
            rewards = self.reward_processor(rewards, prompts, num_generations)
            for name, value in getattr(self.reward_processor, "metrics", dict)().items():
                self._guard_metric(name, value)
            if self.kl_compensation is not None:
                factor = self.reward_processor.kl_compensation(*self.kl_compensation)
                self.set_beta_factor("grade", factor)
                self._guard_metric(GRADE_KL_FACTOR, factor)
                self._guard_metric(GRADE_BETA, self.beta)
        return rewards

    def compute_advantages(
        self, rewards_per_func: torch.Tensor, prompts: list[Any], num_generations: int, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gathered rewards (N, num_funcs) -> advantages (N,), through the reward processor and advantage fn.

        ``keep`` (N,) bool, from QUATRO's rollout filters: dropped rows are NaN (unscorable) for the reward
        processor, leave their group's statistics and get advantage 0 (``masked_group_advantages``).
        """
        rewards = self.scaled_rewards(rewards_per_func, prompts, num_generations, keep)
        advantage_fn = self.advantage_fn or partial(group_normalized_advantages, scale_rewards=self.scale_rewards)
        if keep is None:
            advantages = advantage_fn(rewards.view(-1, num_generations)).reshape(-1)
        else:
            advantages = masked_group_advantages(rewards, keep, num_generations, advantage_fn)
        self._guard_metric(GEPO_ADV_STD, float(advantages.std()) if advantages.numel() > 1 else 0.0)
        self._guard_metric(GEPO_ADV_MAX_ABS, float(advantages.abs().max()))
        return advantages

    def _guard_metric(self, name: str, value: float) -> None:
        """Averaged over the logging interval and logged with TRL's own metrics (report_to sees them)."""
        self._metrics["train" if self.model.training else "eval"][name].append(value)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self.finite_checks:
            self._guard_metric(GEPO_NONFINITE_LOGPROBS, float((~torch.isfinite(logps)).sum()))
        if self.logprob_min is not None:
            logps = logps.clamp(min=self.logprob_min)  # -inf -> floor; NaN stays NaN and is caught at the step
        inputs = self._steady_loss_inputs
        if inputs is not None:  # the policy log-probs of a loss computation: the ratios it will form
            self._steady_loss_inputs = None
            self._steady_loss_logps = logps.detach()  # for QUATRO's replay ratio metric
            if self.finite_checks:
                old = inputs.get("old_per_token_logps")
                log_ratio = logps.detach() - (logps.detach() if old is None else old)
                bad = ~torch.isfinite(torch.exp(log_ratio)) & inputs["completion_mask"].bool()
                self._guard_metric(GEPO_NONFINITE_RATIOS, float(bad.sum()))
        return logps, entropies, aux_loss

    def _compute_loss(self, model, inputs):
        if not self.finite_checks and self.quatro is None:
            return super()._compute_loss(model, inputs)
        replay = self._replay_on()
        self._steady_loss_inputs = inputs if self.finite_checks or replay else None
        self._steady_loss_logps = None
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._steady_loss_inputs = None
        logps, self._steady_loss_logps = self._steady_loss_logps, None
        if self.quatro is not None and self.model.training:
            self.quatro.record_micro_batch(inputs)  # TRL's kl / entropy of this micro-batch, for the controllers
            if replay:
                self.quatro.record_replay(inputs, logps)  # replay share, age and importance ratio
        if not self.finite_checks:
            return loss
        # A non-finite loss makes the gradient, hence the global norm, non-finite: the step guard skips that step.
        finite = bool(torch.isfinite(loss.detach()))
        self._guard_metric(GEPO_NONFINITE_LOSS, float(not finite))
        if not finite and self.opefo is not None:
            self.opefo.on_nonfinite_loss()
        return loss

    # ------------------------------------------------------------------ 3: optimizer-step decision

    def _clip_grad_norm(self, model):
        if not self.step_guards or self.is_deepspeed_enabled:
            # Under DeepSpeed the step already happened inside ``accelerator.backward`` and was decided by the
            # hook on the ZeRO optimizer (``install_deepspeed_step_hook``); this returns the engine's norm.
            return super()._clip_grad_norm(model)
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        # Gradients are already reduced across processes here (DDP all-reduce at the sync step), so the
        # local norm is the global norm and every rank takes the same decision.
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
        with self.guard_timer():
            decision = self._decide_optimizer_step(norm, grads)
        if decision.skip:
            model.zero_grad(set_to_none=True)  # with every .grad None, optimizer.step() changes nothing
        else:
            if self.opefo is not None:
                with self.guard_timer():
                    if self.opefo.feed_back(grads):  # error feedback changed the gradients: norm them again
                        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
            if self.args.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, norm)
        if getattr(self.optimizer, "scaler", None) is None and hasattr(self.optimizer, "_is_overflow"):
            # Tell the Trainer the step was skipped so it does not advance the LR schedule, exactly as it does
            # for an fp16 overflow and for a step DeepSpeed skipped (see ``install_deepspeed_step_hook``).
            self.optimizer._is_overflow = decision.skip
        return norm

    def _decide_optimizer_step(self, norm: torch.Tensor, gradients: list[torch.Tensor | None]) -> StepDecision:
        """Ask every step guard about the global pre-clip norm; on a veto, hand them the gradients and count it.

        ``gradients`` are this rank's: all gradients under one process or DDP (already all-reduced), this
        rank's gradient partition under DeepSpeed ZeRO-1/2. Dropping them is the caller's job.
        """
        step = self.state.global_step
        decision = combine_decisions([guard.decide(norm, step) for guard in self.step_guards])
        if decision.skip:
            for guard in self.step_guards:
                guard.on_skip(gradients, decision, step)
            if self.opefo is not None:
                self.opefo.on_skip(gradients)
            self.steady_counters["skipped_steps"] += 1
            # numbered like the log rows: the step being decided ends with global_step == step + 1
            self.emit_event(EVENT_SKIP, step=step + 1, reason=decision.reason, grad_norm=float(norm))
            for reason in decision.reason.split(","):
                self.steady_counters[f"skipped_{reason}"] += 1
            logger.warning(
                "step %d: optimizer step skipped (%s, grad norm %.4g)", step + 1, decision.reason, float(norm)
            )
        self._guard_metric(GEPO_SKIPPED_STEPS, self.steady_counters["skipped_steps"])
        for key, value in self.steady_counters.items():
            if key.startswith("skipped_") and key != "skipped_steps":  # per reason: skipped_spike, ...
                self._guard_metric(gepo_skipped(key.removeprefix("skipped_")), value)
        return decision

    def install_deepspeed_step_hook(self) -> None:
        """Put the step guards inside DeepSpeed's ZeRO-1/2 optimizer step (called once the engine exists).

        Under DeepSpeed the optimizer step runs inside ``accelerator.backward`` -> ``engine.step()``, so the
        Trainer's ``_clip_grad_norm`` comes too late. ``DeepSpeedZeroOptimizer.step`` first computes the global
        gradient norm (``scaled_global_norm``: all-reduced over the data-parallel group, so identical on every
        rank) and then calls ``_update_scale(overflow)``; when ``overflow`` is set after that call it drops the
        gradients and returns without touching weights or moments. The hook decides on the first call and
        raises ``overflow`` in the second. DeepSpeed's own overflow check (fp16 or ``check_grad_overflow``)
        may skip a step before any norm is computed; the guards then see a NaN norm, so counts stay right.
        Accelerate reports the skip (``optimizer.overflow``), and the Trainer then leaves the LR schedule alone.
        """
        if not self.step_guards or not self.is_deepspeed_enabled or getattr(self, "_ds_hook_installed", False):
            return
        zero = self.optimizer
        while not hasattr(zero, "scaled_global_norm") and getattr(zero, "optimizer", None) is not None:
            zero = zero.optimizer
        if not (hasattr(zero, "scaled_global_norm") and hasattr(zero, "_update_scale")):
            raise RuntimeError(
                f"guards.gepo.spike under DeepSpeed hooks the ZeRO stage 1/2 optimizer, but the engine uses "
                f"{type(zero).__name__}; use zero_optimization.stage 1 or 2, or set guards.gepo.enabled=false"
            )
        original_norm, original_update = zero.scaled_global_norm, zero._update_scale
        pending: dict[str, bool | None] = {"skip": None}

        def scaled_global_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
            scaled = original_norm(*args, **kwargs)
            norm = scaled.detach().float() / float(zero.loss_scale)
            if not bool(scaled >= 0):  # DeepSpeed reports an inf/NaN group norm as -1
                norm = torch.full_like(norm, float("nan"))
            grads = [g for i in sorted(zero.averaged_gradients) for g in (zero.averaged_gradients[i] or [])]
            pending["skip"] = self._decide_optimizer_step(norm, grads).skip
            if not pending["skip"] and self.opefo is not None and self.opefo.feed_back(grads):
                scaled = original_norm(*args, **kwargs)  # error feedback changed the partition: norm it again
            return scaled

        def update_scale(has_overflow: bool) -> None:
            if pending["skip"] is None and has_overflow:  # DeepSpeed skipped before computing a norm
                self._decide_optimizer_step(torch.tensor(float("nan")), [])
            original_update(has_overflow)
            if pending["skip"]:
                zero.overflow = True
            pending["skip"] = None

        zero.scaled_global_norm = scaled_global_norm
        zero._update_scale = update_scale
        self._ds_hook_installed = True

    # ------------------------------------------------------------------ 4: state in checkpoints

    def _get_output_dir(self, trial):
        if self._steady_staging is not None:  # inside _save_checkpoint: every checkpoint file goes to staging
            return str(self._steady_staging)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """Write the checkpoint into a staging folder, then move it into place in one rename.

        TRL/transformers write ``checkpoint-N`` under ``<output_dir>/.staging``; steadyrl adds its guard state
        and per-rank rollout buffers and, once every rank is past a barrier, the main process writes the
        completion marker and renames the folder to ``<output_dir>/checkpoint-N``. A crash at any point leaves
        either the previous complete checkpoints untouched or the new one complete: ``resume: auto`` never
        sees a half-written folder. Rotation (``save_total_limit``) counts complete checkpoints only, so the
        newest complete one is never deleted; leftovers of a crashed save are removed.
        """
        acc = self.accelerator
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_root = run_dir / STAGING_DIR
        if acc.is_main_process and (staging_root / name).exists():
            shutil.rmtree(staging_root / name)  # left by a save that crashed
        acc.wait_for_everyone()
        self._steady_staging = staging_root
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._steady_staging = None
        save_steady_state(self, staging_root / name)
        acc.wait_for_everyone()
        if acc.is_main_process:
            publish_checkpoint(staging_root / name, run_dir / name, self.state.global_step, acc.num_processes)
            rotate_complete_checkpoints(run_dir, self.args.save_total_limit)
        acc.wait_for_everyone()

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            load_steady_state(self, Path(checkpoint))


class _GuardClock(TrainerCallback):
    """Tells guards that count optimizer steps (``step()``, e.g. GRADE's quantile refresh) that one happened."""

    def __init__(self, trainer: SteadyGRPOTrainer) -> None:
        self.trainer = trainer
        self._last_guard_seconds = 0.0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.install_deepspeed_step_hook()
        if self.trainer.opefo is not None:
            self.trainer.opefo.attach(self.trainer)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        with trainer.guard_timer():
            for obj in (trainer.reward_processor, trainer.advantage_fn, *trainer.step_guards):
                if obj is not None and callable(getattr(obj, "step", None)):
                    obj.step()
            if trainer.opefo is not None:
                trainer.opefo.on_step_end()
            if trainer.quatro is not None:
                trainer.quatro.on_step_end()
        if trainer.step_guards or trainer._rewrites_advantages() or trainer.quatro is not None:
            # seconds spent in steadyrl's guard code during this optimizer step (its whole overhead but the
            # checks in the log-prob hook, which are a few elementwise ops)
            trainer._guard_metric(GUARD_SECONDS, trainer.guard_seconds - self._last_guard_seconds)
        self._last_guard_seconds = trainer.guard_seconds


def save_steady_state(trainer: SteadyGRPOTrainer, folder: Path) -> None:
    """Write guard state (main process) and this rank's rollout buffer into a checkpoint folder.

    The rollout buffer (``_buffered_inputs`` and the micro-step counter) makes a resume inside a generation
    window (``steps_per_generation > 1``) exact: the resumed run trains on the same rollouts instead of
    generating new ones.
    """
    acc = trainer.accelerator
    folder.mkdir(parents=True, exist_ok=True)
    rank_state = {
        "step": trainer._step,
        "buffered_inputs": trainer._buffered_inputs,
        "guards": {name: obj.rank_state_dict() for name, obj in trainer.rank_stateful.items()},
    }
    torch.save(rank_state, folder / RANK_STATE_FILE.format(rank=acc.process_index))
    if acc.is_main_process:
        guards = {name: obj.state_dict() for name, obj in trainer.stateful.items()}
        torch.save({"guards": guards, "counters": dict(trainer.steady_counters)}, folder / GUARD_STATE_FILE)


def publish_checkpoint(staged: Path, final: Path, global_step: int, num_processes: int) -> None:
    """Mark a fully written staged checkpoint complete and rename it into place (main process only).

    An existing ``final`` (a stale folder from a crashed run, or the same step saved again) is first moved
    aside, so there is no moment at which neither the old nor the new folder exists under a checkpoint name
    that ``resume: auto`` would pick.
    """
    marker = {"global_step": global_step, "num_processes": num_processes}
    (staged / COMPLETE_MARKER).write_text(json.dumps(marker))
    _fsync_tree(staged)
    trash = None
    if final.exists():
        trash = final.parent / STAGING_DIR / f"{final.name}.old"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(final, trash)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def rotate_complete_checkpoints(run_dir: Path, save_total_limit: int | None) -> None:
    """Keep the newest ``save_total_limit`` complete checkpoints; delete older ones and incomplete leftovers."""
    numbered = sorted(_checkpoint_folders(run_dir), reverse=True)
    complete = [folder for _, folder in numbered if is_complete_checkpoint(folder)]
    for _, folder in numbered:
        if not is_complete_checkpoint(folder):
            logger.warning("removing incomplete checkpoint %s (left by a crashed save)", folder)
            shutil.rmtree(folder, ignore_errors=True)
    if save_total_limit is not None and save_total_limit > 0:
        for folder in complete[save_total_limit:]:
            shutil.rmtree(folder, ignore_errors=True)


def _fsync_tree(folder: Path) -> None:
    """Flush every file of a freshly written checkpoint to disk before it is published."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_steady_state(trainer: SteadyGRPOTrainer, folder: Path) -> None:
    acc = trainer.accelerator
    rank_file = folder / RANK_STATE_FILE.format(rank=acc.process_index)
    if rank_file.is_file():
        rank_state = torch.load(rank_file, map_location=acc.device, weights_only=False)
        trainer._step = rank_state["step"]
        trainer._buffered_inputs = rank_state["buffered_inputs"]
        for name, obj in trainer.rank_stateful.items():
            if name in rank_state.get("guards", {}):
                obj.load_rank_state_dict(rank_state["guards"][name])
    else:
        logger.warning("%s has no rollout buffer for rank %d: resuming with fresh rollouts", folder, acc.process_index)
    state_file = folder / GUARD_STATE_FILE
    if not state_file.is_file():
        if trainer.stateful:
            logger.warning("%s has no guard state: guards start fresh", folder)
        return
    saved = torch.load(state_file, map_location="cpu", weights_only=False)
    for name, obj in trainer.stateful.items():
        if name in saved["guards"]:
            obj.load_state_dict(saved["guards"][name])
        else:
            logger.warning("checkpoint %s has no state for %s: it starts fresh", folder, name)
    trainer.steady_counters.update(saved.get("counters", {}))


def is_complete_checkpoint(folder: Path) -> bool:
    """A checkpoint whose every part was written: the Trainer's state and steadyrl's completion marker."""
    return (folder / "trainer_state.json").is_file() and (folder / COMPLETE_MARKER).is_file()


def _checkpoint_folders(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for child in run_dir.iterdir():
        prefix, _, number = child.name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and number.isdigit() and child.is_dir():
            out.append((int(number), child))
    return out


def find_resume_checkpoint(output_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete ``checkpoint-N`` folder in ``output_dir``, or None (start fresh)."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    for _, folder in sorted(_checkpoint_folders(root), reverse=True):
        if is_complete_checkpoint(folder):
            return folder
        logger.warning("ignoring incomplete checkpoint %s", folder)
    return None
