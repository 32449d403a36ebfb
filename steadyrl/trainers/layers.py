"""One factory per guard layer: its ``guards.<layer>`` section -> the SteadyGRPOTrainer keyword arguments it fills.

A factory returns nothing for a disabled layer. ``layer_kwargs`` merges them in the order data meets the layers
(GRADE, GEPO, OPEFO, QUATRO); a key an earlier layer filled wins (GEPO's step guard, with its spike test, over
OPEFO's non-finite-only one).

``mode: observe`` (docs/DESIGN.md, "Observe mode"): a factory fills the ``observe_*`` keys instead of the acting
ones (GEPO, GRADE) or builds its runtime with ``observe=True`` (OPEFO, QUATRO). OPEFO's non-finite-only step guard
acts when OPEFO acts and GEPO gives no acting guard (a non-finite gradient must not reach Adam's moments even
while GEPO observes), and observes when OPEFO observes and GEPO gives no guard at all. Options that only matter
when a layer acts are logged once here.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from steadyrl.config.guard_sections import GepoSection, GradeSection, GuardsSection, OpefoSection, QuatroSection
from steadyrl.guards.reward_scaler import GradeScaler
from steadyrl.guards.robust_advantage import GEPOAdvantage
from steadyrl.guards.spike import SpikeConfig, SpikeGuard

logger = logging.getLogger(__name__)


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
            logger.info("guards.grade.kl_compensation: in observe mode logged as grade/kl_factor_would, not applied")
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


def layer_kwargs(guards: GuardsSection) -> dict[str, Any]:
    """SteadyGRPOTrainer's extension points filled from the ``guards`` section (nothing when all are off)."""
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
    return out
