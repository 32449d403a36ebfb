"""The only place where the guard layers' decisions are written into TRL's trainer state (or read from TRL's
private state); the stations return what should change. Why writing these attributes between steps is safe is in
``tests/unit/trl_contract.py`` (``internals_problems`` checks it).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from steadyrl.metrics import OPEFO_LR_FACTOR
from steadyrl.trainers.context import Controls, TrainerSettings

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def kl_out_of_loss(trainer: Any) -> Iterator[None]:
    """PPO: TRL adds ``beta * kl`` to the loss when ``trainer.beta != 0``, but PPO's KL is in the reward: 0 for the
    duration; on exit ``beta_base x`` every factor again (the rollout and the reward placement read it)."""
    trainer.beta = 0.0
    try:
        yield
    finally:
        trainer.beta = trainer.beta_base * math.prod(trainer.beta_factors.values())


def mix_buffered_inputs(trainer: Any, mix: Callable[[list[Any]], list[Any]], served: Any) -> Any:
    """Replay: TRL's just-buffered micro-batches -> ``mix(them)``; returns the mixed one of the ``served`` one."""
    fresh = trainer._buffered_inputs
    trainer._buffered_inputs = mix(fresh)
    return trainer._buffered_inputs[next(i for i, batch in enumerate(fresh) if batch is served)]


def buffer_layout(buffered: list[dict[str, Any]]) -> tuple[int, int]:
    """(micro-batches, rows of the first) of TRL's rollout buffer."""
    return len(buffered), int(buffered[0]["completion_ids"].shape[0]) if buffered else 0


def restore_rollouts(trainer: Any, rollouts: dict[str, Any] | None) -> None:
    """A checkpoint's rollout buffer and micro-step counter back into TRL (None: the checkpoint had none). A buffer
    cut for another batch layout (``steps_per_generation`` micro-batches of ``per_device_train_batch_size`` rows,
    the same on every rank) is dropped with a warning: TRL generates afresh, as after a resume without one."""
    if rollouts is None:
        return
    buffered = rollouts["buffered_inputs"]
    if buffered is not None:
        found = buffer_layout(buffered)
        expected = (trainer.args.steps_per_generation, trainer.args.per_device_train_batch_size)
        if found != expected:
            if trainer.accelerator.is_main_process:
                logger.warning(
                    "the checkpoint's rollouts not yet trained on are %d micro-batch(es) of %d rows and this run has "
                    "steps_per_generation=%d micro-batches of per_device_train_batch_size=%d: they are dropped and "
                    "generated afresh (resume with the checkpoint's batch settings to resume exactly)",
                    *found, *expected,
                )  # fmt: skip
            return
    trainer._step, trainer._buffered_inputs = rollouts["step"], buffered


def set_beta_factor(trainer: Any, name: str, value: float) -> None:
    """One factor of the KL coefficient (GRADE, the KL controller): ``trainer.beta = beta_base x`` every factor."""
    trainer.beta_factors[name] = value
    trainer.beta = trainer.beta_base * math.prod(trainer.beta_factors.values())


class BetaFactors:
    """Every factor of the KL coefficient as guard state (``beta_factors``): a resume inside a generation window
    trains on its batch again without recomputing GRADE's factor. The gold watch's factor is left out: the watch's
    own state restores it, and an OPEFO rollback (which restores this state) must not undo it."""

    OWNED_ELSEWHERE = ("gold",)

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"factors": {k: v for k, v in self.trainer.beta_factors.items() if k not in self.OWNED_ELSEWHERE}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state["factors"].items():
            set_beta_factor(self.trainer, name, float(value))


def trainer_settings(trainer: Any, replay: bool) -> TrainerSettings:
    """The trainer settings the stations read once (``replay``: the tokenizer's pad id is needed)."""
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    pad = tokenizer.pad_token_id if replay and tokenizer.pad_token_id is not None else 0
    kl_from_rollouts, names = bool(getattr(trainer, "kl_in_reward", False)), getattr(trainer, "reward_func_names", ())
    return TrainerSettings(trainer.beta_base, int(trainer.args.seed), pad, trainer.loss_type, trainer.entropy_coef,
                           trainer.use_adaptive_entropy, kl_from_rollouts, tuple(names))  # fmt: skip


def enable_entropy_term(trainer: Any) -> tuple[float, float]:
    """Switch TRL's entropy term on (the floor drives its coefficient); returns the clip range the floor scales."""
    trainer._entropy_bonus_enabled = True
    return float(trainer.epsilon_low), float(trainer.epsilon_high)


