"""The config tree: ``RunConfig`` (typed sections, strict validation, contradiction checks).

``RunConfig.from_tree`` turns a merged YAML tree into typed sections (``sections``, ``guard_sections``, ``typed``);
unknown keys, wrong types, keys the run would never read (``ignored``) and contradictions (``checks``) raise
``ConfigError`` naming the key, the file that set it and the fix, before anything loads. The ``trainer`` section goes
unchanged to the algorithm's TRL config class, whose fields its keys are checked against.
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
