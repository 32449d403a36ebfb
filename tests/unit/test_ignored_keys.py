"""Keys a run accepts and never reads are config errors (steadyrl.config.ignored): every key of every section, per
algorithm, is either read by that algorithm's code path or refused with the key, the algorithm and the fix."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from steadyrl.cli import main
from steadyrl.config import ConfigError, load_config
from steadyrl.config.ignored import READ_BY, lookup
from steadyrl.config.schema import ALGORITHMS, RunConfig

REPO = Path(__file__).resolve().parents[2]
COMMON: dict[str, Any] = {
    "model": {"path": "some/model"},
    "data": {"path": "builtin:arithmetic", "eval_split": "eval"},
    "rewards": [{"fn": "exact_match"}],
    "trainer": {"output_dir": "out"},
}
ALL_SWITCHES_ON = {  # every guard switch that is off by default turned on, so only the algorithm decides
    "gepo": {"enabled": True},
    "opefo": {"enabled": True},
    "quatro": {"enabled": True, "replay": {"enabled": True}},
    "grade": {"enabled": True, "kl_compensation": True},
}
BASELINES: dict[str, dict[str, Any]] = {  # a tree per algorithm in which every key the algorithm reads is read
    "grpo": {**COMMON, "algorithm": "grpo", "guards": ALL_SWITCHES_ON, "eval": {"every": 10}},
    "ppo": {**COMMON, "algorithm": "ppo", "guards": ALL_SWITCHES_ON, "eval": {"every": 10}},
    "sft": {**COMMON, "algorithm": "sft"},
    "reward": {
        "algorithm": "reward",
        "model": {"path": "some/model"},
        "data": {"path": "builtin:arithmetic_preferences", "eval_split": "eval"},
        "trainer": {"output_dir": "out"},
    },
}
CONTEXT: dict[str, dict[str, Any]] = {  # what else a key needs to be read at all (Read.only_if)
    "model.tiny": {"model.path": "builtin:tiny-llama"},
    "data.name": {"data.path": "org/dataset"},
    "data.eval_path": {"data.eval_split": None},
    "rewards[].retries": {"rewards.0.on_error": "retry"},
    "rewards[].backoff": {"rewards.0.on_error": "retry"},
    "rewards[].max_consecutive_errors": {"rewards.0.on_error": "skip"},
    **{  # the adaptive KL controller is off by default
        f"guards.quatro.kl.{key}": {"guards.quatro.kl.enabled": True}
        for key in ("target", "calibration_steps", "target_ratio", "update_every", "up", "down", "beta_range")
    },
    "guards.quatro.filters.zscore.max_abs_z": {"guards.quatro.filters.zscore.enabled": True},  # off by default
    "guards.opefo.error_feedback.weights": {"guards.opefo.error_feedback.enabled": True},  # off by default
}
RL_CONTEXT: dict[str, dict[str, Any]] = {  # the same, for keys whose context only GRPO and PPO accept (trainer keys)
    f"guards.gepo.mismatch.{key}": {"trainer.use_vllm": True} for key in ("ess_min", "max_consecutive_skips")
}
VALUES: dict[str, list[Any]] = {  # non-default values the generic candidates below cannot guess
    "callbacks": [["pkg.module:Callback"]],
    "trainer": [{"output_dir": "out", "seed": 7}],
    "rewards[].fn": ["numeric_match"],
    "preemption.signals": [["SIGUSR1"]],
    "guards.opefo.error_feedback.weights": [[0.5, 0.5]],
    "guards.grade.kl_compensation_range": [[0.6, 1.5]],
    "guards.quatro.kl.beta_range": [[0.5, 2.0], [0.25, 8.0]],
    "guards.quatro.gold.action": ["stop"],
    "guards.quatro.gold.mode": ["min"],
}


def leaves(cls: type, row: str = "", path: tuple = ()) -> typing.Iterator[tuple[str, tuple, Any, Any]]:
    """(row key, tree path, annotation, default) of every key below the dataclass ``cls``, recursively: sections,
    optional sections (``peft``) and lists of sections (``rewards``, entry 0)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{row}.{f.name}" if row else f.name
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
            yield from leaves(args[0], f"{key}[]", (*path, f.name, 0))
        elif dataclasses.is_dataclass(tp) or (len(args) == 1 and dataclasses.is_dataclass(args[0])):
            yield from leaves(tp if dataclasses.is_dataclass(tp) else args[0], key, (*path, f.name))
        else:
            default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            yield key, (*path, f.name), tp, default


