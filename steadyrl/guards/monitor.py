"""Moved: the early warnings live in ``steadyrl.evidence.early_warnings`` (they read logs; they guard nothing).

This module re-exports them so that older imports keep working.
"""

from steadyrl.evidence.early_warnings import (
    GapVerdict,
    MonitorConfig,
    early_warnings,
    logp_gap_allowance,
    logp_gap_verdict,
    recent,
)

__all__ = ["GapVerdict", "MonitorConfig", "early_warnings", "logp_gap_allowance", "logp_gap_verdict", "recent"]
