"""PPO building blocks: GAE and value-loss math, the critic model, the policy+critic wrapper.

The trainer that wires these into TRL's GRPO rollout machinery lives in ``steadyrl.trainers``.
The reward-model stage lives in ``steadyrl.trainers.reward_model`` (``steadyrl.ppo.reward_stage`` re-exports it).
"""

from steadyrl.ppo.gae import (
    KL_ESTIMATORS,
    clipped_value_loss,
    explained_variance,
    gae,
    get_kl_estimator,
    kl_k1,
    kl_k3,
    last_token_index,
    masked_mean,
    masked_mean_var,
    place_rewards,
    soft_clip,
    whiten,
)
from steadyrl.ppo.value import CriticModel, ValueHead
from steadyrl.ppo.wrapper import PolicyAndValue

__all__ = [
    "KL_ESTIMATORS",
    "CriticModel",
    "PolicyAndValue",
    "ValueHead",
    "clipped_value_loss",
    "explained_variance",
    "gae",
    "get_kl_estimator",
    "kl_k1",
    "kl_k3",
    "last_token_index",
    "masked_mean",
    "masked_mean_var",
    "place_rewards",
    "soft_clip",
    "whiten",
]
