"""Trainers: SteadyGRPOTrainer (trl.GRPOTrainer with guard extension points) and the config-driven builder."""

from steadyrl.trainers.grpo import SteadyGRPOTrainer

__all__ = ["SteadyGRPOTrainer"]
