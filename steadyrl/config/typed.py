"""From a merged YAML tree to typed sections: strict keys, types, and the ``trainer`` section against TRL's config.

Unknown keys, wrong types and out-of-range values raise ``ConfigError`` naming the key and the file that set it.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from steadyrl.config.loader import ConfigError, FieldValueError, Origins
from steadyrl.ranges import RangeError

SCALARS = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}  # an int is a valid float: kept as is
UNION_TYPES = (typing.Union, types.UnionType)


def _where(dotted: str, origins: Origins) -> str:
    origin = origins.get(dotted)
    return f"{dotted} (set in {origin}): " if origin else f"{dotted}: "


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def did_you_mean(name: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.6)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _coerce(value: Any, tp: Any, dotted: str, origins: Origins) -> Any:
    """Check ``value`` against annotation ``tp``; convert what YAML gets wrong (``1e-6`` is a str in YAML 1.1)."""
    origin = typing.get_origin(tp)
    if origin in UNION_TYPES:
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, dotted, origins)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[-1] if errors else ConfigError(_where(dotted, origins) + f"invalid value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(_where(dotted, origins) + f"expected a mapping (section), got {value!r}")
        return _build(tp, value, dotted, origins)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(_where(dotted, origins) + f"expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{dotted}[{i}]", origins) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(_where(dotted, origins) + f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp in tuple(SCALARS) and isinstance(value, SCALARS[tp]) and (tp is bool or not isinstance(value, bool)):
        return value  # TrainingArguments reads 500 and 0.1 differently: an int stays an int
    if tp is float and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    type_name = getattr(tp, "__name__", str(tp)).replace("typing.", "")
    raise ConfigError(_where(dotted, origins) + f"expected {type_name}, got {value!r} ({type(value).__name__})")


def _build(cls: type, data: dict[str, Any], prefix: str, origins: Origins) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = _join(prefix, str(key))
        if key not in fields:
            raise ConfigError(
                _where(dotted, origins)
                + f"unknown key {key!r}.{did_you_mean(str(key), fields)} Valid keys here: {sorted(fields)}"
            )
        kwargs[key] = _coerce(value, hints[key], dotted, origins)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in kwargs:
            raise ConfigError(f"{_join(prefix, name)}: required key is missing")
    try:
        return cls(**kwargs)
    except RangeError as exc:  # declared ranges (steadyrl.ranges): each key, the file that set it, its range
        problems = [_where(_join(prefix, k), origins) + text for k, text in exc.problems]
        raise ConfigError("; ".join(problems)) from exc
    except FieldValueError as exc:  # a section's own check of one key
        raise ConfigError(_where(_join(prefix, exc.key), origins) + exc.message) from exc
    except ValueError as exc:  # a section's own range checks (__post_init__)
        raise ConfigError(f"{prefix or 'config'}: {exc}") from exc


def trl_config_class(algorithm: str) -> type:
    """The TRL config class whose fields the ``trainer`` section holds."""
    if algorithm == "ppo":
        from steadyrl.trainers.ppo_config import SteadyPPOConfig

        return SteadyPPOConfig
    import trl

    return getattr(trl, {"sft": "SFTConfig", "reward": "RewardConfig"}.get(algorithm, "GRPOConfig"))


def _accepts(tp: Any, kind: type) -> bool:
    """Whether annotation ``tp`` admits values of ``kind`` (looking inside unions)."""
    if tp is Any or tp is kind:
        return True
    return typing.get_origin(tp) in UNION_TYPES and any(_accepts(t, kind) for t in typing.get_args(tp))


# transformers 5.20 renamed these TrainingArguments fields; vLLM 0.31 (the newest TRL 1.16 supports) needs
# transformers < 5.18. Either spelling is accepted and passed on under the name the installed version has.
RENAMED_TRAINER_KEYS = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


def rename_for_installed(trainer: dict[str, Any], valid: typing.Container[str], origins: Origins) -> None:
    """Rewrite ``RENAMED_TRAINER_KEYS`` (either spelling) in place to the one the installed TRL config accepts."""
    for new_name, old_name in RENAMED_TRAINER_KEYS.items():
        if new_name in trainer and old_name in trainer:  # on every version: one setting, two spellings
            raise ConfigError(
                _where(f"trainer.{new_name}", origins) + f"trainer.{old_name} is set too; they are one setting "
                f"(transformers 5.20 renamed {old_name} to {new_name}): keep one"
            )
        for key, other in ((new_name, old_name), (old_name, new_name)):
            if key in trainer and key not in valid and other in valid:
                trainer[other] = trainer.pop(key)
                if f"trainer.{key}" in origins:
                    origins[f"trainer.{other}"] = origins[f"trainer.{key}"]


def _check_trainer_keys(cfg: Any, origins: Origins) -> None:
    """``cfg.trainer`` (of a RunConfig) against the algorithm's TRL config class; scalar values coerced in place."""
    config_cls = trl_config_class(cfg.algorithm)
    valid = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    hints = typing.get_type_hints(config_cls)
    rename_for_installed(cfg.trainer, valid, origins)
    for key, value in list(cfg.trainer.items()):
        dotted = f"trainer.{key}"
        if key not in valid:
            raise ConfigError(
                _where(dotted, origins)
                + f"unknown key {key!r} for trl.{config_cls.__name__}.{did_you_mean(key, valid)}"
            )
        tp = hints.get(key, Any)
        if isinstance(value, bool) and not _accepts(tp, bool) and _accepts(tp, str):
            raise ConfigError(
                _where(dotted, origins) + f"got the boolean {value}, but this field takes a string. YAML reads "
                f'unquoted yes/no/on/off as booleans: quote the value, e.g. {key}: "no"'
            )
        if tp in tuple(SCALARS) or (
            typing.get_origin(tp) in UNION_TYPES and set(typing.get_args(tp)) <= {*SCALARS, type(None)}
        ):
            cfg.trainer[key] = _coerce(value, tp, dotted, origins)
    if "output_dir" not in cfg.trainer:
        raise ConfigError("trainer.output_dir: required key is missing (where checkpoints and logs go)")
