"""The ``guards`` sections: one shape per layer.

A section subclasses its guard's own config dataclass and adds ``enabled`` (a new guard option is a config key
without touching this file); ``to_config()`` gives the guard's config back. GEPO and QUATRO hold one per guard.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from steadyrl.evidence.early_warnings import MonitorConfig
from steadyrl.guards.entropy_floor import EntropyConfig
from steadyrl.guards.error_feedback import ErrorFeedbackConfig
from steadyrl.guards.gold_watch import GoldConfig
from steadyrl.guards.kl_controller import KLConfig
from steadyrl.guards.mismatch import MismatchConfig
from steadyrl.guards.moment_floor import FloorConfig
from steadyrl.guards.opefo import OpefoConfig
from steadyrl.guards.quatro import QuatroConfig
from steadyrl.guards.replay import ReplayConfig
from steadyrl.guards.reward_scaler import GradeConfig
from steadyrl.guards.robust_advantage import AdvantageConfig
from steadyrl.guards.rollback import RollbackConfig
from steadyrl.guards.rollout_filters import FilterConfig
from steadyrl.guards.spike import GRANULARITIES, SpikeConfig
from steadyrl.ranges import Checked, bounded, bounds

# ``guards.<layer>.mode``: ``observe`` computes and logs every decision and changes nothing (DESIGN.md, "Observe mode")
MODES = ("act", "observe")


class Layer(Checked):
    """A guard layer's section (``enabled``, ``mode``)."""

    @property
    def observing(self) -> bool:
        return self.enabled and self.mode == "observe"


class GuardSection(Checked):
    """Mixin of a section that subclasses its guard's config dataclass and adds ``enabled`` (and maybe more)."""

    def to_config(self) -> Any:
        """The guard's own config (the first dataclass base) with this section's values."""
        base = next(b for b in type(self).__mro__[1:] if dataclasses.is_dataclass(b) and b is not GuardSection)
        return base(**{f.name: getattr(self, f.name) for f in dataclasses.fields(base)})


@dataclass
class GepoAdvantageSection(AdvantageConfig, GuardSection):
    """TRL's mean/std group advantage, median/MAD with tanh soft clipping on groups with a far outlier."""

    enabled: bool = True


@dataclass
class GepoSpikeSection(SpikeConfig, GuardSection):
    """Grad-norm EMA spike detector: skip a poisoned optimizer step. ``enabled: false`` turns off the spike test
    only: with ``gepo.enabled`` a non-finite gradient norm always skips the step (finite checks).
    ``granularity: micro_batch`` also judges every micro-batch on its own gradient (docs/DESIGN.md)."""

    enabled: bool = True
    granularity: str = bounded("step", choices=GRANULARITIES)


@dataclass
class GepoSection(Layer):
    enabled: bool = False
    # act | observe: spike skips, log-prob floor and robust advantages only computed and logged
    mode: str = bounded("act", choices=MODES)
    logprob_min: float | None = -100.0  # floor for per-token log-probs before ratios and KL; null = off
    advantage: GepoAdvantageSection = field(default_factory=GepoAdvantageSection)
    spike: GepoSpikeSection = field(default_factory=GepoSpikeSection)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)  # vLLM rollouts: mismatch/*, the ESS gate


@dataclass
class GradeSection(GradeConfig, GuardSection, Layer):
    """GRADE reward scaler: rolling whitening, quantile tail clip, per-prompt counterfactual centring."""

    enabled: bool = False
    mode: str = bounded("act", choices=MODES)  # act | observe: scaled rewards computed and logged, advantages from raw
    kl_compensation: bool = (
        False  # KL coefficient x raw_std / scaled_std, clamped (DESIGN.md, "GRADE: KL compensation")
    )
    kl_compensation_range: list[float] = field(default_factory=lambda: [0.5, 2.0])  # checked when on (checks.py)


@dataclass
class OpefoErrorFeedbackSection(Checked):
    """Feed a skipped step's gradient back over the next steps, each piece rescaled to the current gradient (off by
    default: docs/DESIGN.md, "OPEFO: error feedback")."""

    enabled: bool = False
    weights: list[float] = field(  # the ranges of ErrorFeedbackConfig.weights, which also sum them
        default_factory=lambda: [0.3, 0.3, 0.2, 0.2], metadata=bounds(gt=0, finite=True, min_len=1)
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        ErrorFeedbackConfig(self.enabled, tuple(self.weights))  # the sum


@dataclass
class OpefoSection(Layer):
    """OPEFO optimizer-state protection: exp_avg_sq floor, error feedback, snapshots with automatic rollback."""

    enabled: bool = False
    mode: str = bounded("act", choices=MODES)  # act | observe: no floor, feedback, snapshot, rollback or LR cut
    floor: FloorConfig = field(default_factory=FloorConfig)
    error_feedback: OpefoErrorFeedbackSection = field(default_factory=OpefoErrorFeedbackSection)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)

    def to_config(self) -> OpefoConfig:
        ef = ErrorFeedbackConfig(self.error_feedback.enabled, tuple(self.error_feedback.weights))
        return OpefoConfig(self.enabled, self.floor, ef, self.rollback)


@dataclass
class QuatroFiltersSection(FilterConfig, GuardSection):
    """Rollout quality filters before advantages; ``enabled: false`` turns all of them off at once."""

    enabled: bool = True


@dataclass
class QuatroReplaySection(ReplayConfig, GuardSection):
    """Rollout replay: each training micro-batch holds round_half_up(``replay_ratio`` x per_device_train_batch_size)
    rows of the last ``capacity`` micro-batches (off by default; see ``steadyrl.trainers.rollout.RolloutStation``)."""

    enabled: bool = False


@dataclass
class QuatroSection(Layer):
    """QUATRO loop layer: adaptive KL coefficient, entropy floor, rollout quality filters, the reward-hacking watch
    (and replay)."""

    enabled: bool = False
    # act | observe: controllers and filters computed and logged, TRL's beta/entropy_coef kept
    mode: str = bounded("act", choices=MODES)
    kl: KLConfig = field(default_factory=KLConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    filters: QuatroFiltersSection = field(default_factory=QuatroFiltersSection)
    replay: QuatroReplaySection = field(default_factory=QuatroReplaySection)
    gold: GoldConfig = field(default_factory=GoldConfig)  # run where an eval runs: steadyrl's periodic one or TRL's

    def to_config(self) -> QuatroConfig:
        """The enabled parts."""
        return QuatroConfig(
            kl=self.kl if self.kl.enabled else None,
            entropy=self.entropy if self.entropy.enabled else None,
            filters=self.filters.to_config() if self.filters.enabled else None,
            replay=self.replay.to_config() if self.replay.enabled else None,
            gold=self.gold if self.gold.enabled else None,
        )


@dataclass
class GuardsSection:
    gepo: GepoSection = field(default_factory=GepoSection)
    opefo: OpefoSection = field(default_factory=OpefoSection)
    quatro: QuatroSection = field(default_factory=QuatroSection)
    grade: GradeSection = field(default_factory=GradeSection)
