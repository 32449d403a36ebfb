"""One factory per guard layer: its ``guards.<layer>`` section -> the SteadyGRPOTrainer keyword arguments it fills.

A factory returns nothing for a disabled layer. ``layer_kwargs`` merges them in the order data meets the layers
(GRADE, GEPO, OPEFO, QUATRO); a key an earlier layer filled wins (GEPO's step guard, with its spike test, over
OPEFO's non-finite-only one).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from steadyrl.config.guard_sections import GepoSection, GradeSection, GuardsSection, OpefoSection, QuatroSection
from steadyrl.guards.reward_scaler import GradeScaler
from steadyrl.guards.robust_advantage import GEPOAdvantage
from steadyrl.guards.spike import SpikeConfig, SpikeGuard


def grade_layer(section: GradeSection) -> dict[str, Any]:
    """GRADE: the reward processor, and the clamp of its KL compensation factor when that is on."""
    if not section.enabled:
        return {}
    out: dict[str, Any] = {"reward_processor": GradeScaler(section.to_config())}
    if section.kl_compensation:
        out["kl_compensation"] = tuple(section.kl_compensation_range)
    return out


def gepo_layer(section: GepoSection) -> dict[str, Any]:
    """GEPO: median/MAD advantages, the log-prob floor, finite checks and the spike-skip step guard."""
    if not section.enabled:
        return {}
    out: dict[str, Any] = {}
    if section.advantage.enabled:
        out["advantage_fn"] = GEPOAdvantage.from_config(section.advantage.to_config())
    spike = section.spike.to_config()
    if not section.spike.enabled:  # finite checks stay: a non-finite gradient norm still skips the step
        spike = dataclasses.replace(spike, spike_factor=math.inf)
    out.update(logprob_min=section.logprob_min, finite_checks=True, step_guards=[SpikeGuard(spike)])
    return out


def opefo_layer(section: OpefoSection) -> dict[str, Any]:
    """OPEFO: the runtime, finite checks, and a non-finite-only step guard (a non-finite gradient must never reach
    Adam's moments; used when GEPO gives no step guard)."""
    if not section.enabled:
        return {}
    from steadyrl.trainers.opefo_runtime import OpefoRuntime

    nonfinite_only = SpikeGuard(SpikeConfig(spike_factor=math.inf))
    return {"opefo": OpefoRuntime(section.to_config()), "finite_checks": True, "step_guards": [nonfinite_only]}


def quatro_layer(section: QuatroSection) -> dict[str, Any]:
    """QUATRO: the runtime with its enabled parts."""
    if not section.enabled:
        return {}
    from steadyrl.trainers.quatro_runtime import QuatroRuntime

    return {"quatro": QuatroRuntime(section.to_config())}


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
        for key, value in factory(getattr(guards, name)).items():
            out.setdefault(key, value)
    return out
