"""``SteadyPPOConfig``: TRL's ``GRPOConfig`` that also accepts ``num_generations: 1`` (PPO's baseline is the critic).

GRPOConfig's check runs with ``num_generations`` set to 2 and the value is restored afterwards; so with 1 the
generation batch must still be even (the same check requires 2 to divide it).
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import GRPOConfig


@dataclass
class SteadyPPOConfig(GRPOConfig):
    """GRPOConfig fields unchanged; ``num_generations`` may be 1. The PPO settings live in the ``ppo`` section."""

    def __post_init__(self) -> None:
        single = self.num_generations == 1
        if single:
            self.num_generations = 2  # passes GRPOConfig's ">= 2" check; restored below
            if self.num_generations_eval is None:
                self.num_generations_eval = 1
        try:
            super().__post_init__()
        finally:
            if single:
                self.num_generations = 1
