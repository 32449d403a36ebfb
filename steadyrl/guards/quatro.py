"""QUATRO loop layer (docs/DESIGN.md, the "QUATRO" sections): the config a trainer takes.

QUATRO breaks the "bad policy -> bad rollouts -> worse policy" loop with four parts, each in its own module:
``kl_controller`` (adaptive KL coefficient), ``entropy_floor`` (entropy floor), ``rollout_filters`` (rollout quality
filters) and ``replay`` (rollout replay). Nothing in them knows about processes: the caller passes values that are
identical on all ranks (KL and entropy reduced over ranks, rewards and token ids gathered for the filters), so every
rank decides the same; the replay buffer is per rank. ``steadyrl.trainers.quatro_runtime`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

from steadyrl.guards.entropy_floor import EntropyConfig
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
