"""SteadyGRPOTrainer: ``trl.GRPOTrainer`` plus the guard layers' parts, with state that survives resume.

Without guard parts it *is* ``trl.GRPOTrainer``: every hook calls the parent and returns its result untouched
(tests/integration/test_equivalence.py). Each overridden hook (listed in ``tests/unit/trl_contract.py``; no TRL body is
copied) calls one station of the step (docs/ARCHITECTURE.md): ``rollout`` (rewards -> advantages), ``loss``,
``step_gate`` (skip or clip), ``step_end`` (between steps); ``checkpoints`` for saving and resuming. Only
``trl_state`` writes TRL's state.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import trl
from accelerate.utils import gather_object
from trl import GRPOTrainer

from steadyrl.callbacks.monitor import SignalMonitor
from steadyrl.config.guard_sections import GuardsSection
from steadyrl.evidence.interventions import Ledger
from steadyrl.guards import mismatch
from steadyrl.metrics import GRADE_BETA, GRADE_KL_FACTOR, GUARD_PART_GEPO_MISMATCH, GUARD_PART_QUATRO_REPLAY
from steadyrl.trainers import checkpoints, trl_state
from steadyrl.trainers.advantage_pipeline import AdvantagePipeline
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.context import Controls, RuntimeContext, SavedTogether, StepNotes, identity
from steadyrl.trainers.layers import GuardParts, guard_parts
from steadyrl.trainers.loss import LossStation
from steadyrl.trainers.micro_batch_gate import micro_batch_gate
from steadyrl.trainers.rollout import RolloutStation
from steadyrl.trainers.scratch import HookScratch
from steadyrl.trainers.step_end import StepEnd, _GuardClock, _RunSummary
from steadyrl.trainers.step_gate import StepGate
from steadyrl.trainers.vllm_support import server_errors

quatro_logger = logging.getLogger("steadyrl.quatro")


class SteadyGRPOTrainer(GRPOTrainer):
    """GRPO with steadyrl's guard layers. All arguments are ``trl.GRPOTrainer``'s, plus:

    guards: ``"all"`` (every layer at its shipped defaults), a ``GuardsSection`` or a dict shaped like the YAML
        ``guards:`` section (validated like it), or ``GuardParts`` built by hand (``steadyrl.trainers.layers``);
        None: plain TRL.
    """

    pipeline_class: type[AdvantagePipeline] = AdvantagePipeline

    def __init__(
        self, *args: Any, guards: GuardParts | GuardsSection | dict[str, Any] | str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        p = self.parts = guard_parts(guards)
        if p.kl_compensation is not None and (p.reward_processor is None or self.beta == 0.0):
            raise ValueError("kl_compensation needs a reward processor with kl_compensation() and beta > 0")
        self.beta_base, self.beta_factors = self.beta, {}
        self.scratch, self.notes = HookScratch(), StepNotes()
        self.ledger: Ledger | None = None  # the interventions ledger (set below when any guard part runs)
        acc = self.accelerator
        distributed = acc.num_processes > 1  # else accelerate's collectives return their input
        self.ctx = RuntimeContext(
            log_metric=self._guard_metric, emit_event=self.emit_event, gather_object=gather_object,
            reduce_sum=(lambda t: acc.reduce(t, reduction="sum")) if distributed else identity,
            gather=acc.gather if distributed else identity, global_step=lambda: self.state.global_step,
            rank=acc.process_index, processes=acc.num_processes, device=acc.device,
        )  # fmt: skip
        self.pipeline = self.pipeline_class(
            p.reward_processor, p.advantage_fn, self.scale_rewards, p.kl_compensation,
            observe_rewards="grade" in p.observe, observe_advantages="gepo" in p.observe,
        )  # fmt: skip
        q = p.quatro
        replay = q is not None and q.replay is not None and q.replay.enabled and "quatro" not in p.observe
        settings = trl_state.trainer_settings(self, replay) if q is not None else None
        active = p.any_step_guard or p.rewrites_advantages or self.pipeline.always or q is not None
        self.step_end = StepEnd(self.ctx, p, active, self.notes, settings)
        recovery, floor = self.step_end.recovery, self.step_end.entropy
        self.gate = StepGate(
            p.step_guards_in(observing=False), self.ctx, feedback=recovery.feedback if recovery is not None else None,
            observers=p.step_guards_in(observing=True), deepspeed=self.is_deepspeed_enabled, notes=self.notes,
            would=recovery.would if recovery is not None and recovery.observe else None,
        )  # fmt: skip
        self.micro_gate = micro_batch_gate(
            p.micro_batch_guard, "gepo" in p.observe, self.ctx, deepspeed=self.is_deepspeed_enabled,
            max_grad_norm=self.args.max_grad_norm, accumulation=self.args.gradient_accumulation_steps,
        )  # fmt: skip
        self.rollout = RolloutStation(self.ctx, p, self.pipeline, self.scratch, self.notes, settings, floor)
        self.loss_station = LossStation(self.ctx, p, self.scratch, self.notes, floor)
        self.lr_scale = trl_state.LearningRateScale()
        self.lr_factors: dict[str, float] = {}  # factors of the scheduled LR (OPEFO's recovery, the gold watch's)
        layers = [("reward_processor", p.reward_processor), ("advantage_fn", p.advantage_fn)]
        layers += [(f"step_guard_{i}", g) for i, g in enumerate(p.step_guards_in(observing=False))]
        layers += [(f"observe_step_guard_{i}", g) for i, g in enumerate(p.step_guards_in(observing=True))]
        layers.append(("opefo", recovery))  # policy, floor, would-counts; per rank: the error-feedback residual
        per_rank: dict[str, Any] = {"opefo": recovery, "micro_batch_gate": self.micro_gate}
        if q is not None:  # guard state: the controllers and the filters' history; rank files: the replay buffer
            objects = {"kl": self.step_end.kl, "entropy": floor, "filter": self.rollout.filter}
            missing = "the checkpoint has no QUATRO %s state: it starts fresh"
            layers.append(("quatro", SavedTogether(objects, missing, self.notes.forget_measurements)))
            if replay:  # each rank replays its own rows
                missing = "the checkpoint has no QUATRO %s buffer for this rank: it starts empty"
                per_rank["quatro"] = SavedTogether({"replay": self.rollout.replay}, missing)
        self.guard_state = GuardState.register(layers, p.stateful, self.gate.counters, per_rank=per_rank)
        guarded = active or p.finite_checks or p.opefo is not None
        self.ledger = Ledger(self.gate.counters, self.beta_base, p.observe) if guarded else None
        if p.kl_compensation is not None or q is not None:  # factors of beta set between steps: checkpointed
            self.guard_state.stateful.setdefault("beta_factors", trl_state.BetaFactors(self))
        self._epsilon0: tuple[float, float] | None = None
        if q is not None:
            if floor is not None and not self.step_end.observe:  # observe mode: TRL's entropy term stays as set
                self._epsilon0 = trl_state.enable_entropy_term(self)
            self.apply_controls()
        # First in line: guards act on a finished step before any other callback (logging, user code) sees it.
        self.callback_handler.callbacks.insert(0, _GuardClock(self))
        self._summary = _RunSummary(self)  # last of the guard callbacks: the run's ledger after every guard acted
        self.add_callback(self._summary)
        if p.monitor is not None and not any(isinstance(c, SignalMonitor) for c in self.callback_handler.callbacks):
            self.add_guard_callback(SignalMonitor(p.monitor))  # guards= from Python turns the early warnings on too
        self.gold_watch = self._trl_eval_gold_watch()

    def _trl_eval_gold_watch(self) -> Any:
        """With TRL's own eval (``eval_strategy`` and an eval dataset) and the gold watch on: the watch, reading TRL's
        ``eval_rewards/<gold>/mean`` (steadyrl's YAML path replaces it by one on its periodic eval). None otherwise."""
        from transformers.trainer_utils import IntervalStrategy

        from steadyrl.callbacks.gold_watch import GoldWatch
        from steadyrl.trainers.gold import trl_eval_metric

        q = self.parts.quatro
        trl_eval = self.args.eval_strategy != IntervalStrategy.NO and self.eval_dataset is not None
        if q is None or q.gold is None or not trl_eval:
            return None
        weights = [float(w) for w in self.reward_weights]
        metric, why = trl_eval_metric(q.gold, list(self.reward_func_names), weights)
        if metric is None:
            if self.accelerator.is_main_process:
                quatro_logger.warning("TRL's eval runs, but %s; the gold watch is off", why)
            return None
        prompts = len(self.eval_dataset) if hasattr(self.eval_dataset, "__len__") else 0
        watch = GoldWatch(q.gold, self, observe="quatro" in self.parts.observe, metric=metric, eval_prompts=prompts)
        self.add_guard_callback(watch)
        self.guard_state.stateful["gold"] = watch
        return watch

    def add_guard_callback(self, callback: Any) -> None:
        """Add a callback of steadyrl's own (periodic eval, gold watch, monitor) before the run summary, so that what
        it does at train end is in ``interventions.json``."""
        callbacks = self.callback_handler.callbacks
        callbacks.insert(callbacks.index(self._summary), callback)

    def apply_controls(self, controls: Controls | None = None) -> None:
        """Write the controllers' output (default: their current one) into TRL's beta, entropy_coef and clip range."""
        trl_state.apply_controls(self, self.step_end.controls() if controls is None else controls, self._epsilon0)

    @property
    def steady_counters(self) -> dict[str, float]:
        """The step gate's skip counters (saved in every checkpoint)."""
        return self.gate.counters

    def emit_event(self, kind: str, step: int | None = None, **fields: Any) -> None:
        """A discrete event (skip, rollback, ...) for callbacks that record them (``MetricsLog.event``); ``step``:
        the optimizer step it belongs to, numbered like the log rows (default ``global_step``)."""
        for callback in self.callback_handler.callbacks:
            if callable(getattr(callback, "event", None)):
                callback.event(self.state.global_step if step is None else step, kind, **fields)

    def _guard_metric(self, name: str, value: float) -> None:
        """Averaged over the logging interval and logged with TRL's own metrics (report_to sees them)."""
        self._metrics["train" if self.model.training else "eval"][name].append(value)
        if self.ledger is not None and self.model.training:
            self.ledger.see(name, value)

    def close_ledger_step(self) -> None:
        """End the optimizer step in the interventions ledger and log its per-kind flags."""
        if self.ledger is not None:
            for name, value in self.ledger.close().items():
                self._metrics["train"][name].append(value)

    # ------------------------------------------------------------------ station 1: rewards -> advantages

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.rollout.on_rewards(
            rewards_per_func, prompts, completion_ids_list, self.reward_weights, self.model.training
        )
        return rewards_per_func

    def _prepare_inputs(self, generation_batch):
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self.rollout.replay_on(self.model.training) or self._buffered_inputs is buffered:
            return inputs  # no replay, or TRL served a micro-batch it had buffered (already mixed)
        # TRL just generated and split a generation batch: mix each of its micro-batches with replayed rows.
        step = self.state.global_step
        return trl_state.mix_buffered_inputs(self, lambda fresh: self.rollout.mix(fresh, step), inputs)

    def _generate_and_score_completions(self, inputs):
        server = self.use_vllm and self.vllm_mode == "server"  # a server gone mid-run: named, with the checkpoint
        with server_errors(self.args, self.state.global_step + 1) if server else contextlib.nullcontext():
            output = super()._generate_and_score_completions(inputs)
        training = self.model.training
        if self.rollout.replay_on(training):
            with self.ctx.timer(GUARD_PART_QUATRO_REPLAY):
                trl_state.ensure_sampling_logps(self, output)  # replayed rows need their sampling log-probs
        if training and self.parts.mismatch is not None:
            self._measure_mismatch(output)
        num_generations = self.num_generations if training else self.num_generations_eval
        kl_factor = self.rollout.on_scored(output, len(inputs), self.reward_weights, num_generations, training)
        if kl_factor is not None:
            with self.ctx.timer("grade"):
                trl_state.set_beta_factor(self, "grade", kl_factor)
                self.ctx.log_metrics({GRADE_KL_FACTOR: kl_factor, GRADE_BETA: self.beta})
        return output

    def _measure_mismatch(self, output: dict[str, Any]) -> None:
        """``mismatch/*`` of the generation batch (vLLM with TRL's correction on; ``steadyrl.guards.mismatch``),
        the same on every rank; the ESS gate reads it for the steps this batch trains."""
        rows = mismatch.log_ratio_rows(output)
        if rows is None:
            return
        with self.ctx.timer(GUARD_PART_GEPO_MISMATCH):
            args = self.args
            sampling = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
            found = mismatch.measure(
                rows, args.vllm_importance_sampling_mode,
                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max,
                self.ctx.gather, self.ctx.processes, self.ctx.rank, mismatch.truncation_band(sampling, trl.__version__),
            )  # fmt: skip
        self.ctx.log_metrics(found)
        for guard in self.parts.step_guards:
            if isinstance(guard, mismatch.MismatchGate):
                guard.note(found.get(mismatch.PREFIX + "ess"))

    # ------------------------------------------------------------------ station 2: the loss

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        with self.ctx.timer("checks"):  # the checks and the floor on every log-prob forward are guard cost too
            return self.loss_station.on_logps(logps), entropies, aux_loss

    def _compute_loss(self, model, inputs):
        if not self.loss_station.wraps:
            return super()._compute_loss(model, inputs)
        training, replay = self.model.training, self.rollout.replay_on(self.model.training)
        advantages = self.loss_station.before(inputs, replay, training)
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            logps = self.loss_station.restore(inputs, advantages)
        kl_entropy = trl_state.logged_kl_and_entropy(self) if self.parts.quatro is not None else (math.nan, math.nan)
        with self.ctx.timer("checks"):  # QUATRO's per-micro-batch measurements and the loss's finite check
            return self.loss_station.after(loss, inputs, logps, kl_entropy, replay, training)

    # ------------------------------------------------------------------ station 3: skip or clip

    def training_step(self, model, inputs, num_items_in_batch):
        """Per-micro-batch decision (``MicroBatchGate``) around TRL's step; otherwise TRL's step unchanged."""
        if self.micro_gate is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # Under DDP every micro-batch's backward stays local; MicroBatchGate.finish all-reduces the kept ones.
        sync = self.accelerator.no_sync(model) if self.accelerator.num_processes > 1 else contextlib.nullcontext()
        with self.micro_gate.around_backward(model, sync):
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model):
        norm, skipped = self.gate.gate_step(model, self.optimizer, self.args.max_grad_norm, self.micro_gate)
        if norm is None:  # no gate here (DeepSpeed: it ran inside engine.step; this returns the engine's norm)
            return super()._clip_grad_norm(model)
        self.scratch.vetoed_step = skipped  # the Trainer then leaves the LR schedule alone, as for an fp16 overflow
        trl_state.mark_step_skipped(self.optimizer, skipped)
        return norm

    # ------------------------------------------------------------------ checkpoints

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
                error, self.scratch.save_error = self.scratch.save_error, None
            if error is not None:  # save_only_model: no optimizer save agreed on it
                raise error
            rollouts = {"step": self._step, "buffered_inputs": self._buffered_inputs}
            checkpoints.save_steady_state(folder, self.guard_state, rollouts, acc.process_index, acc.is_main_process)

        run_dir = Path(super()._get_output_dir(trial))
        checkpoints.save_atomically(acc, run_dir, self.state.global_step, self.args.save_total_limit, write)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Inside a checkpoint under DeepSpeed, a failed model write (the main process's) is kept for
        ``_save_optimizer_and_scheduler`` instead of raised: the other ranks would wait in DeepSpeed's save."""
        if self.scratch.staging_dir is None or not self.is_deepspeed_enabled:
            return super().save_model(output_dir, _internal_call)
        try:
            super().save_model(output_dir, _internal_call)
        except checkpoints.SAVE_ERRORS as exc:
            self.scratch.save_error = exc

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Inside a checkpoint under DeepSpeed, every rank agrees on the model write before DeepSpeed's own save, and
        on DeepSpeed's writes after it (a write that fails inside it is held until its collectives are done)."""
        if self.scratch.staging_dir is None or not self.is_deepspeed_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        error, self.scratch.save_error = self.scratch.save_error, None
        checkpoints.agree_before_collectives(self.accelerator, error)  # before DeepSpeed's save_checkpoint
        with checkpoints.deepspeed_writes_held(self.model_wrapped) as held:
            super()._save_optimizer_and_scheduler(output_dir)
        checkpoints.agree_before_collectives(self.accelerator, held[0] if held else None)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            load_steady_state(self, Path(checkpoint))


def load_steady_state(trainer: SteadyGRPOTrainer, folder: Path) -> None:
    """steadyrl's part of a checkpoint into a trainer: guard state, counters, this rank's rollout buffer."""
    acc = trainer.accelerator
    rollouts = checkpoints.load_steady_state(
        Path(folder), trainer.guard_state, acc.process_index, acc.device, acc.num_processes
    )
    trl_state.restore_rollouts(trainer, rollouts)
    if trainer.parts.quatro is not None:
        trainer.apply_controls()  # the restored controllers' values
