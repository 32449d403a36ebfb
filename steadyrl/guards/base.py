"""The shapes every defence layer plugs into (docs/ARCHITECTURE.md). Pure interfaces: no Trainer import here.

In the order data meets them: ``RewardProcessor`` (raw rewards of a generation batch gathered from all processes ->
scaled rewards, GRADE), ``AdvantageFunction`` ((num_prompts, G) rewards -> advantages, GEPO), ``StepGuard`` (sees the
global pre-clip gradient norm before each optimizer step and may veto it). ``Stateful`` (the checkpoint's guard
state), ``RankStateful`` (per-rank state in the rank files) and ``Stepping`` (``step()`` after every optimizer step)
are handled the same way for every layer. Every method receives values identical on all ranks (gathered rewards,
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


@runtime_checkable
class RewardProcessor(Protocol):
    def __call__(self, rewards: torch.Tensor, prompts: list[Any], num_generations: int) -> torch.Tensor:
        """rewards: (N,) with NaN for unscorable rows; prompts: N entries (one per row) -> (N,) scaled rewards."""


@runtime_checkable
class AdvantageFunction(Protocol):
    def __call__(self, grouped_rewards: torch.Tensor) -> torch.Tensor:
        """grouped_rewards: (num_prompts, G), NaN = unscorable -> advantages (num_prompts, G), finite."""


@dataclass(frozen=True)
class StepDecision:
    skip: bool
    reason: str = ""

    @staticmethod
    def proceed() -> StepDecision:
        return StepDecision(False)


class StepGuard(Protocol):
    """A veto on the optimizer step. A guard whose skipped gradients must not come back through error feedback
    (wrong in direction, not only in size) sets a class attribute ``feeds_back = False``."""

    def decide(self, grad_norm: torch.Tensor, step: int) -> StepDecision:
        """grad_norm: global pre-clip norm (0-d tensor, may be non-finite); step: optimizer steps done so far."""

    def on_skip(self, gradients: list[torch.Tensor | None], decision: StepDecision, step: int) -> None:
        """Called once per skipped step with the (local) gradients before they are dropped."""


def check_version(state: dict[str, Any], expected: int, what: str) -> None:
    """Raise ValueError unless ``state`` (one layer's checkpoint state) has format ``expected`` (no key: version 1)."""
    if (found := state.get("version", 1)) != expected:
        raise ValueError(
            f"{what}: the checkpoint's state has format version {found}, this steadyrl reads version {expected} "
            "only (pre-0.1.0 formats are not converted); resume from a checkpoint this version wrote, or start fresh"
        )


def combine_decisions(decisions: list[StepDecision]) -> StepDecision:
    """Skip when any guard says skip; reasons joined in guard order."""
    reasons = [d.reason for d in decisions if d.skip]
    return StepDecision(True, ",".join(r for r in reasons if r) or "skip") if reasons else StepDecision.proceed()
