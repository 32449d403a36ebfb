"""``PolicyAndValue``: the policy and the critic as one ``nn.Module``, so one engine and one optimizer serve both.

Why one module: docs/DESIGN.md, "PPO: critic, rewards and GAE".

The wrapper looks like the policy to everything that expects one: ``forward`` is the policy's forward, and any
attribute the wrapper itself lacks (``generate``, ``config``, ``peft_config``, ``disable_adapter``,
``gradient_checkpointing_disable``, ...) is read from the policy. So TRL's generation, reference log-probs (including
the PEFT "disable the adapter" path) and log-prob computation run unchanged on it.

Values: inside :meth:`computing_values` every forward also runs the critic on the same ``input_ids`` /
``attention_mask`` and keeps the ``(B, T)`` result in ``last_values`` (with its graph). Running the critic inside the
wrapper's forward keeps it inside the DDP / DeepSpeed engine forward, which ZeRO-3 would require (not supported here).
The values are *not* among the forward's outputs (TRL's fused output class and DDP's output rebuild accept no extra
field), so DDP must run with ``find_unused_parameters=False``: with it on, DDP walks back from the outputs, marks the
critic unused and fails when the critic's gradients arrive. ``SteadyPPOTrainer`` sets that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn


class PolicyAndValue(nn.Module):
    """``policy`` (a causal LM, possibly a PEFT model) + ``critic`` (``CriticModel``: (B, T) values)."""

    def __init__(self, policy: nn.Module, critic: nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self.critic = critic
        self.want_values = False
        self.last_values: Tensor | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The policy's forward; inside :meth:`computing_values` also ``last_values = critic(input_ids, mask)``."""
        out = self.policy(*args, **kwargs)
        if self.want_values:
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            self.last_values = self.critic(input_ids=input_ids, attention_mask=kwargs.get("attention_mask"))
        return out

    @contextlib.contextmanager
    def computing_values(self) -> Iterator[None]:
        """Forwards in this block also compute the critic's values (read ``last_values`` afterwards)."""
        self.want_values, self.last_values = True, None
        try:
            yield
        finally:
            self.want_values = False

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            policy = nn.Module.__getattr__(self, "policy")  # AttributeError before __init__ registered it
            return getattr(policy, name)
