"""Declared ranges of config fields, and the one checker that enforces them (imports nothing from steadyrl).

A field declares its range, ``window: int = bounded(5, ge=1)``, and its class subclasses ``Checked``, whose
``__post_init__`` raises one ``RangeError`` naming every field out of its range (``window must be >= 1, got 0``).
None passes where the annotation admits it; lists are checked item by item and by length; NaN fails every bound.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any

RANGE = "steadyrl.range"  # the field-metadata key that holds a field's Range


@dataclass(frozen=True)
class Range:
    """Bounds on a number (``finite`` also rejects +-inf) and/or the allowed values (``choices``; with numeric bounds
    as well, a value passes if either accepts it); for a list or tuple, on each item, ``min_len`` / ``max_len``."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False
    choices: tuple[Any, ...] = ()
    min_len: int | None = None
    max_len: int | None = None

    def accepts(self, value: Any) -> bool:
        if value in self.choices:
            return True
        if not self.finite and all(b is None for b in (self.ge, self.gt, self.le, self.lt)):
            return not self.choices  # no numeric bound: choices only (not one of them), or no item bound at all
        try:
            return (
                (self.ge is None or value >= self.ge)
                and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le)
                and (self.lt is None or value < self.lt)
                and (not self.finite or math.isfinite(value))
            )
        except TypeError:  # not a number
            return False

    def describe(self, none_ok: bool = False) -> str:
        """``> 0``, ``in (0, 1]``, ``finite and > 1``, ``one of ['a', 'b']``, with ``(or null)`` / ``(or 'auto')``."""
        low = f"[{self.ge}" if self.ge is not None else f"({self.gt}" if self.gt is not None else None
        high = f"{self.le}]" if self.le is not None else f"{self.lt})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        else:
            text = " ".join(
                f"{op} {b}"
                for op, b in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                if b is not None
            )
            text = ("finite and " + text if text else "finite") if self.finite else text
        alternatives = [repr(c) for c in self.choices] if text else []
        if not text:
            text = f"one of {list(self.choices)}"
        alternatives += ["null"] if none_ok else []
        return text + (f" (or {' or '.join(alternatives)})" if alternatives else "")

    def length_problem(self, value: Any) -> str | None:
        n, lo, hi = len(value), self.min_len, self.max_len
        if (lo is None or n >= lo) and (hi is None or n <= hi):
            return None
        if lo == hi:
            want = f"{lo}"
        elif lo is None or hi is None:
            want = f"at most {hi}" if lo is None else f"at least {lo}"
        else:
            want = f"{lo} to {hi}"
        return f"must have {want} item(s), got {value!r}"


def bounds(**range_: Any) -> dict[str, Range]:
    """Field metadata declaring a Range: ``field(default_factory=list, metadata=bounds(ge=0))``."""
    return {RANGE: Range(**range_)}


def bounded(default: Any, **range_: Any) -> Any:
    """A dataclass field with ``default`` and a declared Range."""
    return dataclasses.field(default=default, metadata=bounds(**range_))


class RangeError(ValueError):
    """Fields out of their declared ranges; ``problems`` holds (field, ``must be ..., got ...``) pairs."""

    def __init__(self, owner: str, problems: list[tuple[str, str]]) -> None:
        super().__init__(f"invalid {owner}: " + "; ".join(f"{key} {text}" for key, text in problems))
        self.problems = problems


@functools.cache
def _shapes(cls: type) -> dict[str, tuple[bool, bool]]:
    """field name -> (its annotation admits None, it is a list or tuple), for the fields of ``cls`` with a Range."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if RANGE in f.metadata:
            tp = hints[f.name]
            options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
            kinds = [t for t in options if t is not type(None)]
            out[f.name] = (len(kinds) < len(options), all(typing.get_origin(t) in (list, tuple) for t in kinds))
    return out


def check_ranges(obj: Any) -> None:
    """Raise RangeError naming every field of dataclass instance ``obj`` outside its declared Range."""
    problems = []
    for name, (none_ok, sequence) in _shapes(type(obj)).items():
        rng: Range = obj.__dataclass_fields__[name].metadata[RANGE]
        value = getattr(obj, name)
        if value is None and none_ok:
            continue
        if not sequence:
            if not rng.accepts(value):
                problems.append((name, f"must be {rng.describe(none_ok)}, got {value!r}"))
            continue
        if not isinstance(value, (list, tuple)):
            problems.append((name, f"must be a list{' (or null)' if none_ok else ''}, got {value!r}"))
            continue
        if (length := rng.length_problem(value)) is not None:
            problems.append((name, length))
        problems += [
            (f"{name}[{i}]", f"must be {rng.describe()}, got {v!r}") for i, v in enumerate(value) if not rng.accepts(v)
        ]
    if problems:
        raise RangeError(type(obj).__name__, problems)


class Checked:
    """Base of a config dataclass: ``__post_init__`` checks the declared ranges (a subclass's own checks call
    ``super().__post_init__()`` first)."""

    def __post_init__(self) -> None:
        check_ranges(self)
