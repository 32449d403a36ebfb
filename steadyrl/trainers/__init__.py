"""Trainers: SteadyGRPOTrainer (trl.GRPOTrainer + guards), SteadyPPOTrainer (+ a critic) and the config builder."""

from steadyrl.trainers.grpo import SteadyGRPOTrainer
from steadyrl.trainers.ppo import SteadyPPOTrainer

__all__ = ["SteadyGRPOTrainer", "SteadyPPOTrainer"]
