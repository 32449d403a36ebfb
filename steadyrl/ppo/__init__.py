"""PPO building blocks: GAE and value-loss math (``gae``), the critic (``value``), the policy+critic wrapper
(``wrapper``). The trainer is ``steadyrl.trainers.ppo``; ``reward_stage`` re-exports ``steadyrl.trainers.reward_model``.
"""
