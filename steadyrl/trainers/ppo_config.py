"""``SteadyPPOConfig``: TRL's ``GRPOConfig`` that also accepts ``num_generations: 1`` (PPO needs no prompt group).

GRPOConfig's ``__post_init__`` rejects ``num_generations < 2`` because GRPO's advantage is relative to the group. PPO's
baseline is the critic, so one completion per prompt is the usual setting. TRL is not edited: the check runs with
``num_generations`` set to 2 for its duration and the value is restored afterwards. Side effect: with
``num_generations: 1`` the generation batch (``per_device_train_batch_size x processes x steps_per_generation``) must
be even, because the same ``__post_init__`` also checks that 2 divides it.
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
