"""Keys a run would accept and never read, refused before anything loads: an option that is not wired is a config
error, never a silent no-op.

``READ_BY``: for each key (or section) the algorithms that read it, why the others do not, the fix, and when it is
read at all. A key that differs from its default and that this run does not read raises a ConfigError naming the key,
the algorithm and the fix.

A section switched off with ``enabled: false`` in the config keeps its other settings (ablations, preflight's
calibrated values). Under a section that is off by default and that the config never switches, a setting is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from steadyrl.config.loader import ConfigError, Origins
from steadyrl.config.sections import ALGORITHMS
from steadyrl.config.typed import _where

ALL = ALGORITHMS
TRAINING = ("grpo", "ppo", "sft")  # the algorithms that run steadyrl's build_trainer
RL = ("grpo", "ppo")


class Cond(NamedTuple):
    """A key is read only while ``test(cfg, section holding the key)`` holds; ``why`` completes "ignores it ..."."""

    test: Callable[[Any, Any], bool]
    why: str
    fix: str = "remove it"


class Read(NamedTuple):
    """``by``: the algorithms whose code path reads the key; ``why``: why the others do not; ``fix``: what to do."""

    by: tuple[str, ...]
    why: str = ""
    fix: str = "remove it"
    only_if: tuple[Cond, ...] = ()


def _local(path: str | None) -> bool:  # steadyrl.data reads a local file whole, one split
    return path is not None and Path(path).suffix in (".jsonl", ".json", ".parquet", ".csv")


def _builtin(path: str | None) -> bool:
    return path is not None and path.startswith("builtin:")


def _hub(path: str | None) -> bool:
    return path is not None and not _local(path) and not _builtin(path)


def _eval_data(cfg: Any) -> bool:
    return cfg.data.eval_split is not None or cfg.data.eval_path is not None


GUARDS = "the guard layers act on GRPO and PPO steps; SFT runs TRL's SFTTrainer and the reward stage its RewardTrainer"
GOLD_RL = "the reward-hacking watch runs beside GRPO's and PPO's periodic eval"
PPO_ONLY = "the ppo section configures algorithm: ppo (critic, GAE)"
REWARD_STAGE = "the reward stage (steadyrl.trainers.reward_model) trains on preference pairs with TRL's RewardTrainer"
SFT_EVAL = "SFT calls its rewards only to score the eval split after training"
RL_PERIODIC = "SFT evaluates once, after training (TRL's SFTTrainer gets no periodic eval)"
NO_SIGNALS = "the reward stage installs no signal handler"

BUILTIN_TINY = "builtin:tiny-llama"

# the conditions under which a key is read at all: (test on the config and the key's section, why not, fix)
TINY_MODEL = Cond(
    lambda cfg, m: m.path == BUILTIN_TINY,
    "unless model.path is builtin:tiny-llama (the model it builds)",
    "set model.path=builtin:tiny-llama, or remove it",
)
HUB_DATA = Cond(
    lambda cfg, d: _hub(d.path) or _hub(d.eval_path),
    "unless data.path or data.eval_path is a `datasets` name (it picks that dataset's configuration)",
)
SPLITS = Cond(lambda cfg, d: not _local(d.path), "when data.path is a local file (read whole, one split)")
EVAL_SPLIT = Cond(
    lambda cfg, d: not _local(d.path),
    "when data.path is a local file (read whole: the eval rows would be the training rows)",
    "put the eval rows in a file of their own and set data.eval_path",
)
NO_EVAL_PATH = Cond(lambda cfg, d: d.eval_path is None, "when data.eval_path is set (it wins)", "remove one of them")
BUILTIN_DATA = Cond(
    lambda cfg, d: _builtin(d.path) or _builtin(d.eval_path),
    "unless data.path or data.eval_path is a built-in task (it holds the task generator's arguments)",
)
SFT_EVAL_DATA = Cond(
    lambda cfg, _: cfg.algorithm != "sft" or _eval_data(cfg),
    f"without eval data ({SFT_EVAL})",
    "set data.eval_split or data.eval_path, or remove the rewards list",
)
FN_ONLY = Cond(lambda cfg, r: r.fn is not None, "on a reward `model` entry (TRL loads it by path)")
KWARGS_FN_ONLY = Cond(
    lambda cfg, r: r.fn is not None,
    "on a reward `model` entry (TRL loads the model by path and calls it without arguments)",
    "remove kwargs, or score through a function that takes them, e.g. fn: "
    "steadyrl.trainers.reward_model:reward_model_score with kwargs: {path: <reward model folder>}",
)
# null (wait) is accepted on a model entry, as RewardSection accepts it
TIMEOUT_FN_ONLY = FN_ONLY._replace(test=lambda cfg, r: r.fn is not None or r.timeout is None)
RETRYING = Cond(
    lambda cfg, r: r.on_error in ("retry", "skip"),
    "with on_error: raise (the first error stops the run)",
    "set on_error: retry or skip, or remove it",
)
SKIPPING = Cond(
    lambda cfg, r: r.on_error == "skip",
    "unless on_error is skip (it counts skipped calls)",
    "set on_error: skip, or remove it",
)
KL_COMPENSATION = Cond(
    lambda cfg, g: g.kl_compensation,
    "while guards.grade.kl_compensation is false",
    "set guards.grade.kl_compensation=true, or remove it",
)
EVAL = (
    Cond(lambda cfg, _: _eval_data(cfg), "without eval data", "set data.eval_split or data.eval_path, or remove it"),
    Cond(
        lambda cfg, _: any(r.fn is not None for r in cfg.rewards),
        "without a `fn` reward (evals score with the run's reward functions; a reward `model` entry is not called)",
        "add a `fn` reward, or remove it",
    ),
)
PERIODIC = Cond(
    lambda cfg, e: e.every > 0, "while eval.every is 0 (no periodic eval)", "set eval.every > 0, or remove it"
)

EVAL_ON = Cond(
    lambda cfg, _: cfg.eval.enabled,
    "while eval.enabled is false (the watch reads the periodic eval)",
    "set eval.enabled=true, or remove it",
)
GOLD_PERIODIC = Cond(
    lambda cfg, _: cfg.eval.every > 0,
    "while eval.every is 0 (the watch reads the periodic eval)",
    "set eval.every > 0, or remove it",
)
VLLM = Cond(
    lambda cfg, _: bool(cfg.trainer.get("use_vllm")),
    "while trainer.use_vllm is false (transformers generates with the trained weights: there is no mismatch)",
    "set trainer.use_vllm=true, or remove it",
)


def _rows(prefix: str, keys: str, row: Read) -> dict[str, Read]:
    return {f"{prefix}{key}": row for key in keys.split()}


# A section's row covers its keys that have none of their own. PPO's refusals of GRPO-only mechanisms that are on by
# default (gepo.advantage, quatro.filters.zero_variance, quatro.entropy.gate_reward) stay in steadyrl.config.checks,
# where they name the PPO alternative.
READ_BY: dict[str, Read] = {
    **_rows("", "algorithm trainer model data", Read(ALL)),  # trainer: checked against the algorithm's TRL config
    "model.tiny": Read(ALL, only_if=(TINY_MODEL,)),
    "data.name": Read(ALL, only_if=(HUB_DATA,)),
    "data.split": Read(ALL, only_if=(SPLITS,)),
    "data.eval_split": Read(ALL, only_if=(EVAL_SPLIT, NO_EVAL_PATH)),
    "data.chat_template": Read(TRAINING, why=f"{REWARD_STAGE}, tokenized with the model's own template"),
    "data.builtin": Read(ALL, only_if=(BUILTIN_DATA,)),
    "data.on_bad_row": Read(RL, why="only GRPO and PPO prompts are checked row by row (steadyrl.data_rows)"),
    "rewards": Read(
        TRAINING, why=f"{REWARD_STAGE}; it calls no reward", fix="remove the rewards list", only_if=(SFT_EVAL_DATA,)
    ),
    **_rows("rewards[].", "name fn", Read(TRAINING)),
    "rewards[].model": Read(RL, why=f"{SFT_EVAL}, with its `fn` rewards only", fix="remove the entry"),
    "rewards[].weight": Read(RL, why=f"{SFT_EVAL}, each reward on its own (no weighted sum)"),
    "rewards[].kwargs": Read(TRAINING, only_if=(KWARGS_FN_ONLY,)),
    "rewards[].on_error": Read(TRAINING, only_if=(FN_ONLY,)),  # RewardSection refuses it first, with its own message
    "rewards[].timeout": Read(TRAINING, only_if=(TIMEOUT_FN_ONLY,)),
    **_rows("rewards[].", "retries backoff", Read(TRAINING, only_if=(FN_ONLY, RETRYING))),
    "rewards[].max_consecutive_errors": Read(TRAINING, only_if=(FN_ONLY, SKIPPING)),
    "peft": Read(TRAINING, why="the reward stage trains the full model", fix="remove the peft section"),
    **_rows("peft.", "r lora_alpha lora_dropout target_modules bias modules_to_save", Read(TRAINING)),
    # a guard's sections go whole to the guard, so a new option of it is read where the guard is
    **_rows("guards.", "gepo opefo quatro grade", Read(RL, why=GUARDS)),
    "guards.gepo.advantage": Read(
        ("grpo",),
        why=f"PPO's advantages come from GAE (its tanh clip is ppo.soft_clip); {GUARDS}",
        fix="remove it (for PPO: ppo.soft_clip)",
    ),
    "guards.gepo.advantage.enabled": Read(RL, why=GUARDS),  # PPO must be able to switch it off
    "guards.gepo.mismatch": Read(
        ("grpo",), why=f"PPO's vLLM rollouts are not measured yet; {GUARDS}", fix="remove it", only_if=(VLLM,)
    ),
    "guards.gepo.mismatch.enabled": Read(RL, why=GUARDS),  # switching it off is never an error
    "guards.quatro.gold": Read(RL, why=GOLD_RL, fix="remove it", only_if=(EVAL_ON, GOLD_PERIODIC, *EVAL)),
    "guards.quatro.gold.enabled": Read(RL, why=GUARDS),  # switching it off is never an error
    "guards.grade.kl_compensation_range": Read(RL, why=GUARDS, only_if=(KL_COMPENSATION,)),
    "eval.enabled": Read(TRAINING, why=f"{REWARD_STAGE}; its held-out check is the calibration report"),
    **_rows("eval.", "max_new_tokens batch_size metric max_samples", Read(TRAINING, why=REWARD_STAGE, only_if=EVAL)),
    "eval.every": Read(RL, why=RL_PERIODIC, only_if=EVAL),
    **_rows("eval.", "samples_to_log on_start do_sample", Read(RL, why=RL_PERIODIC, only_if=(PERIODIC, *EVAL))),
    "ppo": Read(("ppo",), why=PPO_ONLY),
    "preemption": Read(TRAINING, why=NO_SIGNALS),
    "callbacks": Read(TRAINING, why="the reward stage builds its Trainer with its own callbacks"),
}


def lookup(key: str) -> Read | None:
    """The row for ``key`` (``rewards[].weight`` form): its own, else its nearest section's; None when there is none."""
    parts = key.split(".")
    return next((READ_BY[k] for n in range(len(parts), 0, -1) if (k := ".".join(parts[:n])) in READ_BY), None)


