"""The PPO critic: a transformer backbone with a scalar value head on every token.

``CriticModel(input_ids, attention_mask) -> values (B, T)``: V(s_t) for "prompt + completion up to token t".
``CriticModel.from_pretrained`` starts from a causal-LM folder (value head at exactly 0), a one-label
``*ForSequenceClassification`` reward model (its ``score`` head, rescaled by ``reward_stats``) or a folder written by
``save_pretrained``; with a ``peft_config`` the critic gets its own LoRA adapter. Leaves out ZeRO-3.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from peft import PeftConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_CONFIG_FILE = "critic_config.json"


class ValueHead(nn.Module):
    """Linear ``hidden_size -> 1`` on every position: hidden (..., H) -> values (...), in the head's dtype. Weight
    and bias start at exactly 0."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        with torch.no_grad():
            self.summary.weight.zero_()
            self.summary.bias.zero_()

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.summary(hidden_states.to(self.summary.weight.dtype)).squeeze(-1)


def _hidden_size(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


class CriticModel(nn.Module):
    """Backbone (a transformers base model or a ``peft.PeftModel`` around one) + :class:`ValueHead`."""

    def __init__(self, backbone: nn.Module, value_head: ValueHead | None = None, init_source: str = "unknown") -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head if value_head is not None else ValueHead(_hidden_size(backbone.config))
        self.init_source = init_source

    @property
    def config(self) -> Any:
        return self.backbone.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        """input_ids, attention_mask: (B, T) -> values (B, T); extra keyword arguments go to the backbone."""
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        return self.value_head(out.last_hidden_state)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        base = self.backbone.get_base_model() if hasattr(self.backbone, "get_base_model") else self.backbone
        enable = getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable
        enable(**kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        reward_stats: dict[str, float] | None = None,
        peft_config: Any = None,
        **model_kwargs: Any,
    ) -> CriticModel:
        """A critic from a policy (causal-LM) folder, a reward-model folder, or a folder written by ``save_pretrained``.
        ``model_kwargs`` go to transformers' ``from_pretrained``; ``reward_stats`` (``{"mean", "std"}``) rescales a
        reward model's head to predict normalised scores."""
        path = Path(path)
        if (path / VALUE_HEAD_FILE).is_file():
            critic = cls._load_saved(path, **model_kwargs)
        else:
            hub = {k: v for k, v in model_kwargs.items() if k in ("revision", "trust_remote_code")}
            config = AutoConfig.from_pretrained(path, **hub)
            if any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or [])):
                critic = cls._from_reward_model(path, reward_stats, **model_kwargs)
            else:
                backbone = AutoModel.from_pretrained(path, **model_kwargs)
                critic = cls(backbone, ValueHead(_hidden_size(backbone.config)), "policy")
        if peft_config is not None:
            if hasattr(critic.backbone, "peft_config"):
                raise ValueError(f"the critic at {path} already has a PEFT adapter; pass peft_config=None")
            critic.backbone = get_peft_model(critic.backbone, peft_config)
        return critic

    @classmethod
    def _from_reward_model(cls, path: Path, reward_stats: dict[str, float] | None, **model_kwargs: Any) -> CriticModel:
        rm = AutoModelForSequenceClassification.from_pretrained(path, **model_kwargs)
        backbone = rm.base_model
        hidden = _hidden_size(backbone.config)
        head = ValueHead(hidden)
        score = getattr(rm, "score", None)
        source = "reward_model"
        if isinstance(score, nn.Linear) and tuple(score.weight.shape) == (1, hidden):
            weight = score.weight.detach().float()
            bias = score.bias.detach().float() if score.bias is not None else torch.zeros(1)
            if reward_stats is not None:  # std > 0: load_reward_stats checks it
                std = float(reward_stats["std"])
                weight, bias = weight / std, (bias - float(reward_stats["mean"])) / std
            with torch.no_grad():
                head.summary.weight.copy_(weight)
                head.summary.bias.copy_(bias)
            source = "reward_model+score_head"
        return cls(backbone, head, source)

    @classmethod
    def _load_saved(cls, path: Path, **model_kwargs: Any) -> CriticModel:
        meta = json.loads((path / CRITIC_CONFIG_FILE).read_text()) if (path / CRITIC_CONFIG_FILE).is_file() else {}
        if (path / "adapter_config.json").is_file():
            base_path = PeftConfig.from_pretrained(path).base_model_name_or_path
            base = AutoModel.from_pretrained(base_path, **model_kwargs)
            backbone: nn.Module = PeftModel.from_pretrained(base, path, is_trainable=True)
        else:
            backbone = AutoModel.from_pretrained(path, **model_kwargs)
        head = ValueHead(_hidden_size(backbone.config))
        head.load_state_dict(load_file(str(path / VALUE_HEAD_FILE)))
        return cls(backbone, head, meta.get("init_source", "saved"))

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """Write the backbone (LoRA: the adapter only), ``value_head.safetensors``, ``critic_config.json``."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(out, **kwargs)
        head_state = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(head_state, str(out / VALUE_HEAD_FILE))
        meta = {"init_source": self.init_source, "hidden_size": _hidden_size(self.backbone.config)}
        (out / CRITIC_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
