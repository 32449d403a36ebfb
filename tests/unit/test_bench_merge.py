"""scripts/bench_real_model.py --merge: a second seed joins its cell, a rerun seed replaces its entry."""

from __future__ import annotations

import importlib.util
import sys
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


def _stability() -> Any:
    path = SCRIPT.with_name("bench_stability.py")
    spec = importlib.util.spec_from_file_location("bench_stability", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_stability"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_stability_merge_replaces_only_the_rerun_cells_and_marks_each_cells_run() -> None:
    """scripts/bench_stability.py --merge: a rerun of (inf, all) replaces that cell in its place, a new cell joins
    at the end, the untouched cell keeps the old run's command and commit, and the file says "per cell"."""

    def cell(scenario: str, variant: str, accuracy: float) -> dict:
        return {"scenario": scenario, "variant": variant, "seeds": [0], "accuracy": [accuracy], "metrics": {}}

    base = {"command": "old", "date": "d0", "packages": {"torch": "1"}, "steps": 200, "machine": "xeon"}
    old = {**base, "commit": "aaa", "cells": [cell("clean", "all", 0.9), cell("inf", "all", 0.8)]}
    new = {**base, "command": "new", "commit": "bbb", "machine": "epyc",
           "cells": [cell("inf", "all", 0.92), cell("inf", "opefo", 0.9)]}  # fmt: skip
    merged = _stability().merge_results(old, new)
    assert [(c["scenario"], c["variant"], c["accuracy"], c["commit"]) for c in merged["cells"]] == [
        ("clean", "all", [0.9], "aaa"), ("inf", "all", [0.92], "bbb"), ("inf", "opefo", [0.9], "bbb"),
    ]  # fmt: skip
    assert merged["cells"][0]["command"] == "old" and merged["cells"][1]["command"] == "new"
    assert merged["commit"] == "per cell" and merged["command"] == "per cell" and merged["steps"] == 200
    # the machine is a cell's own too: the same command gave other numbers on another CPU
    assert [c["machine"] for c in merged["cells"]] == ["xeon", "epyc", "epyc"] and merged["machine"] == "per cell"
    with pytest.raises(SystemExit, match="the file's runs have 200 steps, this run 6"):
        _stability().merge_results(old, {**new, "steps": 6})


def test_stability_chart_records_from_cells_name_each_variant_and_mark_failed_runs() -> None:
    """--plot-results: a merged file's cells become ``plot``'s per-run records under the display names."""
    doc = {"cells": [
        {"scenario": "nan_loss", "variant": "plain", "seeds": [0, 1], "died": [True, False], "accuracy": [None, 0.5],
         "metrics": {"nonfinite_weights": [False, True]}},
        {"scenario": "clean", "variant": "all-minus-quatro-kl", "seeds": [2], "died": [False], "accuracy": [0.9]},
    ]}  # fmt: skip
    records = _stability().results_from_cells(doc)
    assert records == {
        ("plain TRL", "nan_loss", 0): {"status": "died", "accuracy": None},
        ("plain TRL", "nan_loss", 1): {"status": "nonfinite_weights", "accuracy": 0.5},
        ("all - QUATRO kl", "clean", 2): {"status": "ok", "accuracy": 0.9},
    }


def test_stability_cells_named_by_step_keep_runs_at_two_fault_steps_apart() -> None:
    """--name-by-step: a step fault's cell is <fault>-<k>; the clean run and the ablation's name are unchanged."""
    bench = _stability()
    run = {"status": "ok", "accuracy": 0.6}
    results = {("all - OPEFO feedback", "grad_spike", 0): run, ("plain TRL", "clean", 0): run}
    names, scenarios = ["plain TRL", "all - OPEFO feedback"], ["clean", "grad_spike"]
    for step, expected in ((100, "grad_spike-100"), (None, "grad_spike")):
        doc = bench.results_json(results, names, scenarios, [0], "cmd", 200, "abc", step)
        named = [(c["scenario"], c["variant"]) for c in doc["cells"]]
        assert named == [("clean", "plain"), (expected, "all-minus-opefo-feedback")]


def test_real_model_cell_keeps_each_seeds_machine() -> None:
    """A run's environment.json machine goes into its cell per seed, and survives a merge with an older seed."""
    bench = _bench()
    epyc = {"cpu": "AMD EPYC", "torch_cpu_kernels": "AVX512"}
    new = bench.cell("all", 1, {"accuracy": 0.4, "died": False, "machine": epyc, "commit": "abc"})
    assert new["metrics"]["machine"] == [epyc] and "commit" not in new["metrics"]  # commit is set per seed later
    merged = bench.merge_cell(_cell("all", [0], [0.6], [70]), new)
    assert merged["seeds"] == [0, 1] and merged["metrics"]["machine"] == [None, epyc]


def test_collect_only_keeps_the_wall_time_and_exit_code_the_run_recorded(tmp_path: Path) -> None:
    """--collect-only rebuilds a row from the run's folder: wall time and exit code come from the record the script
    wrote when it ran the run (they were None and "has a final/ folder" before); an older folder has no wall time."""
    bench = _bench()
    run = tmp_path / "all-seed1"
    run.mkdir()
    (run / bench.RUN_RECORD).write_text('{"returncode": 0, "wall_s": 1365.8}\n')
    row = bench.train("configs/small/grpo-lora.yaml", run, (), [], 1, collect_only=True)
    assert (row["wall_s"], row["returncode"], row["died"]) == (1365.8, 0, False)
    (run / bench.RUN_RECORD).write_text('{"returncode": 1, "wall_s": 12.5}\n')
    (run / "final").mkdir()  # a final save does not hide the recorded failure
    assert bench.train("c.yaml", run, (), [], 1, collect_only=True)["died"] is True
    (run / bench.RUN_RECORD).unlink()
    assert bench.collected_run(run) == (0, None)


def test_stability_bars_are_paired_by_seed_against_the_right_reference() -> None:
    """Issue 13's bars: clean against plain TRL (-1 point), a fault against the single layer with the best mean
    (-2 points, no death); the difference is paired by seed, with its standard error (hand-computed)."""
    bench = _stability()

    def runs(name: str, scenario: str, accs: list[float | None]) -> dict:
        return {(name, scenario, seed): {"status": "ok" if a is not None else "died", "accuracy": a}
                for seed, a in enumerate(accs)}  # fmt: skip

    results = {
        **runs("plain TRL", "clean", [0.91, 0.90, 0.85]),
        **runs("all on", "clean", [0.90, 0.88, 0.86]),
        **runs("GEPO", "grad_spike", [0.90, 0.92, 0.91]),
        **runs("OPEFO", "grad_spike", [0.60, 0.62, 0.61]),
        **runs("all on", "grad_spike", [0.80, None, 0.95]),
        **runs("QUATRO", "repetition_reward", [0.50, 0.40, 0.45]),
        **runs("all on", "repetition_reward", [0.40, 0.30, 0.36]),
    }
    rows = bench.bars_table(results, ["clean", "grad_spike", "repetition_reward"]).splitlines()[2:]
    # clean: diffs -0.01, -0.02, +0.01 -> mean -0.0067, stdev 0.01528, s.e. 0.00882; the bar -0.01 is 0.4 s.e. away
    assert rows[0] == "| clean | plain TRL | -0.7 ± 0.9 points (3) | -1 | met, within noise |"
    # grad_spike: GEPO is the best single layer; seed 1 of every layer on died: paired over seeds 0 and 2
    assert rows[1] == "| grad_spike | GEPO | -3.0 ± 7.0 points (2) | -2 | missed (1 run(s) of every layer on died) |"
    # repetition: diffs -0.10, -0.10, -0.09 -> mean -0.0967, s.e. 0.0033: a resolved miss
    assert rows[2] == "| repetition_reward | QUATRO | -9.7 ± 0.3 points (3) | -2 | missed |"
    assert bench.paired_difference({0: 0.5}, {0: 0.4}) is None  # one shared seed: no standard error