@dataclasses.dataclass
class SetKey:
    """A key whose value differs from its default; ``ancestors``: the (dotted path, section) above it, outermost
    first, the last holding the key."""

    dotted: str  # rewards[0].weight
    row_key: str  # rewards[].weight
    value: Any
    default: Any
    ancestors: list[tuple[str, Any]]


def set_keys(obj: Any, prefix: str = "", row_prefix: str = "", ancestors: list | None = None) -> Iterator[SetKey]:
    """Every key of the dataclass ``obj`` that differs from its default, walking sections and lists of sections (a
    present optional section or list counts as set itself; list entries as ``rewards[0].weight``)."""
    ancestors = [*(ancestors or []), (prefix, obj)]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        dotted = f"{prefix}.{f.name}" if prefix else f.name
        row_key = f"{row_prefix}.{f.name}" if row_prefix else f.name
        if dataclasses.is_dataclass(value):
            if default is None:  # an optional section: being there is a setting
                yield SetKey(dotted, row_key, value, default, ancestors)
            yield from set_keys(value, dotted, row_key, ancestors)
        elif isinstance(value, list) and value and all(dataclasses.is_dataclass(v) for v in value):
            yield SetKey(dotted, row_key, value, default, ancestors)
            for i, entry in enumerate(value):
                yield from set_keys(entry, f"{dotted}[{i}]", f"{row_key}[]", ancestors)
        elif default is dataclasses.MISSING or value != default:
            yield SetKey(dotted, row_key, value, default, ancestors)


