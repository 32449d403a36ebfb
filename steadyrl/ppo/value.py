"""The PPO critic: a transformer backbone with a scalar value head on every token.

``CriticModel(input_ids, attention_mask) -> values (B, T)``: V(s_t) for the state "prompt + completion up to and
including token t"; the trainer slices out the completion positions, as it does for the policy's log-probs.

``CriticModel.from_pretrained`` starts from a causal-LM folder (the policy's backbone, value head at exactly 0), a
one-label ``*ForSequenceClassification`` reward model (its backbone and ``score`` head, rescaled by ``reward_stats``
to predict normalised rewards) or a folder written by ``save_pretrained``. With a ``peft_config`` the critic gets its
own LoRA adapter on its own frozen base copy; the value head stays fully trainable. Why the critic trains in one
module with the policy (one engine, one optimizer): docs/DESIGN.md, "PPO: critic, rewards and GAE".

Leaves out: the optimizer (the trainer builds it), dropout control (call ``.eval()``), ZeRO-3 (parameters are
gathered only inside engine forwards).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_CONFIG_FILE = "critic_config.json"


class ValueHead(nn.Module):
    """Linear ``hidden_size -> 1`` applied to every position: hidden (..., H) -> values (...).

    ``init_std = 0`` (default): weight and bias start at exactly 0, so every initial value is 0. ``init_std > 0``:
    weight ~ N(0, init_std^2), bias 0. The input is cast to the head's dtype (keep the head in float32 when the
    backbone runs in bf16 outside DeepSpeed).
    """

    def __init__(self, hidden_size: int, init_std: float = 0.0) -> None:
        super().__init__()
        if init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {init_std!r}")
        self.summary = nn.Linear(hidden_size, 1)
        self.init_std = init_std
        with torch.no_grad():
            if init_std == 0.0:
                self.summary.weight.zero_()
            else:
                self.summary.weight.normal_(0.0, init_std)
            self.summary.bias.zero_()

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states: (..., H) -> values (...)."""
        return self.summary(hidden_states.to(self.summary.weight.dtype)).squeeze(-1)


def _hidden_size(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size)


def _is_reward_model(config: Any) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in (getattr(config, "architectures", None) or []))


class CriticModel(nn.Module):
    """Backbone (a transformers base model, e.g. ``LlamaModel``) + :class:`ValueHead`; forward gives (B, T) values.

    ``backbone`` may be a ``peft.PeftModel`` around the base model (LoRA critic, see the module docstring).
    """

    def __init__(self, backbone: nn.Module, value_head: ValueHead | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head if value_head is not None else ValueHead(_hidden_size(backbone.config))
        self.init_source = "unknown"

    @property
    def config(self) -> Any:
        """The backbone's config (hidden size, pad token, ...)."""
        return self.backbone.config

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        """input_ids, attention_mask: (B, T) -> values (B, T) in the value head's dtype.

        Extra keyword arguments (e.g. ``position_ids``) go to the backbone. No KV cache is used.
        """
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        return self.value_head(out.last_hidden_state)

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        """Turn on activation checkpointing in the backbone (``**kwargs`` go to transformers)."""
        base = self.backbone.get_base_model() if hasattr(self.backbone, "get_base_model") else self.backbone
        enable = getattr(base, "activation_checkpointing_enable", None) or base.gradient_checkpointing_enable
        enable(**kwargs)

    # ------------------------------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        init_std: float = 0.0,
        reward_stats: dict[str, float] | None = None,
        peft_config: Any = None,
        **model_kwargs: Any,
    ) -> CriticModel:
        """A critic from a policy (causal-LM) folder, a reward-model folder, or a folder written by ``save_pretrained``.

        ``model_kwargs`` go to transformers' ``from_pretrained`` (``dtype``, ``attn_implementation``, ...).
        ``init_std`` sets the fresh head's init when the source has no usable head. ``reward_stats``
        (``{"mean": m, "std": s}``) rescales a reward model's head to predict ``(score - m) / s``. ``peft_config``
        wraps the backbone with PEFT (LoRA critic; the value head stays fully trainable).
        """
        path = Path(path)
        if (path / VALUE_HEAD_FILE).is_file():
            critic = cls._load_saved(path, **model_kwargs)
        else:
            hub = {k: v for k, v in model_kwargs.items() if k in ("revision", "trust_remote_code")}
            config = AutoConfig.from_pretrained(path, **hub)
            if _is_reward_model(config):
                critic = cls._from_reward_model(path, init_std, reward_stats, **model_kwargs)
            else:
                backbone = AutoModel.from_pretrained(path, **model_kwargs)
                critic = cls(backbone, ValueHead(_hidden_size(backbone.config), init_std))
                critic.init_source = "policy"
        if peft_config is not None:
            from peft import get_peft_model

            if hasattr(critic.backbone, "peft_config"):
                raise ValueError(f"the critic at {path} already has a PEFT adapter; pass peft_config=None")
            critic.backbone = get_peft_model(critic.backbone, peft_config)
        return critic

    @classmethod
    def _from_reward_model(
        cls, path: Path, init_std: float, reward_stats: dict[str, float] | None, **model_kwargs: Any
    ) -> CriticModel:
        rm = AutoModelForSequenceClassification.from_pretrained(path, **model_kwargs)
        backbone = rm.base_model
        hidden = _hidden_size(backbone.config)
        head = ValueHead(hidden, init_std)
        score = getattr(rm, "score", None)
        source = "reward_model"
        if isinstance(score, nn.Linear) and tuple(score.weight.shape) == (1, hidden):
            weight = score.weight.detach().float()
            bias = score.bias.detach().float() if score.bias is not None else torch.zeros(1)
            if reward_stats is not None:
                std = float(reward_stats["std"])
                if not std > 0:
                    raise ValueError(f"reward_stats std must be > 0, got {std!r}")
                weight, bias = weight / std, (bias - float(reward_stats["mean"])) / std
            with torch.no_grad():
                head.summary.weight.copy_(weight)
                head.summary.bias.copy_(bias)
            source = "reward_model+score_head"
        critic = cls(backbone, head)
        critic.init_source = source
        return critic

    @classmethod
    def _load_saved(cls, path: Path, **model_kwargs: Any) -> CriticModel:
        meta = json.loads((path / CRITIC_CONFIG_FILE).read_text()) if (path / CRITIC_CONFIG_FILE).is_file() else {}
        if (path / "adapter_config.json").is_file():
            from peft import PeftConfig, PeftModel

            base_path = PeftConfig.from_pretrained(path).base_model_name_or_path
            base = AutoModel.from_pretrained(base_path, **model_kwargs)
            backbone: nn.Module = PeftModel.from_pretrained(base, path, is_trainable=True)
        else:
            backbone = AutoModel.from_pretrained(path, **model_kwargs)
        head = ValueHead(_hidden_size(backbone.config))
        head.load_state_dict(load_file(str(path / VALUE_HEAD_FILE)))
        critic = cls(backbone, head)
        critic.init_source = meta.get("init_source", "saved")
        return critic

    def save_pretrained(self, save_directory: str | Path, **kwargs: Any) -> None:
        """Write the backbone (transformers/PEFT format), ``value_head.safetensors`` and ``critic_config.json``.

        A LoRA backbone is saved as its adapter only (the base is read back from the adapter's
        ``base_model_name_or_path``). ``kwargs`` go to the backbone's ``save_pretrained``.
        """
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(out, **kwargs)
        head_state = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(head_state, str(out / VALUE_HEAD_FILE))
        meta = {"init_source": self.init_source, "hidden_size": _hidden_size(self.backbone.config)}
        (out / CRITIC_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
