"""scripts/bench_real_model.py --merge: a second seed joins its cell, a rerun seed replaces its entry."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_real_model.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_real_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(variant, seeds, accuracy, steps, **extra):
    metrics = {"steps": steps, **extra}
    return {"scenario": "clean", "variant": variant, "seeds": seeds, "died": [a is None for a in accuracy],
            "accuracy": accuracy, "metrics": metrics}  # fmt: skip


def test_merge_adds_a_seed_replaces_a_rerun_and_keeps_lists_aligned() -> None:
    bench = _bench()
    old = {"command": "first", "cells": [_cell("plain", [0], [0.575], [70]), _cell("all", [0], [0.605], [70])],
           "samples": {"plain": ["a"]}}  # fmt: skip
    new = {"command": "second", "cells": [_cell("plain", [1], [0.56], [70], commit=["abc"]),
                                          _cell("all", [0], [0.675], [70], commit=["abc"]),
                                          _cell("all", [0], [None], [12], commit=["abc"]) | {"scenario": "inf"}],
           "samples": {"all": ["b"]}}  # fmt: skip
    merged = bench.merge_results(old, new)
    cells = {(c["scenario"], c["variant"]): c for c in merged["cells"]}
    plain = cells[("clean", "plain")]
    assert plain["seeds"] == [0, 1] and plain["accuracy"] == [0.575, 0.56] and plain["died"] == [False, False]
    assert plain["metrics"] == {"steps": [70, 70], "commit": [None, "abc"]}  # seed 0 had no commit recorded
    assert cells[("clean", "all")]["seeds"] == [0] and cells[("clean", "all")]["accuracy"] == [0.675]
    assert cells[("inf", "all")]["died"] == [True]
    assert merged["command"] == "first ; second" and merged["samples"] == {"plain": ["a"], "all": ["b"]}
