"""Old home of the reward-model stage; it lives in ``steadyrl.trainers.reward_model`` (it is not PPO-specific).

``steadyrl.ppo.reward_stage:reward_model_score`` is a public reward spec in configs and the README, so this module
re-exports everything. (A package rather than ``reward_stage.py``, so that git sees the move of the old file.)
"""

from steadyrl.trainers.reward_model import (
    ACCURACY_WARNING,
    CALIBRATION_FILE,
    CALIBRATION_PLOT,
    STATS_FILE,
    RewardModelReward,
    calibration_report,
    encode_pair,
    load_reward_stats,
    pairwise_summary,
    plot_calibration,
    reward_model_score,
    run_reward_stage,
    score_ids,
    train_reward_model,
)

__all__ = [
    "ACCURACY_WARNING",
    "CALIBRATION_FILE",
    "CALIBRATION_PLOT",
    "STATS_FILE",
    "RewardModelReward",
    "calibration_report",
    "encode_pair",
    "load_reward_stats",
    "pairwise_summary",
    "plot_calibration",
    "reward_model_score",
    "run_reward_stage",
    "score_ids",
    "train_reward_model",
]
