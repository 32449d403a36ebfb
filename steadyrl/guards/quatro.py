"""QUATRO loop layer (docs/DESIGN.md, the "QUATRO" sections): the config a trainer takes.

Its parts: ``kl_controller``, ``entropy_floor``, ``rollout_filters`` and ``replay`` (per rank); the caller passes
values identical on all ranks. The stations in ``steadyrl.trainers`` (``rollout``, ``loss``, ``step_end``) run them.
"""

from __future__ import annotations

from dataclasses import dataclass

from steadyrl.guards.entropy_floor import EntropyConfig
from steadyrl.guards.gold_watch import GoldConfig
from steadyrl.guards.kl_controller import KLConfig
from steadyrl.guards.replay import ReplayConfig
from steadyrl.guards.rollout_filters import FilterConfig


@dataclass
class QuatroConfig:
    """The parts of QUATRO a trainer runs; None turns a part off (``guards.quatro`` -> ``QuatroSection.to_config``)."""

    kl: KLConfig | None = None
    entropy: EntropyConfig | None = None
    filters: FilterConfig | None = None
    replay: ReplayConfig | None = None
    gold: GoldConfig | None = None  # the gold watch (a trainer runs it on TRL's own eval; build.py on steadyrl's)
