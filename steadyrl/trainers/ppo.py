"""SteadyPPOTrainer: PPO with a critic and GAE on TRL's GRPO rollout machinery (generation, rewards, reference).

docs/DESIGN.md, "PPO: critic, rewards and GAE". ``_add_gae`` turns each completion's *sequence reward* into GAE
advantages (B, T), with the per-token KL penalty in the reward; ``_compute_loss`` runs TRL's loss with beta 0 inside
``PolicyAndValue.computing_values`` and adds ``vf_coef * clipped_value_loss``. The critic is saved as
``critic.safetensors``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from trl.trainer.utils import disable_dropout_in_model

from steadyrl import metrics
from steadyrl.config.schema import PPOSection
from steadyrl.guards.optimizer_state import UNBRAKED_GROUP
from steadyrl.ppo.gae import clipped_value_loss, gae, get_kl_estimator, place_rewards, soft_clip, whiten
from steadyrl.ppo.value import CriticModel
from steadyrl.ppo.wrapper import CRITIC_FILE, PolicyAndValue
from steadyrl.trainers import trl_state
from steadyrl.trainers.advantage_pipeline import SequenceRewardPipeline
from steadyrl.trainers.grpo import SteadyGRPOTrainer
from steadyrl.trainers.reward_model import load_reward_stats
from steadyrl.trainers.rollout import loss_mask

logger = logging.getLogger(__name__)


class SteadyPPOTrainer(SteadyGRPOTrainer):
    """PPO: ``SteadyGRPOTrainer`` + a critic (``ppo``: ``PPOSection``; ``critic``: a ready ``CriticModel``). Pass a
    ``SteadyPPOConfig`` as ``args`` to allow ``num_generations=1``."""

    kl_in_reward = True  # QUATRO's KL controller reads the rollout's KL (record_rollout_kl), not TRL's loss-side kl
    # rewards -> *sequence rewards* (weighted sum, then GRADE; unscorable and filtered rows 0); GAE comes later
    pipeline_class = SequenceRewardPipeline

    def __init__(self, *args: Any, ppo: PPOSection | None = None, critic: CriticModel | None = None, **kwargs: Any):
        # a copy: PEFT rewrites target_modules ("all-linear" -> the causal LM's module names) when it wraps the policy
        peft_config = copy.deepcopy(kwargs.get("peft_config"))
        super().__init__(*args, **kwargs)
        self.ppo = ppo or PPOSection()
        self.kl_estimator = get_kl_estimator(self.ppo.kl_estimator)
        policy = self.model
        if critic is None:
            critic = self._load_critic(policy, peft_config)
        if self.args.disable_dropout:
            disable_dropout_in_model(critic)
        critic.to(self.accelerator.device)
        self.model = self.model_wrapped = PolicyAndValue(policy, critic)
        if self.args.ddp_find_unused_parameters:
            raise ValueError(
                "ddp_find_unused_parameters=True cannot work with PPO's critic (its values are not a forward output); "
                "every trainable parameter gets a gradient in every PPO step, so leave it unset"
            )
        # the accelerator's DDP settings were built from the bare policy; steadyrl.ppo.wrapper says why False
        self.args.ddp_find_unused_parameters = False
        if self.accelerator.ddp_handler is not None:
            self.accelerator.ddp_handler.find_unused_parameters = False

    def _load_critic(self, policy: torch.nn.Module, peft_config: Any) -> CriticModel:
        """``ppo.value_model`` or the policy's own weights; a LoRA policy gets a LoRA critic (same LoraConfig)."""
        source = self.ppo.value_model or policy.config._name_or_path
        init_kwargs = self.args.model_init_kwargs or {}  # the policy's files: same revision, same trust_remote_code
        model_kwargs = {k: v for k, v in init_kwargs.items() if k in ("dtype", "revision", "trust_remote_code")}
        model_kwargs.setdefault("trust_remote_code", self.args.trust_remote_code)
        stats_file = Path(source) / "reward_stats.json"
        stats = load_reward_stats(stats_file, source) if stats_file.is_file() else None
        critic_peft = None if peft_config is None else dataclasses.replace(peft_config, task_type=None)  # a backbone
        critic = CriticModel.from_pretrained(source, reward_stats=stats, peft_config=critic_peft, **model_kwargs)
        logger.info("PPO critic from %s (%s)", source, critic.init_source)
        return critic

    @property
    def policy_and_value(self) -> PolicyAndValue:
        """The ``PolicyAndValue`` module under any DDP / DeepSpeed wrapper."""
        return self.accelerator.unwrap_model(self.model)

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, the critic's parameters moved to groups of their own at ``ppo.critic_lr``."""
        optimizer = super().create_optimizer(model)
        critic_ids = {id(p) for p in self.policy_and_value.critic.parameters()}
        lr = self.ppo.critic_lr if self.ppo.critic_lr is not None else self.args.learning_rate
        critic_groups = []
        for group in optimizer.param_groups:
            mine = [p for p in group["params"] if id(p) in critic_ids]
            if mine:
                group["params"] = [p for p in group["params"] if id(p) not in critic_ids]
                kept = {k: v for k, v in group.items() if k != "params"}
                # UNBRAKED_GROUP: the entropy floor's brake_moments leaves the critic's Adam moments alone
                critic_groups.append({**kept, "params": mine, "lr": lr, UNBRAKED_GROUP: True})
        optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
        for group in critic_groups:
            optimizer.add_param_group(group)
        return optimizer

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The policy exactly as a plain run saves it, plus ``critic.safetensors`` (the whole critic's state)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        policy_state = None
        if state_dict is not None:  # DeepSpeed: the engine's state dict of the wrapper
            policy_state = {k.removeprefix("policy."): v for k, v in state_dict.items() if k.startswith("policy.")}
        model, self.model = self.model, self.policy_and_value.policy  # the policy saves in its own format
        try:
            super()._save(output_dir, state_dict=policy_state)
        finally:
            self.model = model
        if self.args.should_save:
            state = {k: v.detach().contiguous().cpu() for k, v in self.policy_and_value.critic.state_dict().items()}
            save_file(state, os.path.join(output_dir, CRITIC_FILE), metadata={"format": "pt"})

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The policy through the Trainer's own loader (full weights or adapter), then the critic's state."""
        wrapper = self.policy_and_value if model is None else self.accelerator.unwrap_model(model)
        if not isinstance(wrapper, PolicyAndValue):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        super()._load_from_checkpoint(resume_from_checkpoint, wrapper.policy)
        path = Path(resume_from_checkpoint) / CRITIC_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{resume_from_checkpoint} has no {CRITIC_FILE}: not a steadyrl PPO checkpoint")
        wrapper.critic.load_state_dict(load_file(str(path), device=str(self.accelerator.device)))

    def _clip_grad_norm(self, model):
        """Log the policy's and the critic's gradient norms apart, before any guard or clip touches them (not under
        DeepSpeed, whose partitions hold the gradients), then the parent's step decision and clipping."""
        if not self.is_deepspeed_enabled:
            wrapper = self.policy_and_value
            with self.ctx.timer("ppo"):  # steadyrl's cost (plain TRL has no such figure)
                self._guard_metric(metrics.PPO_POLICY_GRAD_NORM, _grad_norm(wrapper.policy.parameters()))
                self._guard_metric(metrics.PPO_CRITIC_GRAD_NORM, _grad_norm(wrapper.critic.parameters()))
        return super()._clip_grad_norm(model)

    def _global_mean_var(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, unbiased var) of ``x`` over the real tokens of every rank (all-reduced n, sum, sum of squares)."""
        real = mask.bool()
        xs = torch.where(real, x.double(), 0.0)
        local = torch.stack([real.sum().double(), xs.sum(), (xs * xs).sum()])
        n, total, squares = self.accelerator.reduce(local, reduction="sum")
        mean = total / n.clamp(min=1.0)
        var = (squares - n * mean * mean) / (n - 1.0).clamp(min=1.0)
        return mean.float(), var.clamp(min=0.0).float()

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # eval: the sequence reward as a flat advantage; a row with none gets 0
            output["advantages"] = torch.nan_to_num(output["advantages"], nan=0.0)
            return output
        with self.ctx.timer("ppo"):
            self._add_gae(output)
        return output

    @torch.no_grad()
    def _add_gae(self, output: dict[str, Any]) -> None:
        """Replace ``advantages`` (sequence rewards, (B,)) with whitened GAE advantages (B, T); add values, returns.
        A row whose sequence reward is NaN (unscorable, filtered) trains nothing: advantage 0, ``value_weight`` 0."""
        p = self.ppo
        seq_rewards = output["advantages"].float()
        trained = torch.isfinite(seq_rewards)
        seq_rewards = torch.where(trained, seq_rewards, 0.0)
        completion_ids = output["completion_ids"]
        token_mask = loss_mask(output)
        mask = token_mask * trained[:, None].to(token_mask.dtype)  # the tokens that train
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        width = completion_ids.size(1)
        # V(s_t): the critic's output at the position that predicts completion token t (as the logits are sliced)
        values = self.policy_and_value.critic(input_ids=input_ids, attention_mask=attention_mask)
        values = values[:, -(width + 1) : -1].float()
        kl = None
        ref = output.get("ref_per_token_logps")
        if ref is not None and self.beta != 0.0:
            logps = output.get("old_per_token_logps")
            if logps is None:  # TRL skips it when the rollout policy is the current one; the KL needs it
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, width, batch_size=self.args.per_device_train_batch_size
                )
            kl = self.kl_estimator(logps.float(), ref.float())
        token_rewards = place_rewards(seq_rewards, token_mask, kl, self.beta)
        advantages, returns = gae(token_rewards, values, token_mask, gamma=p.gamma, lam=p.lam)
        if p.whiten_advantages:
            advantages = whiten(advantages, mask, stats=self._global_mean_var(advantages, mask))
        advantages = advantages * mask  # rows that train nothing: advantage exactly 0
        if p.soft_clip is not None:
            advantages = soft_clip(advantages, p.soft_clip)
        output.update(advantages=advantages, old_values=values, returns=returns, value_weight=trained.float())
        # rollout metrics, over all ranks' real tokens
        returns_mean, returns_var = self._global_mean_var(returns, mask)
        _, residual_var = self._global_mean_var(returns - values, mask)
        values_mean, _ = self._global_mean_var(values, mask)
        ev = 1.0 - residual_var / returns_var if returns_var > 0 else torch.tensor(float("nan"))
        self._guard_metric(metrics.PPO_RETURNS_MEAN, float(returns_mean))
        self._guard_metric(metrics.PPO_VALUES_MEAN, float(values_mean))
        self._guard_metric(metrics.PPO_EXPLAINED_VARIANCE, float(ev))
        self._guard_metric(metrics.PPO_BETA, float(self.beta))  # the coefficient place_rewards just used
        kl_mean = float("nan")
        if kl is not None:
            kl_mean = float(self._global_mean_var(kl, mask)[0])
            self._guard_metric(metrics.PPO_KL, kl_mean)
        if self.step_end.kl is not None:
            tokens = float(self.accelerator.reduce(mask.sum().float().reshape(1), reduction="sum").item())
            self.notes.record_rollout_kl(kl_mean if tokens > 0 else float("nan"), tokens)

    def _compute_loss(self, model, inputs):
        if "old_values" not in inputs:  # eval batches: no rollout values
            with trl_state.kl_out_of_loss(self):
                return super()._compute_loss(model, inputs)
        wrapper = self.policy_and_value
        with trl_state.kl_out_of_loss(self), wrapper.computing_values():
            loss = super()._compute_loss(model, inputs)
        full_values, wrapper.last_values = wrapper.last_values, None
        assert full_values is not None, "the policy forward of TRL's loss did not run through PolicyAndValue"
        width = inputs["completion_ids"].size(1)
        values = full_values[:, -(width + 1) : -1].float()
        mask = loss_mask(inputs)
        if inputs.get("value_weight") is not None:  # unscorable and filtered rows train no value
            mask = mask * inputs["value_weight"][:, None].to(mask.dtype)
        vf_loss, clipfrac = clipped_value_loss(
            values, inputs["old_values"], inputs["returns"], mask, self.ppo.cliprange_value
        )
        self._guard_metric(metrics.PPO_VALUE_LOSS, float(self.accelerator.reduce(vf_loss.detach(), reduction="mean")))
        self._guard_metric(metrics.PPO_CLIPFRAC_VALUE, float(self.accelerator.reduce(clipfrac, reduction="mean")))
        # scaled for gradient accumulation like TRL's grpo/bnpo losses (HF auto-scaling is off in GRPOTrainer)
        return loss + self.ppo.vf_coef * vf_loss / self.current_gradient_accumulation_steps


def _grad_norm(parameters: Iterator[torch.nn.Parameter]) -> float:
    """L2 norm of the gradients of ``parameters`` (those without one count as zero); NaN/inf propagate."""
    grads = [p.grad.detach() for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).double()))
