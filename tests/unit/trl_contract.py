"""The contract with TRL, checked in CI: every TRL / transformers method steadyrl overrides (``PPO_HOOKED_METHODS``:
``SteadyPPOTrainer``'s), with the signature it was written against, and the private details of TRL, accelerate and
DeepSpeed it relies on. ``test_hooks.py`` and ``test_ppo_hooks.py`` check both (``internals_problems``), so a TRL
upgrade that moves one fails in CI.

Relied on: TRL's ``_prepare_inputs`` assigns a new ``_buffered_inputs`` list exactly when it generates and serves
``_buffered_inputs[_step % steps_per_generation]``, micro-batches whose ``completion_ids`` have a row per completion (a
resumed buffer of another layout is dropped, ``trl_state.restore_rollouts``); ``_compute_loss`` reads
``inputs["old_per_token_logps"]`` when present, unsqueezes only 1-D advantages, adds the KL term only ``if self.beta !=
0.0`` and reads ``entropy_coef`` / ``epsilon_low/high`` on every call; ``_entropy_bonus_enabled`` is fixed in
``__init__``; ``_metrics["train"]`` gets one ``kl`` (beta != 0) and one ``entropy`` entry per micro-batch; the Trainer
calls ``_clip_grad_norm`` once per optimizer step, after the last backward, whenever ``max_grad_norm > 0``. accelerate's
``AcceleratedOptimizer._is_overflow`` is what ``optimizer_step_was_skipped`` reports. DeepSpeed's
``DeepSpeedZeroOptimizer.step`` calls ``scaled_global_norm()``, then ``_update_scale(overflow)``, then returns early
``if self.overflow`` (``StepGate.install_deepspeed``). The Trainer's ``_save_checkpoint`` calls ``save_model`` before
``_save_optimizer_and_scheduler``, which under DeepSpeed runs the engine's ``save_checkpoint`` (every rank).
"""

from __future__ import annotations

import importlib.util
import inspect

TESTED_TRL = "1.16"

HOOKED_METHODS: dict[str, str] = {
    "_calculate_rewards": "(self, inputs, prompts, completions, completion_ids_list)",
    "_generate_and_score_completions": (
        "(self, inputs: list[dict[str, torch.Tensor | typing.Any]]) -> dict[str, torch.Tensor | typing.Any]"
    ),
    "_prepare_inputs": (
        "(self, generation_batch: dict[str, torch.Tensor | typing.Any]) -> dict[str, torch.Tensor | typing.Any]"
    ),
    "_clip_grad_norm": "(self, model)",
    "training_step": "(self, model, inputs, num_items_in_batch)",
    "_get_per_token_logps_and_entropies": (
        "(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, "
        "compute_aux_loss=False, pixel_values=None, image_grid_thw=None, num_images=None, pixel_attention_mask=None, "
        "spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None, mm_token_type_ids=None, "
        "image_position_ids=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]"
    ),
    "_compute_loss": "(self, model, inputs)",
    "_get_output_dir": "(self, trial: 'optuna.Trial | dict[str, Any] | None') -> str",
    "_save_checkpoint": "(self, model, trial)",
    # inside a checkpoint under DeepSpeed: the model write, then DeepSpeed's save_checkpoint (a collective)
    "save_model": "(self, output_dir: str | None = None, _internal_call: bool = False) -> None",
    "_save_optimizer_and_scheduler": "(self, output_dir: str) -> None",
    "_load_optimizer_and_scheduler": "(self, checkpoint)",
}


PPO_HOOKED_METHODS: dict[str, str] = {
    "_generate_and_score_completions": HOOKED_METHODS["_generate_and_score_completions"],
    "_compute_loss": HOOKED_METHODS["_compute_loss"],
    "_clip_grad_norm": HOOKED_METHODS["_clip_grad_norm"],
    "create_optimizer": "(self, model=None) -> torch.optim.optimizer.Optimizer",
    "_save": "(self, output_dir: str | None = None, state_dict: dict | None = None) -> None",
    "_load_from_checkpoint": (
        "(self, resume_from_checkpoint: str, model: torch.nn.modules.module.Module | None = None) -> None"
    ),
}


