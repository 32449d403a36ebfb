"""steadyrl: GRPO/PPO on Hugging Face TRL that does not crash, collapse or silently hack its reward."""

__version__ = "0.1.0"
