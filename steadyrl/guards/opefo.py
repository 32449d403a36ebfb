"""OPEFO optimizer-state protection (docs/DESIGN.md, the "OPEFO" sections): the config a trainer takes.

Its parts, pure torch over an optimizer's Adam state: ``moment_floor``, ``error_feedback``, ``rollback`` and
``optimizer_state``. Cross-rank operations go through injected ``reduce_sum`` / ``all_gather`` callables, called the
same number of times on every rank. ``steadyrl.trainers.recovery`` and the stations step_gate, step_end run them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steadyrl.guards.error_feedback import ErrorFeedbackConfig
from steadyrl.guards.moment_floor import FloorConfig
from steadyrl.guards.rollback import RollbackConfig


@dataclass
class OpefoConfig:
    enabled: bool = False
    floor: FloorConfig = field(default_factory=FloorConfig)
    error_feedback: ErrorFeedbackConfig = field(default_factory=ErrorFeedbackConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
