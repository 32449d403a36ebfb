"""The config tree: ``RunConfig`` (typed sections, strict validation, contradiction checks).

The pieces live beside it: ``sections`` (model, data, rewards, peft, eval, ppo), ``guard_sections`` (one shape per
guard layer), ``typed`` (tree -> dataclasses, the ``trainer`` keys against TRL), ``ignored`` (which algorithm reads
which key), ``checks`` (contradictions); this module re-exports the names the rest of steadyrl imports from it.

``RunConfig.from_tree`` turns a merged YAML tree into typed sections. Unknown keys, wrong types, keys the run would
never read (``ignored``) and contradictions raise ``ConfigError`` naming the key, the file that set it and the fix,
before any model or dataset is loaded. The ``trainer`` section is passed through unchanged to TRL's ``GRPOConfig``
(``SFTConfig`` for ``algorithm: sft``, ``RewardConfig`` for ``algorithm: reward``, steadyrl's ``SteadyPPOConfig`` --
GRPOConfig that accepts ``num_generations: 1`` -- for ``algorithm: ppo``); its keys are checked against that class's
fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from steadyrl.config.checks import check_contradictions, world_size_from_env
from steadyrl.config.guard_sections import GuardsSection
from steadyrl.config.ignored import check_ignored_keys
from steadyrl.config.loader import ConfigError, Origins, load_object
from steadyrl.config.sections import (
    ALGORITHMS,
    DataSection,
    EvalSection,
    ModelSection,
    PeftSection,
    PPOSection,
    PreemptionSection,
    RewardSection,
)
from steadyrl.config.typed import _build, _check_trainer_keys, _where, rename_for_installed, trl_config_class


@dataclass
class RunConfig:
    model: ModelSection
    data: DataSection
    trainer: dict[str, Any]
    algorithm: str = "grpo"
    rewards: list[RewardSection] = field(default_factory=list)
    peft: PeftSection | None = None
    guards: GuardsSection = field(default_factory=GuardsSection)
    eval: EvalSection = field(default_factory=EvalSection)
    ppo: PPOSection = field(default_factory=PPOSection)  # read only by algorithm: ppo
    preemption: PreemptionSection = field(default_factory=PreemptionSection)
    callbacks: list[str] = field(default_factory=list)  # extra TrainerCallback classes, "module:Class"

    @classmethod
    def from_tree(cls, tree: dict[str, Any], origins: Origins | None = None) -> RunConfig:
        """Validate a merged tree (after extends and overrides) into a RunConfig, or raise ConfigError."""
        origins = origins or {}
        cfg = _build(cls, tree, "", origins)
        if cfg.algorithm not in ALGORITHMS:
            raise ConfigError(
                _where("algorithm", origins) + f"unknown algorithm {cfg.algorithm!r}; valid: {list(ALGORITHMS)}"
            )
        _check_trainer_keys(cfg, origins)
        check_ignored_keys(cfg, tree, origins)  # keys this algorithm would accept and never read
        return cfg

    def to_tree(self) -> dict[str, Any]:
        """The resolved config as plain data (what ``resolved_config.yaml`` holds)."""
        return dataclasses.asdict(self)


__all__ = [  # what steadyrl imports from here
    "ALGORITHMS",
    "DataSection",
    "PPOSection",
    "RewardSection",
    "RunConfig",
    "check_contradictions",
    "load_object",
    "rename_for_installed",
    "trl_config_class",
    "world_size_from_env",
]