def apply_controls(trainer: Any, controls: Controls, epsilon0: tuple[float, float] | None) -> None:
    """The controllers' output into TRL: the ``quatro_kl`` factor of beta, ``entropy_coef``, ``epsilon_low/high``."""
    if controls.kl_factor is not None:
        set_beta_factor(trainer, "quatro_kl", controls.kl_factor)
    if controls.entropy_coef is not None:
        trainer.entropy_coef = controls.entropy_coef
    if controls.clip_scale is not None and epsilon0 is not None:
        trainer.epsilon_low, trainer.epsilon_high = (e * controls.clip_scale for e in epsilon0)


def logged_kl_and_entropy(trainer: Any) -> tuple[float, float]:
    """TRL's just-logged ``kl`` and ``entropy`` of the last training micro-batch (NaN where it logged none)."""
    metrics = trainer._metrics["train"]
    kl = metrics["kl"][-1] if trainer.beta != 0.0 and metrics.get("kl") else math.nan
    entropy = metrics["entropy"][-1] if metrics.get("entropy") else math.nan
    return float(kl), float(entropy)


def ensure_sampling_logps(trainer: Any, output: dict[str, Any]) -> None:
    """Give a scored generation batch (before any update: the model is the sampling policy) its
    ``old_per_token_logps`` where TRL left them out, by the call TRL makes when it computes them itself."""
    if output.get("old_per_token_logps") is not None:
        return
    from trl.models.utils import disable_gradient_checkpointing

    completion_ids = output["completion_ids"]
    input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, completion_ids.size(1),
            batch_size=trainer.args.per_device_train_batch_size,
        )  # fmt: skip
    output["old_per_token_logps"] = logps


class LearningRateScale:
    """OPEFO's recovery factor on top of the LR schedule (the schedule itself runs on unchanged)."""

    def __init__(self) -> None:
        self._scaled: list[float] | None = None
        self._last_factor = 1.0

    def apply(self, param_groups: list[dict[str, Any]], factor: float) -> bool:
        """Scale the LR the schedule just set by ``factor``; True when it wrote the param groups. Never compounds:
        a ``lr`` the schedule left untouched (still the one set here) is un-scaled first."""
        current = [g["lr"] for g in param_groups]
        if self._scaled is not None:
            mine = zip(current, self._scaled, strict=True)
            current = [lr / self._last_factor if lr == scaled else lr for lr, scaled in mine]
        if factor == 1.0 and self._scaled is None:
            return False
        for g, lr in zip(param_groups, current, strict=True):
            g["lr"] = lr * factor
        self._scaled = None if factor == 1.0 else [g["lr"] for g in param_groups]
        self._last_factor = factor
        return True


def mark_step_skipped(optimizer: Any, skipped: bool) -> None:
    """Tell the Trainer whether the step was skipped (``_is_overflow``), so it leaves the LR schedule alone; under a
    GradScaler ``optimizer.step()`` rewrites the flag and ``_GuardClock.on_optimizer_step`` sets it again."""
    if hasattr(optimizer, "_is_overflow") and (skipped or getattr(optimizer, "scaler", None) is None):
        optimizer._is_overflow = skipped


def apply_lr_factors(trainer: Any, opefo: float | None = None) -> None:
    """The one writer of the learning rate on top of the schedule: the product of ``trainer.lr_factors`` (OPEFO's
    recovery factor, set here from ``opefo`` when given, and the gold watch's factor) into the optimizer's param
    groups, after the schedule wrote them; a DeepSpeed ``scheduler`` block rewrites them every step, so every step end
    writes again. Logs ``opefo/lr_factor`` when OPEFO's factor was given and the groups were written."""
    factors = trainer.lr_factors
    if opefo is not None:
        factors["opefo"] = opefo
    if not factors:
        return
    if trainer.lr_scale.apply(trainer.optimizer.param_groups, math.prod(factors.values())) and opefo is not None:
        trainer._guard_metric(OPEFO_LR_FACTOR, opefo)


def set_gold_factors(trainer: Any, lr_factor: float, beta_factor: float, now: bool) -> None:
    """The gold watch's tightening: its factor of the learning rate (written into the param groups ``now``, else at
    the next step end: a resume's first step trains with the checkpoint's groups, already scaled) and of beta (when
    beta > 0)."""
    if lr_factor != 1.0 or "gold" in trainer.lr_factors:
        trainer.lr_factors["gold"] = lr_factor
        if now:
            apply_lr_factors(trainer)
    if trainer.beta_base > 0 and (beta_factor != 1.0 or "gold" in trainer.beta_factors):
        set_beta_factor(trainer, "gold", beta_factor)


def drop_buffered_rollouts(trainer: Any) -> None:
    """After the policy was restored: TRL's rollouts not yet trained on (sampled from the policy just left) go, so
    the step generates afresh from the restored one; so do the replay buffer's rows."""
    trainer._buffered_inputs = None
    replay = getattr(getattr(trainer, "rollout", None), "replay", None)
    if replay is not None:
        replay.clear()
