"""Every TRL / transformers method that steadyrl overrides, with the signature it was written against.

TRL's trainers change their private methods between releases. steadyrl pins ``trl`` to the tested minor
release and keeps this list; ``tests/unit/test_hooks.py`` asserts each entry still exists with exactly this
signature, so a TRL upgrade that moves a hook fails loudly in CI instead of silently bypassing a guard.

How each is overridden (never by copying the body):
- ``_calculate_rewards``: call the parent, keep the gathered reward matrix for the reward processor.
- ``_generate_and_score_completions``: call the parent, replace ``advantages`` in its output when a reward
  processor or advantage function is set; with QUATRO replay, add ``old_per_token_logps`` where TRL left them out.
- ``_prepare_inputs``: call the parent; when it generated (``_buffered_inputs`` is a new list), replace its
  buffered micro-batches with QUATRO's replay mix and return the mixed counterpart of the one it returned.
- ``_clip_grad_norm``: under fp16's GradScaler unscale first (as the parent's clipping does), compute the global
  pre-clip norm, ask the step guards, then clip or skip.
- ``training_step`` (only with ``guards.gepo.spike.granularity: micro_batch``): copy the accumulated gradients,
  call the parent (under DDP inside ``no_sync``), judge the micro-batch's own gradient and drop it on a veto
  (``MicroBatchGate``); ``_clip_grad_norm`` then averages the kept ones (all-reduced under DDP) before deciding.
  Relied on: the Trainer calls ``_clip_grad_norm`` once per optimizer step, after the last backward pass, whenever
  ``max_grad_norm > 0``.
- ``_get_per_token_logps_and_entropies``: call the parent, clamp log-probs at ``logprob_min`` (when set) and
  count non-finite ones; a -inf log-prob would otherwise turn the ratio and the KL into NaN.
- ``_compute_loss``: call the parent with the inputs marked, so the log-prob hook counts non-finite importance
  ratios of that loss and keeps its policy log-probs; count a non-finite loss (the step guard then skips the step
  it would poison); hand TRL's just-logged ``kl`` / ``entropy`` of the micro-batch to QUATRO's controllers, and the
  policy log-probs to QUATRO's replay metrics.
- ``_save_checkpoint`` / ``_load_optimizer_and_scheduler``: call the parent, then save / load guard state.
  ``_save_checkpoint`` makes the parent write into a staging folder (``_get_output_dir`` answers the staging
  root while it runs) and publishes the finished checkpoint with one rename.

``SteadyPPOTrainer`` (``steadyrl.trainers.ppo``) overrides, on top of the above (``PPO_HOOKED_METHODS``):
- ``_generate_and_score_completions``: call the parent (whose ``compute_advantages`` returns sequence rewards for
  PPO), then replace ``advantages`` with (B, T) GAE advantages and add ``old_values`` / ``returns``.
- ``_compute_loss``: call the parent with ``self.beta`` set to 0 (no KL term in the loss) inside
  ``PolicyAndValue.computing_values``, then add the clipped value loss.
- ``_clip_grad_norm``: log the policy's and the critic's gradient norms apart, then call the parent.
- ``create_optimizer``: call the parent, move the critic's parameters into their own groups (``ppo.critic_lr``).
- ``_save`` / ``_load_from_checkpoint``: call the parent on the bare policy, then save / load ``critic.safetensors``.
PPO relies on these TRL details (``ppo_internals_problems`` checks them): ``_compute_loss`` unsqueezes only 1-D
advantages (so (B, T) advantages pass through) and adds the KL term only ``if self.beta != 0.0``, read at call time;
``_generate_and_score_completions`` computes ``ref_per_token_logps`` when ``self.beta != 0.0``.

Private details of TRL, accelerate and DeepSpeed are relied on as well (``internals_problems`` checks them):
- TRL ``GRPOTrainer``: ``_prepare_inputs`` assigns a new ``_buffered_inputs`` list exactly when it generates, and
  serves ``_buffered_inputs[i]``; ``_compute_loss`` reads ``inputs["old_per_token_logps"]`` when present (QUATRO
  replay relies on both). ``_entropy_bonus_enabled`` is fixed in ``__init__`` and gates the entropy term in
  ``_compute_loss``, which reads ``self.entropy_coef`` and clamps with ``self.epsilon_low/high`` on every call;
  QUATRO's entropy floor switches the flag on and rewrites the three attributes between steps. ``_metrics["train"]``
  gets one ``kl`` (when beta != 0) and one ``entropy`` entry per micro-batch.
- ``AcceleratedOptimizer._is_overflow`` is what ``accelerator.optimizer_step_was_skipped`` reports; a vetoed
  step sets it so the Trainer leaves the LR schedule alone (as for an fp16 overflow).
- ``DeepSpeedZeroOptimizer.step`` (ZeRO-1/2) calls ``scaled_global_norm()``, then ``_update_scale(overflow)``,
  then returns early ``if self.overflow``; the step guards are installed on the first two
  (``steadyrl.trainers.step_gate.StepGate.install_deepspeed``).
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
    """Hooked methods of ``trainer_cls``'s TRL parents that are missing or whose signature changed.

    ``hooked``: name -> expected signature; default ``HOOKED_METHODS`` (``PPO_HOOKED_METHODS`` for the PPO trainer).
    """
    problems = []
    for name, expected in (HOOKED_METHODS if hooked is None else hooked).items():
        method = None
        for klass in trainer_cls.__mro__:
            if klass.__module__.startswith("steadyrl"):
                continue
            if name in vars(klass):
                method = vars(klass)[name]
                break
        if method is None:
            problems.append(f"{name}: no longer defined by any TRL/transformers parent of {trainer_cls.__name__}")
            continue
        actual = str(inspect.signature(method))
        if actual != expected:
            problems.append(f"{name}: signature is {actual}, steadyrl was written against {expected}")
    return problems


def internals_problems() -> list[str]:
    """The accelerate / DeepSpeed internals above that are missing or no longer behave as relied on."""
    from accelerate.optimizer import AcceleratedOptimizer

    problems = _trl_problems()
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


def _trl_problems() -> list[str]:
    """TRL internals QUATRO's entropy floor and KL controller rely on (see the module docstring)."""
    from trl import GRPOTrainer

    problems = []
    init, loss = inspect.getsource(GRPOTrainer.__init__), inspect.getsource(GRPOTrainer._compute_loss)
    if "self._entropy_bonus_enabled =" not in init:
        problems.append("trl: GRPOTrainer.__init__ no longer sets _entropy_bonus_enabled")
    prepare = inspect.getsource(GRPOTrainer._prepare_inputs)
    for text in ("self._buffered_inputs = [", "inputs = self._buffered_inputs["):
        if text not in prepare:
            problems.append(f"trl: GRPOTrainer._prepare_inputs no longer contains {text!r}")
    expected = [
        'old_per_token_logps = inputs.get("old_per_token_logps")',
        "if self._entropy_bonus_enabled:",
        "apply_coef = self.entropy_coef",
        "torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)",
        'self._metrics[mode]["kl"].append(',
        'self._metrics[mode]["entropy"].append(',
    ]
    for text in expected:
        if text not in loss:
            problems.append(f"trl: GRPOTrainer._compute_loss no longer contains {text!r}")
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
