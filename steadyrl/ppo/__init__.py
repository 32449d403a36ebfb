"""PPO building blocks: GAE and value-loss math, the critic model, the policy+critic wrapper, the reward-model stage.

The trainer that wires these into TRL's GRPO rollout machinery lives in ``steadyrl.trainers``.
``reward_stage`` is not imported here (it pulls in TRL and matplotlib); import it directly.
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
