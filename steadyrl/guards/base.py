"""The shapes every defence layer plugs into. Pure interfaces: no Trainer import here.

Four extension points, in the order data meets them (see docs/ARCHITECTURE.md):

1. ``RewardProcessor``: raw rewards of a whole generation batch (gathered from all processes) -> scaled rewards,
   before any advantage (GRADE).
2. ``AdvantageFunction``: rewards grouped per prompt, shape (num_prompts, G) -> advantages of the same shape
   (GEPO's median/MAD; the default reproduces TRL's mean/std).
3. ``StepGuard``: sees the global pre-clip gradient norm before each optimizer step and may veto the step
   (GEPO spike skip, OPEFO hooks).
4. ``Stateful``: every piece with state saves into checkpoints and restores on resume.

The generic part of a layer's life, which the trainer handles the same way for every layer: ``Stateful`` (the
checkpoint's guard state, main process), ``RankStateful`` (per-rank state in the rank files: OPEFO's residual,
QUATRO's replay buffer) and ``Stepping`` (``step()`` after every optimizer step, e.g. GRADE's quantile refresh).
The calls whose order matters (OPEFO before QUATRO at a step's end, GRADE before GEPO in the advantage pipeline)
stay explicit in the trainer. Every method receives values that are identical on all ranks (gathered rewards,
all-reduced norms), so deterministic implementations decide the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class RankStateful(Protocol):
    def rank_state_dict(self) -> dict[str, Any]: ...

    def load_rank_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class Stepping(Protocol):
    def step(self) -> None:
        """Called once after every optimizer step."""
        ...


@runtime_checkable
class RewardProcessor(Protocol):
    def __call__(self, rewards: torch.Tensor, prompts: list[Any], num_generations: int) -> torch.Tensor:
        """rewards: (N,) with NaN for unscorable rows; prompts: N entries (one per row) -> (N,) scaled rewards."""
        ...


@runtime_checkable
class AdvantageFunction(Protocol):
    def __call__(self, grouped_rewards: torch.Tensor) -> torch.Tensor:
        """grouped_rewards: (num_prompts, G), NaN = unscorable -> advantages (num_prompts, G), finite."""
        ...


@dataclass(frozen=True)
class StepDecision:
    skip: bool
    reason: str = ""

    @staticmethod
    def proceed() -> StepDecision:
        return StepDecision(False)


class StepGuard(Protocol):
    def decide(self, grad_norm: torch.Tensor, step: int) -> StepDecision:
        """grad_norm: global pre-clip norm (0-d tensor, may be non-finite); step: optimizer steps done so far."""
        ...

    def on_skip(self, gradients: list[torch.Tensor | None], decision: StepDecision, step: int) -> None:
        """Called once per skipped step with the (local) gradients before they are dropped."""
        ...


def combine_decisions(decisions: list[StepDecision]) -> StepDecision:
    """Skip when any guard says skip; reasons joined in guard order."""
    reasons = [d.reason for d in decisions if d.skip]
    return StepDecision(True, ",".join(r for r in reasons if r) or "skip") if reasons else StepDecision.proceed()