def names(key: str) -> set[str]:
    """``key`` and the sections above it, as an error may name them (``rewards[].weight``: also ``rewards``)."""
    parts = key.split(".")
    out = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
    return out | {p.removesuffix("[]") for p in out}


def candidates(tp: Any, default: Any) -> list[Any]:
    """Values of annotation ``tp`` that differ from ``default``, most likely valid first."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [v for arm in typing.get_args(tp) if arm is not type(None) for v in candidates(arm, default)]
    if tp is bool:
        return [not default]
    if tp is int:
        return [1, 2, 7] if default in (None, dataclasses.MISSING) else [default + 1, default * 2, 1, 2]
    if tp is float:
        base = [] if not isinstance(default, (int, float)) else [default * 0.5, default * 1.5, default + 1.0]
        return [*base, 0.5, 0.25, 2.0]
    if tp is str:
        return ["observe", "micro_batch", "disk", "k3", "retry", "skip", "bfloat16", "exclude", "all", "x"]
    if typing.get_origin(tp) is list:
        return [["x"]]
    if tp is dict or typing.get_origin(tp) is dict or tp is Any:
        return [{"x": 1}]
    raise AssertionError(f"no candidate values for {tp}")


def with_value(tree: dict[str, Any], path: tuple, value: Any) -> dict[str, Any]:
    tree = copy.deepcopy(tree)
    node: Any = tree
    for part in path[:-1]:
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and len(node) > part else node
            continue
        nxt = node.get(part)
        if part == "rewards" and not nxt:
            nxt = node[part] = [{"fn": "exact_match"}]
        elif nxt is None:
            nxt = node[part] = {}
        node = nxt
    node[path[-1]] = value
    return tree


def outcome(tree: dict[str, Any], path: tuple, default: Any) -> tuple[str, str]:
    """("read", "") when the tree validates with the key set; ("ignored", message) when it is refused as ignored;
    ("invalid", message) for any other error."""
    try:
        cfg = RunConfig.from_tree(tree)
    except ConfigError as exc:
        return ("ignored" if "ignores it" in str(exc) else "invalid"), str(exc)
    node: Any = cfg
    for part in path:
        node = (
            node[part] if isinstance(part, int) else (node.get(part) if isinstance(node, dict) else getattr(node, part))
        )
    return ("read", "") if node != default else ("default", "")


def test_every_key_is_read_by_an_algorithm_or_refused_naming_key_algorithm_and_fix() -> None:
    """The table is complete (a key added without a row fails here) and the checker follows it: each key set to a
    non-default value is accepted where the algorithm reads it and refused, naming it, where it does not."""
    keys = list(leaves(RunConfig))
    assert len(keys) > 100  # the walk reaches into every section
    missing = [k for k, *_ in keys if lookup(k) is None]
    assert missing == [], f"keys without a row in steadyrl.config.ignored.READ_BY: {missing}"
    prefixes = {p for k, *_ in keys for p in names(k)}
    assert sorted(set(READ_BY) - prefixes) == []  # no row for a key that is gone
    wrong = []
    for alg in ALGORITHMS:
        for key, path, tp, default in keys:
            if key == "algorithm":
                assert READ_BY[key].by == ALGORITHMS
                continue
            base = BASELINES[alg]
            context = {**CONTEXT.get(key, {}), **(RL_CONTEXT.get(key, {}) if alg in ("grpo", "ppo") else {})}
            for dotted, value in context.items():
                base = with_value(base, tuple(int(p) if p.isdigit() else p for p in dotted.split(".")), value)
            results = [outcome(with_value(base, path, v), path, default) for v in VALUES.get(key, []) or
                       candidates(tp, default)]  # fmt: skip
            decided = [r for r in results if r[0] in ("read", "ignored")]
            if not decided:
                wrong.append(f"{alg} {key}: no valid non-default value among {results}; add one to VALUES")
                continue
            kind, message = decided[0]
            switched_off = key.endswith(".enabled") and default is True  # off is never an error, whatever runs
            expect = "read" if alg in lookup(key).by or switched_off else "ignored"
            if kind != expect:
                wrong.append(f"{alg} {key}: expected {expect}, got {kind} {message}")
            elif kind == "ignored":
                heads = {ln.split(" ", 1)[0].removesuffix(":").replace("[0]", "[]"): ln for ln in message.splitlines()}
                line = next((ln for head, ln in heads.items() if head in names(key)), "")
                if f"algorithm {alg} ignores it" not in line or "; " not in line:
                    wrong.append(f"{alg} {key}: the error does not name the key and a fix: {message}")
    assert wrong == [], "\n".join(wrong)


def test_validate_refuses_guards_and_periodic_eval_on_sft(capsys: pytest.CaptureFixture[str]) -> None:
    """The review's case: SFT ran with three guard/eval keys set and read none of them."""
    rc = main(["validate", str(REPO / "configs/tiny/sft.yaml"), "guards.gepo.enabled=true",
               "guards.opefo.enabled=true", "eval.every=10"])  # fmt: skip
    assert rc == 1
    guards = (
        "the guard layers act on GRPO and PPO steps; SFT runs TRL's SFTTrainer and the reward stage its RewardTrainer"
    )
    assert capsys.readouterr().err.splitlines() == [
        f"steadyrl: config error: guards.gepo.enabled (set in command line): algorithm sft ignores it: {guards}; "
        "remove it (its default: False)",
        f"guards.opefo.enabled (set in command line): algorithm sft ignores it: {guards}; remove it (its default: "
        "False)",
        "eval.every (set in command line): algorithm sft ignores it: SFT evaluates once, after training (TRL's "
        "SFTTrainer gets no periodic eval); remove it (its default: 0)",
    ]
    assert main(["validate", str(REPO / "configs/tiny/sft.yaml"), "guards.gepo.enabled=false"]) == 0  # the default


