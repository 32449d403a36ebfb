"""scripts/bench_real_model.py --merge: a second seed joins its cell, a rerun seed replaces its entry."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_real_model.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_real_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(variant: str, seeds: list[int], accuracy: list[float | None], steps: list[int], **extra: Any) -> dict:
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


def test_merge_refuses_seeds_of_other_settings() -> None:
    bench = _bench()
    old = {"config": "configs/small/grpo-lora.yaml", "cells": [_cell("all", [0], [0.6], [70], overrides=[[]])]}
    longer = {"config": "configs/small/grpo-lora.yaml", "command": "x",
              "cells": [_cell("all", [1], [0.5], [12], overrides=[["trainer.max_steps=12"]])]}  # fmt: skip
    with pytest.raises(SystemExit, match=r"clean/all holds seeds run with overrides \[\], this run used"):
        bench.merge_results(old, longer)
    other = {"config": "configs/tiny/grpo.yaml", "command": "x", "cells": []}
    with pytest.raises(SystemExit, match=r"the results file is for configs/small/grpo-lora\.yaml"):
        bench.merge_results(old, other)
