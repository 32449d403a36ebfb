"""The guard layers' parts of a ``SteadyGRPOTrainer`` (``GuardParts``), and one factory per layer: its
``guards.<layer>`` section -> the parts it fills (nothing when disabled); ``guard_parts`` merges them, a part an
earlier layer filled winning. A layer in ``mode: observe`` fills the same parts and is named in ``GuardParts.observe``
(docs/DESIGN.md, "Observe mode"). OPEFO's non-finite-only step guard is left out when GEPO's step guard acts, or
observes next to an observing OPEFO.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from steadyrl.config.guard_sections import GepoSection, GradeSection, GuardsSection, OpefoSection, QuatroSection
from steadyrl.evidence.early_warnings import MonitorConfig
from steadyrl.guards.base import AdvantageFunction, RewardProcessor, StepGuard
from steadyrl.guards.mismatch import MismatchConfig, MismatchGate
from steadyrl.guards.reward_scaler import GradeScaler
from steadyrl.guards.robust_advantage import GEPOAdvantage
from steadyrl.guards.spike import SpikeConfig, SpikeGuard

if TYPE_CHECKING:
    from steadyrl.guards.opefo import OpefoConfig
    from steadyrl.guards.quatro import QuatroConfig

logger = logging.getLogger(__name__)


@dataclass
class GuardParts:
    """What the guard layers put into a ``SteadyGRPOTrainer``; every part is optional, none at all is plain TRL.
    ``reward_processor``: the batch's raw rewards -> scaled (GRADE); ``advantage_fn``: grouped rewards (P, G) ->
    advantages (GEPO; default TRL's normalisation); ``step_guards``: asked with the global pre-clip gradient norm
    before every optimizer step; ``logprob_min``: the per-token log-prob floor; ``finite_checks``: count non-finite
    log-probs, ratios and losses; ``kl_compensation``: (lo, hi) clamp of GRADE's factor of beta; ``opefo`` /
    ``quatro``: the configs the stations build their pieces from; ``micro_batch_guard``: judges each micro-batch's
    own gradient; ``nonfinite_guard``: OPEFO's non-finite-only step guard; ``stateful``: extra named objects saved in
    every checkpoint; ``mismatch``: measure the vLLM rollout-trainer mismatch (``mismatch/*``); ``monitor``: GEPO's
    early warnings (the trainer adds a ``SignalMonitor`` unless one is among its callbacks); ``observe``: the
    layers in observe mode, whose parts log their decision under its ``would`` name
    and do not apply it (docs/DESIGN.md, "Observe mode")."""

    reward_processor: RewardProcessor | None = None
    advantage_fn: AdvantageFunction | None = None
    step_guards: list[StepGuard] = field(default_factory=list)
    logprob_min: float | None = None
    finite_checks: bool = False
    kl_compensation: tuple[float, float] | None = None
    opefo: OpefoConfig | None = None
    quatro: QuatroConfig | None = None
    micro_batch_guard: SpikeGuard | None = None
    nonfinite_guard: StepGuard | None = None
    stateful: dict[str, Any] = field(default_factory=dict)
    observe: frozenset[str] = frozenset()
    mismatch: MismatchConfig | None = None
    monitor: MonitorConfig | None = None  # GEPO's early warnings (SignalMonitor), when on

    @property
    def any_step_guard(self) -> bool:
        return bool(self.step_guards) or self.nonfinite_guard is not None

    def step_guards_in(self, observing: bool) -> list[StepGuard]:
        """The step guards observing (True) or acting (False): GEPO's in GEPO's mode, OPEFO's in OPEFO's."""
        own = [(g, "gepo") for g in self.step_guards]
        if self.nonfinite_guard is not None:
            own.append((self.nonfinite_guard, "opefo"))
        return [g for g, layer in own if (layer in self.observe) == observing]

    @property
    def rewrites_advantages(self) -> bool:
        """Whether steadyrl computes the advantages (else TRL's stay untouched)."""
        filters = self.quatro is not None and self.quatro.filters is not None
        return filters or self.reward_processor is not None or self.advantage_fn is not None


def grade_layer(section: GradeSection) -> dict[str, Any]:
    """GRADE: the reward processor, and the clamp of its KL compensation factor when that is on."""
    if not section.enabled:
        return {}
    out: dict[str, Any] = {"reward_processor": GradeScaler(section.to_config())}
    if section.kl_compensation:
        out["kl_compensation"] = tuple(section.kl_compensation_range)
    if section.observing:
        logger.info("guards.grade observe mode: rewards are scaled and logged (grade/*); advantages use the raw ones")
        if section.kl_compensation:
            logger.info("guards.grade.kl_compensation: in observe mode logged as grade/would_kl_factor, not applied")
    return out


def gepo_layer(section: GepoSection) -> dict[str, Any]:
    """GEPO: median/MAD advantages, the log-prob floor, finite checks, the spike-skip step guard, the mismatch
    measurement and its ESS gate."""
    if not section.enabled:
        return {}
    out: dict[str, Any] = {"finite_checks": True}  # counting only, in either mode
    if section.monitor.enabled:
        out["monitor"] = section.monitor
    if section.advantage.enabled:
        out["advantage_fn"] = GEPOAdvantage.from_config(section.advantage.to_config())
    spike = section.spike.to_config()
    if not section.spike.enabled:  # finite checks stay: a non-finite gradient norm still skips the step
        spike = dataclasses.replace(spike, min_ratio=math.inf)
    out.update({"logprob_min": section.logprob_min, "step_guards": [SpikeGuard(spike)]})
    if section.mismatch.enabled:
        out["mismatch"] = section.mismatch
        if section.mismatch.ess_min is not None:
            out["step_guards"].append(MismatchGate(section.mismatch.ess_min, section.mismatch.max_consecutive_skips))
    if spike.granularity == "micro_batch":  # a second guard, own baseline, on each micro-batch's own gradient
        out["micro_batch_guard"] = SpikeGuard(spike)
    if section.observing:
        logger.info(
            "guards.gepo observe mode: TRL's advantages train, no step is skipped and no log-prob is clamped; "
            "GEPO's decisions are counted (gepo/would_*). A non-finite loss reaches the weights as in plain TRL"
        )
    return out


def opefo_layer(section: OpefoSection) -> dict[str, Any]:
    """OPEFO: its config, finite checks, and a non-finite-only step guard (a non-finite gradient must never reach
    Adam's moments)."""
    if not section.enabled:
        return {}
    nonfinite_only = SpikeGuard(SpikeConfig(min_ratio=math.inf))
    out: dict[str, Any] = {"opefo": section.to_config(), "finite_checks": True, "nonfinite_guard": nonfinite_only}
    if section.observing and section.rollback.enabled and section.rollback.storage == "disk":
        logger.info("guards.opefo.rollback.storage=disk: no snapshot is written in observe mode")
    return out


def quatro_layer(section: QuatroSection) -> dict[str, Any]:
    """QUATRO: the config of its enabled parts."""
    return {"quatro": section.to_config()} if section.enabled else {}


LAYERS: dict[str, Callable[[Any], dict[str, Any]]] = {"grade": grade_layer, "gepo": gepo_layer, "opefo": opefo_layer,
                                                      "quatro": quatro_layer}  # fmt: skip


def guard_parts(guards: GuardParts | GuardsSection | dict[str, Any] | str | None) -> GuardParts:
    """``GuardParts`` from ``"all"`` (every layer on, shipped defaults), a ``GuardsSection``, a dict shaped like the
    YAML ``guards:`` section (validated like it: unknown keys raise ``ConfigError``), parts as they are, or None."""
    from steadyrl.config.typed import _build

    if guards is None or isinstance(guards, GuardParts):
        return guards or GuardParts()
    if guards == "all":
        guards = {layer: {"enabled": True} for layer in ("gepo", "opefo", "quatro", "grade")}
    if isinstance(guards, dict):
        guards = _build(GuardsSection, guards, "guards", {})
    if not isinstance(guards, GuardsSection):
        raise TypeError(f'guards= takes "all", a GuardsSection, a dict or GuardParts, got {type(guards).__name__}')
    sections = {name: getattr(guards, name) for name in LAYERS}
    out: dict[str, Any] = {"observe": frozenset(n for n, s in sections.items() if s.enabled and s.observing)}
    for name, factory in LAYERS.items():
        filled = factory(sections[name])
        if name == "opefo" and "step_guards" in out and ("gepo" not in out["observe"] or "opefo" in out["observe"]):
            filled.pop("nonfinite_guard", None)  # GEPO's guard covers non-finite norms
        for key, value in filled.items():
            out.setdefault(key, value)
    return GuardParts(**out)