def hook_signature_mismatches(trainer_cls: type, hooked: dict[str, str] | None = None) -> list[str]:
    """Hooked methods (``hooked``: name -> signature, default ``HOOKED_METHODS``) of ``trainer_cls``'s TRL parents
    that are missing or whose signature changed."""
    problems = []
    for name, expected in (HOOKED_METHODS if hooked is None else hooked).items():
        parents = [k for k in trainer_cls.__mro__ if not k.__module__.startswith("steadyrl") and name in vars(k)]
        method = vars(parents[0])[name] if parents else None
        if method is None:
            problems.append(f"{name}: no longer defined by any TRL/transformers parent of {trainer_cls.__name__}")
            continue
        actual = str(inspect.signature(method))
        if actual != expected:
            problems.append(f"{name}: signature is {actual}, steadyrl was written against {expected}")
    return problems


def internals_problems() -> list[str]:
    """The TRL / accelerate / DeepSpeed internals above that are missing or no longer behave as relied on."""
    from accelerate.optimizer import AcceleratedOptimizer
    from trl import GRPOTrainer

    problems = []  # first the TRL internals QUATRO's entropy floor and KL controller rely on
    init, loss = inspect.getsource(GRPOTrainer.__init__), inspect.getsource(GRPOTrainer._compute_loss)
    if "self._entropy_bonus_enabled =" not in init:
        problems.append("trl: GRPOTrainer.__init__ no longer sets _entropy_bonus_enabled")
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    for text in (
        "self._buffered_inputs = [",
        "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]",
    ):
        if text not in prepare:
            problems.append(f"trl: GRPOTrainer._prepare_inputs no longer contains {text!r}")
    if '"completion_ids": completion_ids,' not in inspect.getsource(GRPOTrainer._generate_and_score_completions):
        problems.append("trl: GRPOTrainer._generate_and_score_completions no longer returns completion_ids")
    for text in (
        'old_per_token_logps = inputs.get("old_per_token_logps")',
        "if self._entropy_bonus_enabled:",
        "apply_coef = self.entropy_coef",
        "torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)",
        'self._metrics[mode]["kl"].append(',
        'self._metrics[mode]["entropy"].append(',
    ):
        if text not in loss:
            problems.append(f"trl: GRPOTrainer._compute_loss no longer contains {text!r}")
    if "self._is_overflow" not in inspect.getsource(AcceleratedOptimizer.__init__):
        problems.append("accelerate: AcceleratedOptimizer no longer sets _is_overflow")
    if "return self._is_overflow" not in inspect.getsource(AcceleratedOptimizer.step_was_skipped.fget):
        problems.append("accelerate: step_was_skipped no longer reports _is_overflow")
    if importlib.util.find_spec("deepspeed") is None:
        return problems
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Zero

    expected = {"scaled_global_norm": "(self, norm_type=2)", "_update_scale": "(self, has_overflow=False)"}
    for name, signature in expected.items():
        actual = str(inspect.signature(getattr(Zero, name))) if hasattr(Zero, name) else "missing"
        if actual != signature:
            problems.append(f"deepspeed: DeepSpeedZeroOptimizer.{name} is {actual}, expected {signature}")
    if "self.averaged_gradients[i]" not in inspect.getsource(Zero.scaled_global_norm):
        problems.append("deepspeed: the gradient partition is no longer in DeepSpeedZeroOptimizer.averaged_gradients")
    step = inspect.getsource(Zero.step)
    order = ["self.scaled_global_norm()", "self._update_scale(self.overflow)", "if self.overflow:"]
    positions = [step.find(s) for s in order]
    if -1 in positions or positions != sorted(positions):
        problems.append(f"deepspeed: DeepSpeedZeroOptimizer.step no longer runs {' -> '.join(order)} in that order")
    return problems


def ppo_internals_problems() -> list[str]:
    """The TRL details ``SteadyPPOTrainer`` relies on (see the module docstring) that are missing."""
    from trl import GRPOTrainer

    problems = []
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    rollout = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    for text in ("if advantages.dim() == 1:", "if self.beta != 0.0:", "per_token_loss = per_token_loss + self.beta"):
        if text not in loss:
            problems.append(f"trl: GRPOTrainer._compute_loss no longer contains {text!r}")
    if "if self.beta != 0.0:" not in rollout or "ref_per_token_logps" not in rollout:
        problems.append("trl: GRPOTrainer._generate_and_score_completions no longer gates reference log-probs on beta")
    return problems
