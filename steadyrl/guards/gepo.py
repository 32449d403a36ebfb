"""Old import path of GEPO's robust group advantages (``guards.gepo.advantage``).

They live in ``steadyrl.guards.robust_advantage``; the spike detector is ``steadyrl.guards.spike``.
"""

from steadyrl.guards.robust_advantage import (
    CLIP_SCALE_RANGE,
    AdvantageConfig,
    GEPOAdvantage,
    nan_median,
    robust_group_advantages,
)

__all__ = ["CLIP_SCALE_RANGE", "AdvantageConfig", "GEPOAdvantage", "nan_median", "robust_group_advantages"]
