"""steadyrl.ranges: each bound kind, None, lists, NaN and inf; the loader's message; and that every numeric config key
declares a range or is listed, with its reason, as unbounded."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from steadyrl.config import ConfigError, RunConfig, load_config
from steadyrl.guards.error_feedback import ErrorFeedbackConfig
from steadyrl.ranges import RANGE, Checked, Range, RangeError, bounded, bounds, check_ranges

TINY = Path(__file__).parents[2] / "configs" / "tiny" / "grpo.yaml"


@dataclass
class Sample(Checked):
    count: int = bounded(1, ge=1)
    rate: float = bounded(0.5, gt=0, le=1)
    share: float = bounded(0.0, ge=0, lt=1)
    gain: float = bounded(1.0, gt=0, finite=True)
    scale: float = bounded(2.0, finite=True)
    cap: float | None = bounded(None, lt=10)
    policy: str = bounded("a", choices=("a", "b"))
    target: float | str = bounded("auto", gt=0, finite=True, choices=("auto",))
    pair: list[float] = field(default_factory=lambda: [1.0, 2.0], metadata=bounds(gt=0, min_len=2, max_len=2))
    names: list[str] | None = field(default=None, metadata=bounds(choices=("x", "y"), min_len=1))
    free: float = 7.0  # no range


def _problems(**values: object) -> dict[str, str]:
    with pytest.raises(RangeError) as info:
        Sample(**values)
    return dict(info.value.problems)


def test_defaults_and_edges_pass() -> None:
    Sample()
    Sample(count=10**9, rate=1, share=0.999, gain=1e-300, scale=-5.0, cap=9.99, policy="b", target=0.1)
    Sample(pair=(0.1, 1e300), names=["y", "x"], free=math.nan)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("count", 0, "must be >= 1, got 0"),
        ("rate", 0.0, "must be in (0, 1], got 0.0"),
        ("rate", 1.5, "must be in (0, 1], got 1.5"),
        ("share", 1.0, "must be in [0, 1), got 1.0"),
        ("gain", 0.0, "must be finite and > 0, got 0.0"),
        ("gain", math.inf, "must be finite and > 0, got inf"),
        ("scale", -math.inf, "must be finite, got -inf"),
        ("cap", 10.0, "must be < 10 (or null), got 10.0"),
        ("policy", "c", "must be one of ['a', 'b'], got 'c'"),
        ("target", "aut", "must be finite and > 0 (or 'auto'), got 'aut'"),
        ("target", -1.0, "must be finite and > 0 (or 'auto'), got -1.0"),
        ("count", "3", "must be >= 1, got '3'"),  # not a number: the same message, no TypeError
        ("count", None, "must be >= 1, got None"),  # None only where the annotation admits it
    ],
)
def test_each_bound_kind(key: str, value: object, message: str) -> None:
    assert _problems(**{key: value}) == {key: message}


@pytest.mark.parametrize("key", ["rate", "share", "gain", "scale", "cap", "target"])
def test_nan_fails_every_numeric_bound(key: str) -> None:
    assert list(_problems(**{key: math.nan})) == [key]


def test_lists_check_each_item_and_the_length() -> None:
    assert _problems(pair=[1.0, -1.0]) == {"pair[1]": "must be > 0, got -1.0"}
    assert _problems(pair=[1.0]) == {"pair": "must have 2 item(s), got [1.0]"}
    assert _problems(pair=[0.0, 1.0, 2.0]) == {
        "pair": "must have 2 item(s), got [0.0, 1.0, 2.0]",
        "pair[0]": "must be > 0, got 0.0",
    }
    assert _problems(pair=3.0) == {"pair": "must be a list, got 3.0"}
    assert _problems(names=[]) == {"names": "must have at least 1 item(s), got []"}
    assert _problems(names=["x", "z"]) == {"names[1]": "must be one of ['x', 'y'], got 'z'"}


def test_every_problem_at_once_in_field_order() -> None:
    with pytest.raises(RangeError) as info:
        Sample(count=0, policy="c", gain=-1)
    assert str(info.value) == (
        "invalid Sample: count must be >= 1, got 0; gain must be finite and > 0, got -1; "
        "policy must be one of ['a', 'b'], got 'c'"
    )
    assert isinstance(info.value, ValueError)


def test_replace_checks_again_and_check_ranges_works_on_any_dataclass() -> None:
    with pytest.raises(RangeError, match="count must be >= 1"):
        dataclasses.replace(Sample(), count=0)

    @dataclass
    class Plain:  # no Checked base: check_ranges called by hand
        n: int = bounded(0, ge=0)

    check_ranges(Plain())
    with pytest.raises(RangeError, match=r"^invalid Plain: n must be >= 0, got -1$"):
        check_ranges(Plain(n=-1))


def test_a_yaml_value_out_of_range_names_the_dotted_key_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(f"extends: {TINY}\nguards:\n  quatro:\n    kl:\n      up: 0.5\n      beta_range: [0.5, .inf]\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, ["guards.opefo.floor.percentile=100"])
    assert str(info.value) == (  # the first section built with a problem: guards.opefo, before guards.quatro
        "guards.opefo.floor.percentile (set in command line): must be in (0, 100), got 100"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"guards.quatro.kl.up (set in {path}): must be finite and > 1, got 0.5; "
        f"guards.quatro.kl.beta_range[1] (set in {path}): must be finite and > 0, got inf"
    )


def test_nan_from_yaml_is_refused_where_a_bare_comparison_let_it_through(tmp_path: Path) -> None:
    """``if x < 0: fail`` let NaN through (backoff, relay_window_s, vf_coef, ...); a declared range fails NaN."""
    with pytest.raises(ConfigError, match=r"^preemption\.relay_window_s \(set in command line\): .*, got nan$"):
        load_config(TINY, ["preemption.relay_window_s=.nan"])
    path = tmp_path / "run.yaml"
    path.write_text(f"extends: {TINY}\nrewards:\n  - {{fn: exact_match, backoff: .nan}}\n")
    with pytest.raises(ConfigError, match=r"^rewards\[0\]\.backoff \(set in .*\): must be >= 0, got nan$"):
        load_config(path)


# Numeric config keys without a declared range, each with the reason. A new numeric key must declare a range
# (steadyrl.ranges.bounded) or be added here with its reason.
UNBOUNDED = {
    "rewards[].weight": "any real: a negative weight is a penalty, 0 a reward that is only logged",
    "data.max_samples": "null = all; not checked (0 or less gives an empty dataset, which fails at load)",
    "peft.r": "peft's LoraConfig checks it",
    "peft.lora_alpha": "peft's LoraConfig checks it",
    "peft.lora_dropout": "peft's LoraConfig checks it",
    "eval.max_new_tokens": "not checked (generate refuses a bad value)",
    "eval.batch_size": "not checked",
    "eval.max_samples": "null = the whole eval split; not checked",
    "eval.samples_to_log": "not checked (0 or less logs none)",
    "guards.gepo.logprob_min": "any floor (null = off)",
    # checked only when the part is used, so a disabled section may hold any value (checks.py, SpikeGuard)
    "guards.gepo.advantage.clip_scale": "checked with guards.gepo.advantage.enabled (checks.py: GEPOAdvantage)",
    "guards.gepo.advantage.outlier_z": "checked with guards.gepo.advantage.enabled (checks.py: GEPOAdvantage)",
    "guards.gepo.spike.rebase_after": "0 or >= 2, checked in SpikeConfig.__post_init__",
    "guards.gepo.monitor.adv_std_rise_ratio": "a ratio the doctor compares with; not checked",
    "guards.gepo.monitor.entropy_drop_ratio": "a ratio the doctor compares with; not checked",
    "guards.gepo.monitor.logp_gap_max": "not checked",
    "guards.grade.clip_start": "with clip: in [0, window_size], a check across fields (GradeConfig.__post_init__)",
    "guards.grade.kl_compensation_range": "checked with kl_compensation on (checks.py)",
}


def _numeric(tp: object) -> bool:
    for t in typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,):
        if typing.get_origin(t) in (list, tuple):
            t = typing.get_args(t)[0]
        if t in (int, float):
            return True
    return False


def _numeric_keys(cls: type, prefix: str = "") -> dict[str, tuple[type, dataclasses.Field]]:
    """Dotted config key -> (its section class, its field), for every numeric key under ``cls``."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        inner = [t for t in (*typing.get_args(tp), tp) if dataclasses.is_dataclass(t)]
        if inner:
            out |= _numeric_keys(inner[0], f"{key}[]." if typing.get_origin(tp) is list else f"{key}.")
        elif _numeric(tp):
            out[key] = (cls, f)
    return out


