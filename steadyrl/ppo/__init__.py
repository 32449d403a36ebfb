"""PPO building blocks: GAE and value-loss math (``gae``), the critic (``value``), the policy+critic wrapper
(``wrapper``). The trainer is ``steadyrl.trainers.ppo``; the reward model is ``steadyrl.trainers.reward_model``.
"""
