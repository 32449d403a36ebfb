"""The guard layers' parts of a ``SteadyGRPOTrainer`` (``GuardParts``), and one factory per layer: its
``guards.<layer>`` section -> the parts it fills. A factory fills nothing for a disabled layer; ``guard_parts`` merges
them in the order data meets the layers (GRADE, GEPO, OPEFO, QUATRO), and a part an earlier layer filled wins
(GEPO's step guard, with its spike test, over OPEFO's non-finite-only one).

``mode: observe`` (docs/DESIGN.md, "Observe mode"): a factory fills the ``observe_*`` parts instead of the acting
ones (GEPO, GRADE) or builds its runtime with ``observe=True`` (OPEFO, QUATRO). OPEFO's non-finite-only step guard
acts when OPEFO acts and GEPO gives no acting guard, and observes when OPEFO observes and GEPO gives no guard at all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from steadyrl.config.guard_sections import GepoSection, GradeSection, GuardsSection, OpefoSection, QuatroSection
from steadyrl.guards.base import AdvantageFunction, RewardProcessor, StepGuard
from steadyrl.guards.reward_scaler import GradeScaler
from steadyrl.guards.robust_advantage import GEPOAdvantage
from steadyrl.guards.spike import SpikeConfig, SpikeGuard

if TYPE_CHECKING:
    from steadyrl.trainers.opefo_runtime import OpefoRuntime
    from steadyrl.trainers.quatro_runtime import QuatroRuntime

logger = logging.getLogger(__name__)


@dataclass
class GuardParts:
    """What the guard layers put into a ``SteadyGRPOTrainer``. Every part is optional; none at all is plain TRL.

    reward_processor: raw rewards of the whole generation batch -> scaled rewards (GRADE, ``RewardProcessor``).
    advantage_fn: grouped rewards (num_prompts, G) -> advantages (GEPO, ``AdvantageFunction``); default with only a
        reward processor: TRL's own group normalisation with ``args.scale_rewards``.
    step_guards: asked before every optimizer step with the global pre-clip gradient norm (``StepGuard``).
    logprob_min: clamp every per-token log-prob (policy, old and reference) at this floor; None leaves TRL's.
    finite_checks: count non-finite log-probs, importance ratios and losses per step (``gepo/nonfinite_*``).
    kl_compensation: (lo, hi) clamp of GRADE's KL factor of beta, or None.
    opefo / quatro: the OPEFO and QUATRO runtimes (``OpefoRuntime`` needs a step guard: the skip it feeds back).
    micro_batch_guard: a ``SpikeGuard`` judging each micro-batch's own gradient (``granularity: micro_batch``).
    stateful: extra named objects with ``state_dict``/``load_state_dict`` saved in every checkpoint.
    observe_*: the same parts observing (docs/DESIGN.md, "Observe mode"): decisions computed and logged as
        ``would`` metrics, never applied (``observe_rewards``: the reward processor runs, the raw rewards train).
    """

    reward_processor: RewardProcessor | None = None
    advantage_fn: AdvantageFunction | None = None
    step_guards: list[StepGuard] = field(default_factory=list)
    logprob_min: float | None = None
    finite_checks: bool = False
    kl_compensation: tuple[float, float] | None = None
    opefo: OpefoRuntime | None = None
    quatro: QuatroRuntime | None = None
    micro_batch_guard: SpikeGuard | None = None
    stateful: dict[str, Any] = field(default_factory=dict)
    observe_rewards: bool = False
    observe_advantage_fn: AdvantageFunction | None = None
    observe_step_guards: list[StepGuard] = field(default_factory=list)
    observe_logprob_min: float | None = None
    observe_micro_batch_guard: SpikeGuard | None = None

    @property
    def any_step_guard(self) -> bool:
        return bool(self.step_guards or self.observe_step_guards)

    @property
    def rewrites_advantages(self) -> bool:
        """Whether steadyrl computes the advantages (else TRL's stay untouched)."""
        filters = self.quatro is not None and self.quatro.filters_on
        parts = (self.reward_processor, self.advantage_fn, self.observe_advantage_fn)
        return filters or any(p is not None for p in parts)


def grade_layer(section: GradeSection) -> dict[str, Any]:
    """GRADE: the reward processor, and the clamp of its KL compensation factor when that is on."""
    if not section.enabled:
        return {}
    out: dict[str, Any] = {"reward_processor": GradeScaler(section.to_config())}
    if section.kl_compensation:
        out["kl_compensation"] = tuple(section.kl_compensation_range)
    if section.observing:
        out["observe_rewards"] = True
        logger.info("guards.grade observe mode: rewards are scaled and logged (grade/*); advantages use the raw ones")
        if section.kl_compensation:
            logger.info("guards.grade.kl_compensation: in observe mode logged as grade/would_kl_factor, not applied")
    return out


def gepo_layer(section: GepoSection) -> dict[str, Any]:
    """GEPO: median/MAD advantages, the log-prob floor, finite checks and the spike-skip step guard."""
    if not section.enabled:
        return {}
    out: dict[str, Any] = {}
    observe = "observe_" if section.observing else ""
    if section.advantage.enabled:
        out[f"{observe}advantage_fn"] = GEPOAdvantage.from_config(section.advantage.to_config())
    spike = section.spike.to_config()
    if not section.spike.enabled:  # finite checks stay: a non-finite gradient norm still skips the step
        spike = dataclasses.replace(spike, spike_factor=math.inf)
    out.update({f"{observe}logprob_min": section.logprob_min, f"{observe}step_guards": [SpikeGuard(spike)]})
    if spike.granularity == "micro_batch":  # a second guard, own EMA, on each micro-batch's own gradient
        out[f"{observe}micro_batch_guard"] = SpikeGuard(spike)
    out["finite_checks"] = True  # counting only, in either mode
    if section.observing:
        logger.info(
            "guards.gepo observe mode: TRL's advantages train, no step is skipped and no log-prob is clamped; "
            "GEPO's decisions are counted (gepo/would_*). A non-finite loss reaches the weights as in plain TRL"
        )
    return out


def opefo_layer(section: OpefoSection) -> dict[str, Any]:
    """OPEFO: the runtime, finite checks, and a non-finite-only step guard (a non-finite gradient must never reach
    Adam's moments; used when GEPO gives no step guard)."""
    if not section.enabled:
        return {}
    from steadyrl.trainers.opefo_runtime import OpefoRuntime

    nonfinite_only = SpikeGuard(SpikeConfig(spike_factor=math.inf))
    guards_key = "observe_step_guards" if section.observing else "step_guards"
    out = {"opefo": OpefoRuntime(section.to_config(), observe=section.observing), "finite_checks": True}
    out[guards_key] = [nonfinite_only]
    if section.observing and section.rollback.enabled and section.rollback.storage == "disk":
        logger.info("guards.opefo.rollback.storage=disk: no snapshot is written in observe mode")
    return out


def quatro_layer(section: QuatroSection) -> dict[str, Any]:
    """QUATRO: the runtime with its enabled parts."""
    if not section.enabled:
        return {}
    from steadyrl.trainers.quatro_runtime import QuatroRuntime

    return {"quatro": QuatroRuntime(section.to_config(), observe=section.observing)}


LAYERS: tuple[tuple[str, Callable[[Any], dict[str, Any]]], ...] = (
    ("grade", grade_layer),
    ("gepo", gepo_layer),
    ("opefo", opefo_layer),
    ("quatro", quatro_layer),
)


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
    out: dict[str, Any] = {}
    for name, factory in LAYERS:
        filled = factory(getattr(guards, name))
        if name == "opefo" and "step_guards" in out:  # GEPO's acting guard covers non-finite norms
            filled.pop("step_guards", None)
            filled.pop("observe_step_guards", None)
        if name == "opefo" and "observe_step_guards" in out and "observe_step_guards" in filled:
            filled.pop("observe_step_guards")  # GEPO observes already, non-finite norms included
        for key, value in filled.items():
            out.setdefault(key, value)
    return GuardParts(**out)
