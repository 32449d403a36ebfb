"""Trainers: SteadyGRPOTrainer (trl.GRPOTrainer with guard extension points), SteadyPPOTrainer (PPO with a critic on
the same rollout machinery) and the config-driven builder."""

from steadyrl.trainers.grpo import SteadyGRPOTrainer
from steadyrl.trainers.ppo import SteadyPPOTrainer

__all__ = ["SteadyGRPOTrainer", "SteadyPPOTrainer"]