def _written(tree: dict[str, Any], dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _fix(fix: str, key: SetKey) -> str:
    """``fix``, with the default a child config can set instead when it cannot remove a key its parent wrote."""
    if fix.endswith("remove it") and key.default is not dataclasses.MISSING and not dataclasses.is_dataclass(key.value):
        return f"{fix} (its default: {key.default!r})"
    return fix


def ignored_reason(cfg: Any, key: SetKey, tree: dict[str, Any]) -> str | None:
    """Why this run ignores ``key`` and what to do (``why; fix``), or None when the run reads it."""
    row, alg = lookup(key.row_key), cfg.algorithm
    if row is None:  # a key without a row (tests/unit/test_ignored_keys.py fails on it): let it through
        return None
    if key.dotted.endswith(".enabled") and key.value is False:
        return None  # switching a part off is never an error, whatever runs (a shared base config's preemption)
    if alg not in row.by:
        return f"algorithm {alg} ignores it: {row.why}; {_fix(row.fix, key)}"
    for dotted, section in key.ancestors[1:]:  # the sections above the key, the run config itself excluded
        if getattr(section, "enabled", None) is not False or key.dotted == f"{dotted}.enabled":
            continue
        if _written(tree, f"{dotted}.enabled") or (key.dotted.endswith(".enabled") and key.value is False):
            return None  # switched off with its settings kept for when it is on; or a part switched off under it
        return (
            f"algorithm {alg} ignores it while {dotted} is off ({dotted}.enabled is false by default and this "
            f"config does not set it); set {dotted}.enabled=true, or {_fix('remove it', key)}"
        )
    cond = next((c for c in row.only_if if not c.test(cfg, key.ancestors[-1][1])), None)
    return None if cond is None else f"algorithm {alg} ignores it {cond.why}; {_fix(cond.fix, key)}"


def check_ignored_keys(cfg: Any, tree: dict[str, Any], origins: Origins | None = None) -> None:
    """Refuse every key this run would accept and never read (``READ_BY``) in one ConfigError; ``tree``: the merged
    config tree (a section's ``enabled: false`` there keeps its settings)."""
    origins = origins or {}
    reasons = ((key, ignored_reason(cfg, key, tree)) for key in set_keys(cfg))
    errors = [_where(key.dotted, origins) + reason for key, reason in reasons if reason is not None]
    if errors:
        raise ConfigError("\n".join(errors))
