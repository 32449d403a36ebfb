"""Old import path of GRADE's reward scaler (``guards.grade``); it lives in ``steadyrl.guards.reward_scaler``."""

from steadyrl.guards.reward_scaler import GradeConfig, GradeScaler, prompt_key, soft_tail_clip, whiten

__all__ = ["GradeConfig", "GradeScaler", "prompt_key", "soft_tail_clip", "whiten"]
