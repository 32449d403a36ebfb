"""YAML loading: ``extends:`` composition, dotted ``key=value`` overrides, origin tracking.

A config file may name a parent with ``extends: ../base/grpo.yaml`` (relative to the file), loaded first; the child
is deep-merged over it (mappings merge key by key, anything else is replaced whole). Each leaf remembers the file
(or ``command line``) that set it, so validation errors can say where a bad key came from.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config problem, reported before any model or dataset is loaded."""


class FieldValueError(ValueError):
    """A section's own check (``__post_init__``) rejecting one of its keys: the loader names ``<section>.<key>``
    and the file that set it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message


Origins = dict[str, str]  # dotted key -> file that set it (or "command line")


def _record(tree: Any, prefix: str, origin: str, origins: Origins) -> None:
    """Note ``origin`` for every key under ``prefix``, list entries included (``rewards[0].weight``)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            origins[dotted] = origin
            _record(value, dotted, origin, origins)
    elif isinstance(tree, list):  # a list replaces the parent's whole: forget the parent's entries first
        for stale in [k for k in origins if k.startswith(f"{prefix}[")]:
            del origins[stale]
        for i, value in enumerate(tree):
            origins[f"{prefix}[{i}]"] = origin
            _record(value, f"{prefix}[{i}]", origin, origins)


def deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Merge ``child`` into a copy of ``base``: dicts merge recursively, other values are replaced."""
    out = copy.deepcopy(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_tree(path: str | Path, _chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], Origins]:
    """Load ``path`` with its ``extends:`` chain resolved. Returns (merged tree, origins)."""
    path = Path(path).resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise ConfigError(f"extends: cycle in config files: {cycle}")
    data = _read_yaml(path)
    parent = data.pop("extends", None)
    tree: dict[str, Any] = {}
    origins: Origins = {}
    if parent is not None:
        if not isinstance(parent, str):
            raise ConfigError(f"{path}: 'extends' must be a path string, got {parent!r}")
        parent_path = (path.parent / parent).resolve()
        if not parent_path.is_file():
            raise ConfigError(f"{path}: extends '{parent}', but {parent_path} does not exist")
        tree, origins = load_tree(parent_path, (*_chain, path))
    _record(data, "", str(path), origins)
    return deep_merge(tree, data), origins


def parse_override(text: str) -> tuple[list[str], Any]:
    """``trainer.learning_rate=1e-6`` -> (["trainer", "learning_rate"], 1e-6); the value is YAML-typed."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {exc}") from exc
    return parts, value


def load_config_tree(path: str | Path, overrides: list[str] | None = None) -> tuple[dict[str, Any], Origins]:
    """Load a config file, resolve ``extends:`` and apply ``section.key=value`` overrides in order (creating
    intermediate mappings). Returns (tree, origins)."""
    tree, origins = load_tree(path)  # a fresh tree (deep_merge copies)
    for text in overrides or []:
        parts, value = parse_override(text)
        node = tree
        for i, part in enumerate(parts[:-1]):
            child, where = node.get(part), ".".join(parts[: i + 1])
            if child is None:  # a section the command line creates: errors about it name the command line
                child = node[part] = {}
                origins[where] = "command line"
            elif not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{where}' is a value, not a section")
            node = child
        node[parts[-1]] = value
        origins[".".join(parts)] = "command line"
        _record(value, ".".join(parts), "command line", origins)
    return tree, origins


def load_object(spec: str, where: str) -> Any:
    """Import ``package.module:Name``; a ConfigError names ``where`` and the cause."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where}: {spec!r} is not of the form 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of the user's module is a config problem to report
        raise ConfigError(f"{where}: cannot import module {module_name!r}: {exc!r}") from exc
    if not hasattr(module, attr):
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)
