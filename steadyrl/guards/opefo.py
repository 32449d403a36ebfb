"""OPEFO optimizer-state protection (docs/DESIGN.md, the "OPEFO" sections): the config a trainer takes.

Three parts, each in its own module, pure torch over an optimizer's ``exp_avg`` / ``exp_avg_sq`` (torch AdamW; under
DeepSpeed ZeRO-2 the base optimizer, one flat fp32 partition per param group and rank): ``moment_floor`` (the
second-moment floor), ``error_feedback`` (a skipped step's gradient fed back over the next steps) and ``rollback``
with ``optimizer_state`` (finite checks, snapshots, rollback and in-place repair). Nothing in them knows about
processes: every cross-rank operation goes through ``reduce_sum`` / ``all_gather`` callables (the identity by
default; ``optimizer_state.distributed_ops()`` builds them), called the same number of times on every rank, so all
ranks decide the same. When to skip, check, snapshot or roll back is ``steadyrl.trainers.opefo_runtime``'s job.
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