def test_every_numeric_config_key_declares_a_range_or_is_listed_unbounded() -> None:
    keys = _numeric_keys(RunConfig)
    assert len(keys) > 60  # the walk reached the guards' sections
    undeclared = sorted(k for k, (_, f) in keys.items() if RANGE not in f.metadata and k not in UNBOUNDED)
    assert undeclared == [], f"numeric config keys without a declared range: {undeclared}"
    stale = sorted(k for k in UNBOUNDED if k not in keys or RANGE in keys[k][1].metadata)
    assert stale == [], f"UNBOUNDED lists keys that are gone or declare a range now: {stale}"


def _outside(rng: Range) -> object:
    """A value just outside ``rng``."""
    for bound, step in (("ge", -1), ("gt", 0), ("le", 1), ("lt", 0)):
        if getattr(rng, bound) is not None:
            return getattr(rng, bound) + step
    return math.inf if rng.finite else "not-a-choice"


def _classes(cls: type) -> set[type]:
    """``cls`` and every dataclass reachable through its fields' annotations."""
    out = {cls}
    for tp in typing.get_type_hints(cls).values():
        for t in (tp, *typing.get_args(tp)):
            if dataclasses.is_dataclass(t) and t not in out:
                out |= _classes(t)
    return out


def test_every_declared_range_is_enforced_by_its_class() -> None:
    """Each config class checks every range it declares (a subclass that skips super().__post_init__() fails)."""
    checked = []
    for cls in _classes(RunConfig) | {ErrorFeedbackConfig}:
        hints = typing.get_type_hints(cls)
        required = {f.name: "x" for f in dataclasses.fields(cls) if f.name == "path"}  # model.path, data.path
        for f in dataclasses.fields(cls):
            if RANGE not in f.metadata:
                continue
            bad = _outside(f.metadata[RANGE])
            sequence = any(
                typing.get_origin(t) in (list, tuple) for t in (hints[f.name], *typing.get_args(hints[f.name]))
            )
            with pytest.raises(RangeError, match=rf"\b{f.name}(\[0\])? must be "):
                cls(**required, **{f.name: [bad] if sequence else bad})
            checked.append(f"{cls.__name__}.{f.name}")
    assert len(checked) > 50 and "GepoSection.mode" in checked and "PreemptionSection.signals" in checked
