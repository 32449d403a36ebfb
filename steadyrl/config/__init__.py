"""One config tree per run: load (with ``extends:`` and overrides), validate, check contradictions."""

from __future__ import annotations

from pathlib import Path

from steadyrl.config.loader import ConfigError, load_config_tree
from steadyrl.config.schema import RunConfig, check_contradictions


def load_config(path: str | Path, overrides: list[str] | None = None, world_size: int | None = None) -> RunConfig:
    """Load, validate and cross-check a run config. Raises ConfigError before anything heavy is loaded."""
    tree, origins = load_config_tree(path, overrides)
    cfg = RunConfig.from_tree(tree, origins)
    check_contradictions(cfg, world_size)
    return cfg


__all__ = ["ConfigError", "RunConfig", "load_config"]
