"""SteadyGRPOTrainer: ``trl.GRPOTrainer`` with four extension points and state that survives resume.

With no reward processor, no advantage function and no step guard it *is* ``trl.GRPOTrainer``: every hook
calls the parent and returns its result untouched (tested: identical rewards and weights).

The hooked TRL methods are listed in ``steadyrl.trainers.hooks``; none of their bodies is copied here. Each hook
is a short delegation (docs/ARCHITECTURE.md has the hook order):

- rewards -> advantages: ``steadyrl.trainers.advantage_pipeline`` (PPO plugs in its own);
- the optimizer-step gate and its DeepSpeed installation: ``steadyrl.trainers.step_gate``;
- checkpoints (staging, completion marker, rotation, resume lookup): ``steadyrl.trainers.checkpoints``;
- QUATRO and OPEFO: ``quatro_runtime`` / ``opefo_runtime``, which get a ``RuntimeContext``, never the trainer, and
  return what should change; the trainer writes it into TRL's state (``steadyrl.trainers.trl_state``);
- values handed between hooks: ``HookScratch`` (``steadyrl.trainers.scratch``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl import GRPOTrainer

from steadyrl.config.guard_sections import GuardsSection
from steadyrl.guards.base import AdvantageFunction, RewardProcessor, StepGuard, Stepping
from steadyrl.guards.entropy_floor import cov_clip_mask
from steadyrl.guards.optimizer_state import scale_moments
from steadyrl.guards.spike import SpikeGuard
from steadyrl.metrics import (
    GEPO_NONFINITE_LOGPROBS,
    GEPO_NONFINITE_LOSS,
    GEPO_NONFINITE_RATIOS,
    GEPO_WOULD_CLAMP_LOGPROBS,
    GRADE_BETA,
    GRADE_KL_FACTOR,
    GUARD_PART_GEPO_ADVANTAGES,
    GUARD_PART_GEPO_SPIKE,
    GUARD_PART_OPEFO_STATE,
    GUARD_PART_QUATRO_CONTROLLERS,
    GUARD_PART_QUATRO_FILTERS,
    GUARD_PART_QUATRO_MEASURE,
    GUARD_PART_QUATRO_REPLAY,
    GUARD_SECONDS,
    QUATRO_BETA,
    QUATRO_COV_CLIPPED,
    QUATRO_COV_CLIPPED_WOULD,
    QUATRO_PG_SCALE,
    QUATRO_PG_SCALE_WOULD,
)
from steadyrl.trainers import checkpoints, trl_state
from steadyrl.trainers.advantage_pipeline import AdvantagePipeline, RewardBatch, weighted_rewards
from steadyrl.trainers.checkpoints import (  # noqa: F401  (re-exported: the checkpoint API's old home)
    COMPLETE_MARKER,
    GUARD_STATE_FILE,
    RANK_STATE_FILE,
    STAGING_DIR,
    GuardState,
    find_resume_checkpoint,
    is_complete_checkpoint,
    publish_checkpoint,
    rotate_complete_checkpoints,
)
from steadyrl.trainers.context import RuntimeContext, identity
from steadyrl.trainers.guard_memory import held_tensor_bytes, run_storages
from steadyrl.trainers.micro_batch_gate import MicroBatchGate
from steadyrl.trainers.opefo_runtime import OpefoRuntime, keeps_adam_moments, optimizer_chain
from steadyrl.trainers.quatro_runtime import QuatroControls, QuatroRuntime, loss_mask
from steadyrl.trainers.scratch import HookScratch
from steadyrl.trainers.step_gate import StepGate

logger = logging.getLogger(__name__)

_GUARD_ARGUMENTS = frozenset(
    "reward_processor advantage_fn step_guards stateful logprob_min finite_checks kl_compensation opefo quatro "
    "observe_rewards observe_advantage_fn observe_step_guards observe_logprob_min micro_batch_guard "
    "observe_micro_batch_guard".split()
)


def guard_arguments(guards: GuardsSection | dict[str, Any] | str) -> dict[str, Any]:
    """``SteadyGRPOTrainer``'s guard arguments from ``"all"`` (every layer on, shipped defaults), a
    ``GuardsSection``, or a dict shaped like the YAML ``guards:`` section (unknown keys raise ``ConfigError``)."""
    from steadyrl.config.typed import _build
    from steadyrl.trainers.layers import layer_kwargs

    if guards == "all":
        guards = {layer: {"enabled": True} for layer in ("gepo", "opefo", "quatro", "grade")}
    if isinstance(guards, dict):
        guards = _build(GuardsSection, guards, "guards", {})
    if not isinstance(guards, GuardsSection):
        raise TypeError(f'guards= takes "all", a GuardsSection or a dict, got {type(guards).__name__}')
    return layer_kwargs(guards)


class SteadyGRPOTrainer(GRPOTrainer):
    """GRPO with pluggable reward processing, advantages and optimizer-step guards.

    Extra keyword arguments (all optional; the guard layers fill them in):
        reward_processor: raw rewards of the whole generation batch -> scaled rewards (``RewardProcessor``).
        advantage_fn: grouped rewards (num_prompts, G) -> advantages (``AdvantageFunction``). Default when only
            a reward processor is set: TRL's own group normalisation with ``args.scale_rewards``.
        step_guards: objects with ``decide(grad_norm, step)`` / ``on_skip(...)`` (``StepGuard``), asked before
            every optimizer step with the global pre-clip gradient norm.
        stateful: extra named objects with ``state_dict``/``load_state_dict`` saved in every checkpoint.
        logprob_min: clamp every per-token log-prob (policy, old and reference) at this floor (-100, see
            docs/DESIGN.md "GEPO: log-prob floor and finite checks"); None leaves TRL's values untouched.
        finite_checks: count non-finite log-probs, importance ratios and losses per step (``gepo/nonfinite_*``).
        opefo: the OPEFO optimizer layer (``OpefoRuntime``): error feedback of skipped gradients, second-moment
            floor, snapshots and automatic rollback. Needs at least one step guard (the skip it feeds back).
        kl_compensation: (lo, hi): multiply the KL coefficient by GRADE's ``kl_compensation(lo, hi)`` (raw_std /
            scaled_std) after every generation batch. ``beta = beta_base x`` every factor in ``beta_factors``.
        quatro: the QUATRO loop layer (``QuatroRuntime``): adaptive KL (the ``quatro_kl`` factor of ``beta``),
            entropy floor, rollout quality filters, rollout replay.

    Observe mode (docs/DESIGN.md, "Observe mode"; ``OpefoRuntime`` and ``QuatroRuntime`` carry their own flag):
        observe_rewards: the reward processor runs and logs its statistics, but advantages come from the raw rewards
            (its KL compensation factor is logged as ``grade/kl_factor_would``, not applied).
        observe_advantage_fn: advantages computed next to the trained ones (TRL's, or ``advantage_fn``'s) and
            compared (``gepo/would_clip_rows``, ``gepo/would_adv_diff_mean``); they never reach the loss.
        observe_step_guards: step guards whose vetoes are counted (``gepo/would_skip``), never applied.
        observe_logprob_min: count per-token log-probs below this floor (``gepo/would_clamp_logprobs``) without
            clamping them.

    guards: the YAML ``guards:`` section from Python, expanded into the arguments above (``guard_arguments``):
        ``"all"`` (every layer at its shipped defaults), a ``GuardsSection``, or a dict shaped like the YAML section
        (``{"gepo": {"enabled": True}, ...}``, validated like it). Exclusive with the arguments it fills.

    Per micro-batch (``guards.gepo.spike.granularity: micro_batch``, ``MicroBatchGate``):
        micro_batch_guard: a ``SpikeGuard`` judging each micro-batch's own gradient; spiking ones are dropped.
        observe_micro_batch_guard: the same, counting would-drops only.
    """

    pipeline_class: type[AdvantagePipeline] = AdvantagePipeline

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
        observe_rewards: bool = False,
        observe_advantage_fn: AdvantageFunction | None = None,
        observe_step_guards: list[StepGuard] | None = None,
        observe_logprob_min: float | None = None,
        micro_batch_guard: SpikeGuard | None = None,
        observe_micro_batch_guard: SpikeGuard | None = None,
        guards: GuardsSection | dict[str, Any] | str | None = None,
        **kwargs: Any,
    ) -> None:
        if guards is not None:  # the YAML ``guards:`` section, from Python: expands into the arguments above
            given = locals()
            explicit = {k: given[k] for k in _GUARD_ARGUMENTS if given[k] is not None and given[k] is not False}
            filled = guard_arguments(guards)
            clash = sorted(set(explicit) & set(filled))
            if clash:
                raise ValueError(f"guards= fills {clash}; pass either guards= or these arguments, not both")
            SteadyGRPOTrainer.__init__(self, *args, **explicit, **filled, **kwargs)
            return
        super().__init__(*args, **kwargs)
        self.reward_processor, self.advantage_fn = reward_processor, advantage_fn
        self.observe_advantage_fn = observe_advantage_fn
        self.step_guards = list(step_guards or [])
        self.observe_step_guards = list(observe_step_guards or [])
        self.logprob_min, self.finite_checks = logprob_min, finite_checks
        self.observe_logprob_min = observe_logprob_min
        self.opefo, self.quatro = opefo, quatro
        if kl_compensation is not None and (reward_processor is None or self.beta == 0.0):
            raise ValueError("kl_compensation needs a reward processor with kl_compensation() and beta > 0")
        self.beta_base, self.beta_factors = self.beta, {}
        self.scratch = HookScratch()
        distributed = self.accelerator.num_processes > 1  # else accelerate's collectives return their input
        self.ctx = RuntimeContext(
            log_metric=self._guard_metric,
            emit_event=self.emit_event,
            reduce_sum=(lambda t: self.accelerator.reduce(t, reduction="sum")) if distributed else identity,
            gather=self.accelerator.gather if distributed else identity,
            gather_object=gather_object,
            global_step=lambda: self.state.global_step,
            rank=self.accelerator.process_index,
            processes=self.accelerator.num_processes,
            device=self.accelerator.device,
        )
        self.pipeline = self.pipeline_class(
            reward_processor,
            advantage_fn,
            self.scale_rewards,
            kl_compensation,
            observe_rewards=observe_rewards,
            observe_advantage_fn=observe_advantage_fn,
        )
        self.gate = StepGate(self.step_guards, self.ctx, feedback=opefo, observers=self.observe_step_guards)
        self._micro_params: list[torch.nn.Parameter] | None = None
        self.micro_gate = self._micro_batch_gate(micro_batch_guard, observe_micro_batch_guard)
        self.lr_scale = trl_state.LearningRateScale()
        layers = [("reward_processor", reward_processor), ("advantage_fn", advantage_fn)]
        layers += [(f"step_guard_{i}", g) for i, g in enumerate(self.step_guards)]
        layers += [(f"observe_step_guard_{i}", g) for i, g in enumerate(self.observe_step_guards)]
        layers += [("opefo", opefo), ("quatro", quatro)]
        per_rank = {"opefo": opefo, "micro_batch_gate": self.micro_gate}
        self.guard_state = GuardState.register(layers, stateful, self.gate.counters, per_rank=per_rank)
        if kl_compensation is not None or quatro is not None:  # factors of beta set between steps: checkpointed
            self.guard_state.stateful.setdefault("beta_factors", trl_state.BetaFactors(self))
        self._epsilon0: tuple[float, float] | None = None
        if quatro is not None:
            self._epsilon0 = trl_state.bind_quatro(self, quatro)
            self.apply_quatro()
        # First in line: guards act on a finished step before any other callback (logging, user code) sees it.
        self.callback_handler.callbacks.insert(0, _GuardClock(self))

    def _micro_batch_gate(self, act: SpikeGuard | None, observe: SpikeGuard | None) -> MicroBatchGate | None:
        guard = act or observe
        if guard is None:
            return None
        if act is not None and observe is not None:
            raise ValueError("micro_batch_guard and observe_micro_batch_guard are exclusive")
        if self.is_deepspeed_enabled:
            raise ValueError("guards.gepo.spike.granularity=micro_batch does not work under DeepSpeed; use step")
        if self.args.max_grad_norm <= 0:  # _clip_grad_norm, where the kept micro-batches are averaged, never runs
            raise ValueError("guards.gepo.spike.granularity=micro_batch needs max_grad_norm > 0")
        # consecutive drops count in micro-batches: max_consecutive_skips steps' worth of them stops the run
        accumulation = max(1, int(self.args.gradient_accumulation_steps))
        limit = guard.config.max_consecutive_skips * accumulation
        guard.config = dataclasses.replace(guard.config, max_consecutive_skips=limit)
        distributed = self.accelerator.num_processes > 1  # the backward passes run no_sync; finish all-reduces
        return MicroBatchGate(
            guard, self.ctx, observe=observe is not None, distributed=distributed, accumulation=accumulation
        )

    def apply_quatro(self, controls: QuatroControls | None = None) -> None:
        """Write QUATRO's controls (default: its current ones) into TRL's beta, entropy_coef and clip range."""
        assert self.quatro is not None
        trl_state.apply_quatro(self, self.quatro.controls() if controls is None else controls, self._epsilon0)

    @property
    def steady_counters(self) -> dict[str, float]:
        """The step gate's skip counters (saved in every checkpoint)."""
        return self.gate.counters

    def emit_event(self, kind: str, step: int | None = None, **fields: Any) -> None:
        """A discrete event (skip, rollback, ...) for callbacks that record them (``MetricsLog.event``).

        ``step``: the optimizer step it belongs to, numbered like the log rows (the step that ends with
        ``global_step == step``); default ``global_step``.
        """
        for callback in self.callback_handler.callbacks:
            if callable(getattr(callback, "event", None)):
                callback.event(self.state.global_step if step is None else step, kind, **fields)

    def _guard_metric(self, name: str, value: float) -> None:
        """Averaged over the logging interval and logged with TRL's own metrics (report_to sees them)."""
        self._metrics["train" if self.model.training else "eval"][name].append(value)

    # ------------------------------------------------------------------ 1+2: rewards -> advantages

    def _rewrites_advantages(self) -> bool:
        filters = self.quatro is not None and self.quatro.filters_on
        rewrites = self.reward_processor is not None or self.advantage_fn is not None or filters
        return rewrites or self.observe_advantage_fn is not None

    def _replay_on(self) -> bool:
        return self.quatro is not None and self.quatro.replay_on and self.model.training

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.quatro is not None and self.quatro.wants_rewards and self.model.training:
            with self.ctx.timer(GUARD_PART_QUATRO_MEASURE):  # the entropy floor's learning gate
                self.quatro.record_reward(self.quatro.gate_rewards(rewards_per_func, self.reward_weights))
        if self._rewrites_advantages():
            # rewards_per_func is already gathered over processes; gather the prompts to match its rows.
            with self.ctx.timer("pipeline"):
                self.scratch.scores = (rewards_per_func, gather_object(list(prompts)))
                if self.quatro is not None and self.quatro.filters_on:
                    lengths = [len(ids) for ids in completion_ids_list]  # this rank's, unpadded
                    self.scratch.completion_lengths = torch.tensor(lengths, dtype=torch.long)
        return rewards_per_func

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self._replay_on() or self._buffered_inputs is buffered:
            return inputs  # no replay, or TRL served a micro-batch it had buffered (already mixed)
        # TRL just generated and split a generation batch: mix each of its micro-batches with replayed rows.
        fresh = self._buffered_inputs
        with self.ctx.timer(GUARD_PART_QUATRO_REPLAY):
            self._buffered_inputs = self.quatro.mix_generation(fresh, self.state.global_step)
        return self._buffered_inputs[next(i for i, batch in enumerate(fresh) if batch is inputs)]

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self._replay_on():
            with self.ctx.timer(GUARD_PART_QUATRO_REPLAY):
                trl_state.ensure_sampling_logps(self, output)  # replayed rows need their sampling log-probs
        if not self._rewrites_advantages():
            return output
        assert self.scratch.scores is not None, "_calculate_rewards did not run before advantages"
        (rewards_per_func, prompts), self.scratch.scores = self.scratch.scores, None
        training = self.model.training
        num_generations = self.num_generations if training else self.num_generations_eval
        start, local = self.accelerator.process_index * len(inputs), len(inputs)
        keep = None
        with self.ctx.timer("pipeline"):
            completion_lengths, self.scratch.completion_lengths = self.scratch.completion_lengths, None
            if completion_lengths is not None and training:
                with self.ctx.timer(GUARD_PART_QUATRO_FILTERS):
                    rewards = weighted_rewards(rewards_per_func, self.reward_weights)
                    keep = self.quatro.filter_generation(output, rewards, completion_lengths, num_generations)
            advantages = self.compute_advantages(rewards_per_func, prompts, num_generations, keep=keep)
            output["advantages"] = advantages[start : start + local].to(output["advantages"].device)
            if keep is not None:
                with self.ctx.timer(GUARD_PART_QUATRO_FILTERS):
                    self.quatro.mask_dropped_rows(output, keep[start : start + local])
        return output

    def compute_advantages(
        self, rewards_per_func: torch.Tensor, prompts: list[Any], num_generations: int, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Gathered rewards (N, num_funcs) -> (N,) through ``self.pipeline``; GRADE's KL factor of beta in between.

        ``keep`` (N,) bool, from QUATRO's rollout filters: dropped rows are NaN (unscorable) for the reward
        processor, leave their group's statistics and get advantage 0.
        """
        batch = RewardBatch(rewards_per_func, prompts, num_generations, self.reward_weights, keep)
        with self.ctx.timer("grade" if self.reward_processor is not None else "pipeline"):
            scaled = self.pipeline.scale(batch)
            self.ctx.log_metrics(scaled.metrics)
            if scaled.kl_factor is not None:
                trl_state.set_beta_factor(self, "grade", scaled.kl_factor)
                self.ctx.log_metrics({GRADE_KL_FACTOR: scaled.kl_factor, GRADE_BETA: self.beta})
        gepo = self.advantage_fn is not None or self.observe_advantage_fn is not None
        with self.ctx.timer(GUARD_PART_GEPO_ADVANTAGES if gepo else "pipeline"):
            advantages, metrics = self.pipeline.advantages(scaled.rewards, keep, num_generations)
            self.ctx.log_metrics(metrics)
        return advantages

    # ------------------------------------------------------------------ loss: finite checks, QUATRO measurements

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        with self.ctx.timer("checks"):  # the checks and the floor on every log-prob forward are guard cost too
            return self._guard_logps(logps, entropies), entropies, aux_loss

    def _guard_logps(self, logps: torch.Tensor, entropies: torch.Tensor | None = None) -> torch.Tensor:
        """Finite counts, observe mode's would-clamp count, the log-prob floor, and the loss's ratio check."""
        if self.finite_checks:
            self._guard_metric(GEPO_NONFINITE_LOGPROBS, float((~torch.isfinite(logps)).sum()))
        if self.observe_logprob_min is not None:
            self._guard_metric(GEPO_WOULD_CLAMP_LOGPROBS, float((logps < self.observe_logprob_min).sum()))
        if self.logprob_min is not None:
            logps = logps.clamp(min=self.logprob_min)  # -inf -> floor; NaN stays NaN and is caught at the step
        inputs = self.scratch.loss_inputs
        if inputs is not None:  # the policy log-probs of a loss computation: the ratios it will form
            self.scratch.loss_inputs = None
            self.scratch.loss_logps = logps.detach()  # for QUATRO's replay ratio metric
            self._cov_clip(inputs, logps, entropies)
            if self.finite_checks:
                old = inputs.get("old_per_token_logps")
                log_ratio = logps.detach() - (logps.detach() if old is None else old)
                bad = ~torch.isfinite(torch.exp(log_ratio)) & inputs["completion_mask"].bool()
                self._guard_metric(GEPO_NONFINITE_RATIOS, float(bad.sum()))
        return logps

    def _cov_clip_on(self) -> bool:
        floor = self.quatro.entropy if self.quatro is not None else None
        return floor is not None and floor.config.cov_clip > 0 and self.model.training

    def _cov_clip(self, inputs: dict[str, Any], logps: torch.Tensor, entropies: torch.Tensor | None) -> None:
        """The entropy floor's covariance clip (``guards.quatro.entropy.cov_clip``, docs/DESIGN.md): zero the
        advantage of the sharpening tokens it picks, for this loss only (``_compute_loss`` puts the micro-batch's
        own advantages back). Logs the share of loss tokens picked; observe mode counts them and changes nothing."""
        if not self._cov_clip_on():
            return
        assert self.quatro is not None and self.quatro.entropy is not None
        share = self.quatro.entropy.cov_share
        name = QUATRO_COV_CLIPPED_WOULD if self.quatro.observe else QUATRO_COV_CLIPPED
        if share <= 0 or entropies is None:  # TRL's loss always computes the entropies (compute_entropy=True)
            self._guard_metric(name, 0.0)
            return
        mask = loss_mask(inputs)
        advantages = inputs["advantages"]
        chosen = cov_clip_mask(logps, entropies, advantages, mask, share)
        self._guard_metric(name, float(chosen.sum()) / max(float((mask > 0).sum()), 1.0))
        if self.quatro.observe:
            return
        per_token = advantages.unsqueeze(1).expand_as(logps) if advantages.dim() == 1 else advantages
        inputs["advantages"] = per_token.masked_fill(chosen, 0.0)  # TRL takes (batch, tokens) advantages as they are

    def _pg_brake(self, inputs: dict[str, Any]) -> None:
        """The entropy floor's policy-gradient brake (``guards.quatro.entropy.pg_brake``, docs/DESIGN.md): this loss
        trains on the micro-batch's advantages times ``pg_scale`` (``_compute_loss`` puts the originals back). Logs
        the factor; observe mode logs it as ``quatro/pg_scale_would`` and changes nothing."""
        floor = self.quatro.entropy if self.quatro is not None else None
        if floor is None or floor.config.pg_brake == 0 or not self.model.training or "advantages" not in inputs:
            return
        scale = floor.pg_scale
        self._guard_metric(QUATRO_PG_SCALE_WOULD if self.quatro.observe else QUATRO_PG_SCALE, scale)
        if scale != 1.0 and not self.quatro.observe:
            inputs["advantages"] = inputs["advantages"] * scale

    def _compute_loss(self, model, inputs):
        if not self.finite_checks and self.quatro is None:
            return super()._compute_loss(model, inputs)
        replay = self._replay_on()
        self.scratch.loss_inputs = inputs if self.finite_checks or replay or self._cov_clip_on() else None
        self.scratch.loss_logps = None
        advantages = inputs.get("advantages")  # the covariance clip swaps in per-token ones for this loss only
        self._pg_brake(inputs)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self.scratch.loss_inputs = None
            if advantages is not None:
                inputs["advantages"] = advantages
        logps, self.scratch.loss_logps = self.scratch.loss_logps, None
        with self.ctx.timer("checks"):  # QUATRO's per-micro-batch measurements and the loss's finite check
            return self._after_loss(loss, inputs, logps, replay)

    def _after_loss(self, loss: torch.Tensor, inputs: dict[str, Any], logps: Any, replay: bool) -> torch.Tensor:
        if self.quatro is not None and self.model.training:
            with self.ctx.timer(GUARD_PART_QUATRO_MEASURE):
                # TRL's kl / entropy of this micro-batch, for the controllers
                self.quatro.record_micro_batch(inputs, *trl_state.logged_kl_and_entropy(self))
            if replay:
                with self.ctx.timer(GUARD_PART_QUATRO_REPLAY):
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

    def training_step(self, model, inputs, num_items_in_batch):
        """Per-micro-batch decision (``MicroBatchGate``) around TRL's step; otherwise TRL's step unchanged."""
        if self.micro_gate is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if self._micro_params is None:
            self._micro_params = [p for p in model.parameters() if p.requires_grad]
        with self.ctx.timer(GUARD_PART_GEPO_SPIKE):  # the gradient copy is guard cost too
            self.micro_gate.before_backward(self._micro_params)
        # Under DDP every micro-batch's backward stays local; MicroBatchGate.finish all-reduces the kept ones.
        sync = self.accelerator.no_sync(model) if self.accelerator.num_processes > 1 else contextlib.nullcontext()
        with sync:
            loss = super().training_step(model, inputs, num_items_in_batch)
        with self.ctx.timer(GUARD_PART_GEPO_SPIKE):
            self.micro_gate.after_backward(self._micro_params)
        return loss

    def _clip_grad_norm(self, model):
        if self.micro_gate is not None and self._micro_params is not None:
            with self.ctx.timer(GUARD_PART_GEPO_SPIKE):
                every_one_dropped = self.micro_gate.finish(self._micro_params)
            if every_one_dropped:  # nothing left to train on: the step is skipped like a vetoed one
                self.gate.veto("micro_batches")
                model.zero_grad(set_to_none=True)
                self.scratch.vetoed_step = True
                if hasattr(self.optimizer, "_is_overflow"):
                    self.optimizer._is_overflow = True
                return torch.zeros((), device=self.accelerator.device)
        if not (self.step_guards or self.observe_step_guards) or self.is_deepspeed_enabled:
            # Under DeepSpeed the step already happened inside ``accelerator.backward`` and was decided by the
            # gate installed on the ZeRO optimizer (``StepGate.install_deepspeed``); this returns the engine's norm.
            return super()._clip_grad_norm(model)
        scaler = getattr(self.optimizer, "scaler", None)  # accelerate's GradScaler: fp16 without DeepSpeed
        if scaler is not None:
            # The gradients are still multiplied by the loss scale. Unscale them first, as the Trainer's own
            # clipping does (accelerator.clip_grad_norm_): the gate decides on, feeds back into and clips the true
            # gradients, and the scaler records its inf check here, so a vetoed step (no gradients left) passes
            # scaler.step / scaler.update like a step without overflow.
            scaler.unscale_(self.optimizer.optimizer)
        norm, skipped = self.gate.clip_or_skip(model, self.args.max_grad_norm)
        # Tell the Trainer the step was skipped so it does not advance the LR schedule, exactly as it does for an
        # fp16 overflow and for a step DeepSpeed skipped. Under a scaler, optimizer.step() rewrites the flag, so it
        # is set again after the step (_GuardClock.on_optimizer_step).
        self.scratch.vetoed_step = skipped
        if scaler is None and hasattr(self.optimizer, "_is_overflow"):
            self.optimizer._is_overflow = skipped
        return norm

    # ------------------------------------------------------------------ 4: state in checkpoints

    def _get_output_dir(self, trial):
        staging = self.scratch.staging_dir  # set inside _save_checkpoint: every checkpoint file goes to staging
        return str(staging) if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, staged and published in one rename with steadyrl's state (``checkpoints``)."""
        save_parent, acc = super()._save_checkpoint, self.accelerator

        def write(staging_root: Path, folder: Path) -> None:
            self.scratch.staging_dir = staging_root
            try:
                save_parent(model, trial)
            finally:
                self.scratch.staging_dir = None
            rollouts = {"step": self._step, "buffered_inputs": self._buffered_inputs}
            checkpoints.save_steady_state(folder, self.guard_state, rollouts, acc.process_index, acc.is_main_process)

        run_dir = Path(super()._get_output_dir(trial))
        checkpoints.save_atomically(acc, run_dir, self.state.global_step, self.args.save_total_limit, write)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            load_steady_state(self, Path(checkpoint))


class _GuardClock(TrainerCallback):
    """The guard layers' work between two optimizer steps, in this order (the order matters): stepping guards
    (``step()``, e.g. GRADE's quantile refresh), OPEFO (floor, check, rollback or snapshot; LR factor), QUATRO
    (controllers observe the step; beta factor, entropy bonus, clip range), then the overhead metric."""

    def __init__(self, trainer: SteadyGRPOTrainer) -> None:
        self.trainer = trainer
        self._last_guard_seconds = 0.0
        self._moments: torch.optim.Optimizer | None = None  # the Adam whose moments brake_moments rescales

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if (t.step_guards or t.observe_step_guards) and t.is_deepspeed_enabled:
            t.gate.install_deepspeed(t.optimizer)
        floor = t.quatro.entropy if t.quatro is not None else None
        if floor is not None and floor.config.brake_moments > 0 and not t.quatro.observe:
            base = optimizer_chain(t.optimizer)[-1]
            if not keeps_adam_moments(base):
                raise TypeError(
                    f"guards.quatro.entropy.brake_moments rescales Adam's moments (exp_avg, exp_avg_sq), but the "
                    f"optimizer is {type(base).__module__}.{type(base).__name__}. Use AdamW "
                    "(trainer.optim=adamw_torch) or set guards.quatro.entropy.brake_moments=0"
                )
            self._moments = base
        if t.opefo is not None:
            t.opefo.attach(t.ctx, t.optimizer, lambda: t.model.named_parameters(), t.args.output_dir, t.guard_state)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        if t.scratch.vetoed_step:  # read by the Trainer right after this callback (optimizer_step_was_skipped)
            t.scratch.vetoed_step = False
            if hasattr(t.optimizer, "_is_overflow"):
                t.optimizer._is_overflow = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        stepping = [(t.reward_processor, "grade"), (t.advantage_fn, GUARD_PART_GEPO_ADVANTAGES)]
        stepping += [(guard, GUARD_PART_GEPO_SPIKE) for guard in (*t.step_guards, *t.observe_step_guards)]
        for obj, part in stepping:
            if isinstance(obj, Stepping) and callable(obj.step):
                with t.ctx.timer(part):
                    obj.step()
        if t.opefo is not None:
            with t.ctx.timer(GUARD_PART_OPEFO_STATE):
                if (factor := t.opefo.on_step_end()) is not None:
                    trl_state.apply_lr_factor(t, t.lr_scale, factor)
        if t.quatro is not None:
            with t.ctx.timer(GUARD_PART_QUATRO_CONTROLLERS):
                controls, metrics = t.quatro.on_step_end()
                t.apply_quatro(controls)
                if self._moments is not None and (factor := t.quatro.take_moment_factor()) != 1.0:
                    scale_moments(self._moments, factor)  # before the next update, whose loss the brake scales
                if t.quatro.kl is not None:
                    metrics[QUATRO_BETA] = t.beta  # the effective coefficient, every factor included
                t.ctx.log_metrics({k: v for k, v in metrics.items() if math.isfinite(v)})
        if t.step_guards or t.observe_step_guards or t._rewrites_advantages() or t.quatro is not None:
            # seconds spent in steadyrl's guard code during this optimizer step: every hook's guard work (rewards
            # for the processor, advantages, filters, the log-prob checks and floor, the per-micro-batch
            # measurements, the step decision, controllers, OPEFO); scripts/bench_overhead.py checks the remainder
            t._guard_metric(GUARD_SECONDS, t.ctx.seconds - self._last_guard_seconds)
        self._last_guard_seconds = t.ctx.seconds

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        t = self.trainer
        layers_on = t.step_guards or t.observe_step_guards or t._rewrites_advantages() or t.finite_checks
        if t.accelerator.is_main_process and (layers_on or t.opefo is not None or t.quatro is not None):
            try:  # a report: it must never cost the run its final save and eval, which come after train()
                write_guard_cost(Path(args.output_dir), t, state.global_step)
            except Exception as exc:
                logger.warning("could not write %s/guard_cost.json (%s); the run and its model are unaffected",
                               args.output_dir, exc)  # fmt: skip


def write_guard_cost(out: Path, trainer: SteadyGRPOTrainer, steps: int) -> None:
    """``OUTPUT_DIR/guard_cost.json`` (main process, at the end of training): the guard layers' cost over the run.

    ``guard_seconds`` and ``seconds_by_part``: time in guard code, split by the part that ran (``pipeline``: the
    reward gather and advantage plumbing that GRADE, GEPO's advantages and QUATRO's filters share; ``checks``: the
    finite checks GEPO and OPEFO share; ``ppo``: PPO's GAE, which includes the critic's forward, and its gradient
    norm split); the parts add up to the total. ``held_mib_by_part``: the tensors each layer holds at the end of
    training (``guard_memory.held_tensor_bytes``; the model's and the optimizer's storages excluded).
    ``transient_mib_by_part``: what a layer holds only for a while, one gradient copy of the trainable parameters
    each: the micro-batch spike gate between a micro-batch's backward and the next, OPEFO's error feedback from a
    skipped step until it is fed back. scripts/bench_overhead.py reads the file.
    """
    t = trainer
    roots = {
        "grade": [t.reward_processor],
        "gepo": [t.advantage_fn, t.observe_advantage_fn, *t.step_guards, *t.observe_step_guards, t.micro_gate],
        "opefo": [t.opefo],
        "quatro": [t.quatro],
        "pipeline": [t.pipeline, t.gate, t.scratch],
    }
    held = held_tensor_bytes(roots, trainer=t, exclude=run_storages(t.model, t.optimizer))
    gradient_mib = sum(p.numel() * p.element_size() for p in t.model.parameters() if p.requires_grad) / 2**20
    transient = {"gepo": gradient_mib if t.micro_gate is not None else 0.0}
    transient["opefo"] = gradient_mib if t.opefo is not None and t.gate.feedback is not None else 0.0
    doc = {
        "steps": steps,
        "guard_seconds": round(t.ctx.seconds, 6),
        "seconds_by_part": {name: round(value, 6) for name, value in sorted(t.ctx.seconds_by_part.items())},
        "held_mib_by_part": {name: round(value / 2**20, 3) for name, value in held.items()},
        "transient_mib_by_part": {name: round(value, 3) for name, value in transient.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "guard_cost.json").write_text(json.dumps(doc, indent=1) + "\n")


def load_steady_state(trainer: SteadyGRPOTrainer, folder: Path) -> None:
    """steadyrl's part of a checkpoint into a trainer: guard state, counters, this rank's rollout buffer."""
    acc = trainer.accelerator
    rollouts = checkpoints.load_steady_state(
        Path(folder), trainer.guard_state, acc.process_index, acc.device, acc.num_processes
    )
    if rollouts is not None:
        trainer._step, trainer._buffered_inputs = rollouts["step"], rollouts["buffered_inputs"]
    if trainer.quatro is not None:
        trainer.apply_quatro()  # the restored controllers' values
