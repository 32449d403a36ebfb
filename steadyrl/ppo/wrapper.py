"""``PolicyAndValue``: the policy and the critic as one ``nn.Module``, so one engine and one optimizer serve both
(docs/DESIGN.md, "PPO: critic, rewards and GAE").

It looks like the policy: ``forward`` is the policy's, other attributes are read from the policy. Inside
:meth:`computing_values` each forward also keeps the critic's ``(B, T)`` values in ``last_values``, inside the engine's
forward. They are not a forward output, so DDP must run with ``find_unused_parameters=False`` (``SteadyPPOTrainer``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

CRITIC_FILE = "critic.safetensors"  # the critic's whole state beside the policy's files (SteadyPPOTrainer._save)


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