def _grpo(tmp_path: Path, overrides: list[str]) -> RunConfig:
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {path: some/model}\ndata: {path: builtin:arithmetic, eval_split: eval}\n"
        "rewards: [{fn: exact_match}]\ntrainer: {output_dir: out, bf16: false}\n"
    )
    return load_config(path, overrides)


def test_kwargs_of_a_reward_model_entry_are_refused(tmp_path: Path) -> None:
    rewards = "rewards=[{fn: exact_match}, {model: some/rm, kwargs: {normalize: false}}]"
    with pytest.raises(ConfigError) as info:
        _grpo(tmp_path, [rewards])
    assert str(info.value) == (
        "rewards[1].kwargs (set in command line): algorithm grpo ignores it on a reward `model` entry (TRL loads the "
        "model by path and calls it without arguments); remove kwargs, or score through a function that takes them, "
        "e.g. fn: steadyrl.trainers.reward_model:reward_model_score with kwargs: {path: <reward model folder>}"
    )
    cfg = _grpo(tmp_path, ["rewards=[{fn: exact_match}, {model: some/rm}]"])
    assert [r.model for r in cfg.rewards] == [None, "some/rm"]


def test_gepo_monitor_needs_gepo_on_unless_the_config_switches_gepo_off(tmp_path: Path) -> None:
    """GEPO off by default: the monitor's settings would never run. An explicit ``guards.gepo.enabled: false``
    keeps them for when GEPO is on (the ablation of one layer on a tuned config)."""
    with pytest.raises(ConfigError) as info:
        _grpo(tmp_path, ["guards.gepo.monitor.every=10"])
    assert str(info.value) == (
        "guards.gepo.monitor.every (set in command line): algorithm grpo ignores it while guards.gepo is off "
        "(guards.gepo.enabled is false by default and this config does not set it); set guards.gepo.enabled=true, "
        "or remove it (its default: 50)"
    )
    assert _grpo(tmp_path, ["guards.gepo.monitor.every=10", "guards.gepo.enabled=true"]).guards.gepo.monitor.every == 10
    parked = _grpo(tmp_path, ["guards.gepo.monitor.every=10", "guards.gepo.enabled=false"])
    assert (parked.guards.gepo.enabled, parked.guards.gepo.monitor.every) == (False, 10)


@pytest.mark.parametrize("key", ["on_start=true", "samples_to_log=5"])
def test_periodic_eval_options_need_eval_every(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        _grpo(tmp_path, [f"eval.{key}"])
    name, default = key.split("=")[0], {"on_start": False, "samples_to_log": 3}[key.split("=")[0]]
    assert str(info.value) == (
        f"eval.{name} (set in command line): algorithm grpo ignores it while eval.every is 0 (no periodic eval); "
        f"set eval.every > 0, or remove it (its default: {default})"
    )
    assert _grpo(tmp_path, [f"eval.{key}", "eval.every=5"]).eval.every == 5
    assert _grpo(tmp_path, [f"eval.{key}", "eval.enabled=false"]).eval.enabled is False  # switched off: kept


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.eval_split=null", "eval.every=5"], "eval.every (set in command line): algorithm grpo ignores it "
         "without eval data; set data.eval_split or data.eval_path, or remove it (its default: 0)"),
        (["data.path=train.jsonl"], "data.eval_split (set in {file}): algorithm grpo ignores it when data.path is a "
         "local file (read whole: the eval rows would be the training rows); put the eval rows in a file of their "
         "own and set data.eval_path"),
        (["rewards=[{fn: exact_match, retries: 5}]"], "rewards[0].retries (set in command line): algorithm grpo "
         "ignores it with on_error: raise (the first error stops the run); set on_error: retry or skip, or remove it "
         "(its default: 2)"),
        (["algorithm=ppo", "guards.gepo.advantage.clip_scale=2.0"], "guards.gepo.advantage.clip_scale (set in "
         "command line): algorithm ppo ignores it: PPO's advantages come from GAE (its tanh clip is ppo.soft_clip); "
         "the guard layers act on GRPO and PPO steps; SFT runs TRL's SFTTrainer and the reward stage its "
         "RewardTrainer; remove it (for PPO: ppo.soft_clip)"),
        (["ppo.soft_clip=3.0"], "ppo.soft_clip (set in command line): algorithm grpo ignores it: the ppo section "
         "configures algorithm: ppo (critic, GAE); remove it (its default: None)"),
        (["model.tiny={hidden_size: 32}"], "model.tiny (set in command line): algorithm grpo ignores it unless "
         "model.path is builtin:tiny-llama (the model it builds); set model.path=builtin:tiny-llama, or remove it (its "
         "default: {{}})"),
    ],
)  # fmt: skip
def test_keys_read_only_under_a_condition(tmp_path: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _grpo(tmp_path, overrides)
    assert str(info.value) == message.format(file=tmp_path / "run.yaml")


def test_the_reward_stage_refuses_what_it_never_reads(tmp_path: Path) -> None:
    reward = str(REPO / "configs/tiny/reward.yaml")
    assert load_config(reward, ["trainer.bf16=false"]).algorithm == "reward"
    with pytest.raises(ConfigError) as info:
        load_config(reward, ["peft.r=8", "preemption.exit_code=3", "rewards=[{fn: exact_match}]"])
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "rewards (set in command line): algorithm reward ignores it: the reward stage (steadyrl.trainers.reward_model) "
        "trains on preference pairs with TRL's RewardTrainer; it calls no reward; remove the rewards list"
    )
    assert "peft (set in command line): algorithm reward ignores it: the reward stage trains the full model; remove " \
        "the peft section" in lines  # fmt: skip
    assert lines[-1] == (
        "preemption.exit_code (set in command line): algorithm reward ignores it: the reward stage installs no "
        "signal handler; remove it (its default: 75)"
    )


def test_switching_a_part_off_is_accepted_whatever_runs_and_the_gold_watch_needs_eval_on(tmp_path: Path) -> None:
    # a base config shared with the reward stage switches preemption off: refused before, as if it were a setting
    reward = str(REPO / "configs/tiny/reward.yaml")
    assert load_config(reward, ["preemption.enabled=false"]).preemption.enabled is False
    # the gold watch reads the periodic eval: with eval off its settings would be silently ignored
    with pytest.raises(ConfigError) as info:
        _grpo(
            tmp_path,
            ["eval.every=5", "eval.enabled=false", "guards.quatro.enabled=true", "guards.quatro.gold.drop=0.1"],
        )
    assert str(info.value) == (
        "guards.quatro.gold.drop (set in command line): algorithm grpo ignores it while eval.enabled is false (the "
        "watch reads the periodic eval); set eval.enabled=true, or remove it (its default: 0.05)"
    )
