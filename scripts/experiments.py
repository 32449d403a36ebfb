"""One experiment runner for the bench scripts: variants x scenarios x seeds -> ``steadyrl train`` runs -> cells.

A benchmark names its runs as ``Job``s (variant, scenario, seed, run folder, command line, extra environment);
``run_jobs`` (``steadyrl.experiments``, shared with ``steadyrl preflight``) starts each as its own process
(``OMP_NUM_THREADS=1``, ``PYTHONPATH`` = the repository, in a new process group that a timeout kills whole; one at a
time unless ``workers`` > 1), records its exit code and wall time in ``<run folder>/run.json`` and reads the folder
back (``metrics.jsonl`` through ``load_history``, ``eval_results.json``), so ``collect_only`` can rebuild every result
from the folders without training. The script turns each run into its own summary; ``cell``, ``results_doc`` and
``merge_results`` (here) write them in the shared RESULTS.md format (one cell per (scenario, variant), lists per
seed; ``--merge`` replaces only this invocation's cells, each keeping its own command and commit), and
``paired_difference`` compares two variants seed by seed.

Left out: retries, resuming a half-finished run (a rerun starts its folder afresh: metrics.jsonl appends), and any
scheduling beyond a thread pool of ``workers`` processes.

    python scripts/experiments.py configs/tiny/grpo.yaml --variant plain= --variant gepo=guards.gepo.enabled=true \\
        --seeds 3 --out runs/exp --results /tmp/exp.json -- model.path=runs/tiny-sft/final trainer.max_steps=20
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # steadyrl from this checkout

# the process part; the bench scripts call it from here (X.launch, X.Job, ...)
from steadyrl.experiments import RUN_RECORD, Job, Outcome, launch, run_env, run_jobs, train_command  # noqa: E402, F401


def commit() -> str:
    """``git rev-parse --short HEAD`` of the repository, with ``-dirty`` when ``git status`` lists any change."""
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    return sha.strip() + ("-dirty" if dirty.strip() else "")


# ------------------------------------------------------------------------------------------------ statistics


def finite(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def mean_std(values: Iterable[float | None], digits: int = 3) -> str:
    """``mean ± std`` (population std: the seeds are all there is) over the finite values; ``-`` when none."""
    vals = finite(values)
    if not vals:
        return "-"
    std = statistics.pstdev(vals) if len(vals) > 1 else 0.0
    return f"{statistics.fmean(vals):.{digits}f} ± {std:.{digits}f}"


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, float, int] | None:
    """Mean and standard error of a[seed] - b[seed] over the seeds both have (None with fewer than 2).

    Same seed, same checkpoint: two variants that leave most of a run alone share its seed-to-seed spread, so the
    paired difference is far tighter than the difference of two seed means (whose spread is several points)."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    diffs = [a[s] - b[s] for s in seeds]
    return statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs)


# ------------------------------------------------------------------------------------------------ results JSON


def cell(
    scenario: str,
    variant: str,
    seeds: Sequence[int],
    runs: Sequence[Mapping[str, Any]],
    metrics: Sequence[str] = (),
    *,
    died: Callable[[Mapping[str, Any]], bool] = lambda r: r.get("status") == "died",
    accuracy: str = "accuracy",
    note: str | None = None,
) -> dict[str, Any]:
    """One RESULTS.md cell: per-seed lists in the order of ``seeds`` (``runs`` are the seeds' summaries)."""
    out: dict[str, Any] = {"scenario": scenario, "variant": variant, "seeds": list(seeds)}
    if note:
        out["note"] = note
    out["died"] = [bool(died(r)) for r in runs]
    out["accuracy"] = [None if died(r) else r.get(accuracy) for r in runs]
    out["metrics"] = {key: [r.get(key) for r in runs] for key in metrics}
    return out


def results_doc(
    benchmark: str,
    cells: list[dict[str, Any]],
    *,
    command: str,
    sha: str,
    model: str,
    steps: int | str | None,
    packages: bool = True,
    **extra: Any,
) -> dict[str, Any]:
    """The whole file: benchmark, command, commit, date, machine, model, packages, steps, ``extra``, cells."""
    from steadyrl.environment import machine_line, package_versions

    doc: dict[str, Any] = {
        "benchmark": benchmark,
        "command": command,
        "commit": sha,
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(),
        "model": model,
    }
    if packages:
        doc["packages"] = package_versions()
    if steps is not None:
        doc["steps"] = steps
    doc.update(**extra, cells=cells)
    return doc


OWN_FIELDS = ("command", "commit", "date", "machine", "model", "packages", "steps")


def merge_results(
    old: dict[str, Any], new: dict[str, Any], same: Sequence[str] = ("steps",), add_seeds: bool = False
) -> dict[str, Any]:
    """``new``'s cells replace the same (scenario, variant) cells of ``old``, in place in its order (new ones at
    the end). Every cell carries the command, commit, date, machine, model, packages and steps of the run that made
    it (an old cell without them gets the old file's), as do the files' other top-level settings (e.g. a rule's
    ``gold_config``), and the file's own fields say "per cell" where they differ.
    ``same``: fields the two files must agree on (or the old one says "per cell"). ``add_seeds``: a new cell joins
    the old one seed by seed instead (``join_seeds``)."""
    old, new = copy.deepcopy(old), copy.deepcopy(new)  # the callers' documents stay as they were
    for key in same:
        if old.get(key) not in (new.get(key), "per cell"):
            raise SystemExit(f"--merge: the file's runs have {old.get(key)} {key}, this run {new.get(key)}")
    # the files' other settings (a rule's config, an eval interval) travel with their cells too
    extra = [k for k in dict.fromkeys([*old, *new]) if k not in ("benchmark", "cells", "table", *OWN_FIELDS)]
    for c in old["cells"]:
        for key in OWN_FIELDS:
            c.setdefault(key, old.get(key))
        c.update({key: old[key] for key in extra if key in old and key not in c})
    for c in new["cells"]:
        c.update({key: new.get(key) for key in OWN_FIELDS if key not in c})
        c.update({key: new[key] for key in extra if key in new and key not in c})
    replaced = {(c["scenario"], c["variant"]): c for c in new["cells"]}
    if add_seeds:
        before = {(c["scenario"], c["variant"]): c for c in old["cells"]}
        replaced = {key: join_seeds(before[key], c) if key in before else c for key, c in replaced.items()}
    cells = [replaced.pop((c["scenario"], c["variant"]), c) for c in old["cells"]] + list(replaced.values())
    merged = {**new, "cells": cells}
    for key in (*OWN_FIELDS, *extra):
        values = {json.dumps(c.get(key), sort_keys=True) for c in cells}
        merged[key] = cells[0].get(key) if len(values) == 1 else "per cell"
    return merged


def _runs(cell: dict[str, Any]) -> list[dict[str, Any]]:
    """The invocations behind a cell, each with its seeds and its own command, commit, date, machine, ..."""
    return cell.get("runs") or [{"seeds": list(cell["seeds"]), **{key: cell.get(key) for key in OWN_FIELDS}}]


def join_seeds(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """One cell of the seeds of both: ``new``'s seeds after ``old``'s, every per-seed list (``died``, ``accuracy``,
    each metric; ``None`` where one side did not record it) in the same order. ``runs`` lists each invocation with
    its seeds, command, commit, date, machine, packages and steps; the cell's own field is that value where every run
    agrees, else "per run". Refused: a seed in both, another model, or another value of any other field."""
    where = f"{old['scenario']}/{old['variant']}"
    if both := sorted(set(old["seeds"]) & set(new["seeds"])):
        raise SystemExit(f"--add-seeds: {where} already holds seed(s) {both}; without --add-seeds the cell is replaced")
    if old.get("model") != new.get("model"):
        raise SystemExit(f"--add-seeds: {where} holds runs of {old.get('model')!r}, this run is {new.get('model')!r}")
    per_seed = {"scenario", "variant", "seeds", "died", "accuracy", "metrics", "runs", *OWN_FIELDS}
    for key in sorted((set(old) | set(new)) - per_seed):
        if old.get(key) != new.get(key):
            raise SystemExit(f"--add-seeds: {where} has {key}={old.get(key)!r}, this run {new.get(key)!r}")
    mine, theirs = old.get("metrics", {}), new.get("metrics", {})
    metrics = {
        key: [*mine.get(key, [None] * len(old["seeds"])), *theirs.get(key, [None] * len(new["seeds"]))]
        for key in dict.fromkeys([*mine, *theirs])
    }
    joined = {**old, "seeds": [*old["seeds"], *new["seeds"]], "died": [*old["died"], *new["died"]]}
    joined.update(accuracy=[*old["accuracy"], *new["accuracy"]], metrics=metrics, runs=_runs(old) + _runs(new))
    for key in OWN_FIELDS:
        values = {json.dumps(run.get(key), sort_keys=True) for run in joined["runs"]}
        joined[key] = joined["runs"][0].get(key) if len(values) == 1 else "per run"
    return joined


def write_results(
    path: str | Path,
    doc: dict[str, Any],
    *,
    merge: bool = False,
    same: Sequence[str] = ("steps",),
    add_seeds: bool = False,
    indent: int = 1,
) -> dict[str, Any]:
    """Write ``doc`` to ``path`` (with ``merge``: merged into the file already there, ``merge_results``); returns
    what was written."""
    path = Path(path)
    if merge and path.is_file():
        doc = merge_results(json.loads(path.read_text()), doc, same, add_seeds)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent) + "\n")
    return doc


def script_command(script: str) -> str:
    """``python scripts/<script> ARGS...`` as this invocation was typed, after ``ATEN_CPU_CAPABILITY=...`` when it is
    set (it picks torch's CPU kernels: another host's results on this one)."""
    aten = os.environ.get("ATEN_CPU_CAPABILITY")
    return (f"ATEN_CPU_CAPABILITY={aten} " if aten else "") + f"python scripts/{script} " + shlex.join(sys.argv[1:])


# ------------------------------------------------------------------------------------------------ generic CLI


def summary(job: Job, outcome: Outcome) -> dict[str, Any]:
    """The generic per-run record: status, exit code, timeout, wall time, last step, held-out accuracy."""
    return {
        "status": outcome.status,
        "returncode": outcome.returncode,
        "timed_out": outcome.timed_out,
        "wall_s": outcome.wall_s,
        "last_step": outcome.last_step,
        "accuracy": (outcome.eval or {}).get("accuracy"),
    }


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="config files (each one a scenario), then -- and overrides for all")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDE[,OVERRIDE...]")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", default="runs/experiments")
    ap.add_argument("--results", default=None)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1: timings stay comparable)")
    ap.add_argument("--collect-only", action="store_true", help="train nothing: rebuild from the run folders")
    ap.add_argument("--merge", action="store_true", help="replace only this invocation's cells in --results")
    ap.add_argument("--baseline", default=None, help="variant the others are compared with, paired by seed")
    args, overrides = ap.parse_known_args(argv)
    overrides = [o for o in overrides if o != "--"]
    variants = dict(v.split("=", 1) for v in args.variant) or {"default": ""}
    variants = {name: [o for o in flags.split(",") if o] for name, flags in variants.items()}
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    sha = commit()
    jobs = []
    for config in args.configs:
        scenario = Path(config).stem
        for name, flags in variants.items():
            for seed in seeds:
                out = Path(args.out) / f"{name}-{scenario}-s{seed}"
                cmd = train_command(config, *overrides, *flags, f"trainer.output_dir={out}", f"trainer.seed={seed}")
                jobs.append(Job(name, scenario, seed, out, tuple(cmd)))
    results = run_jobs(jobs, summary, timeout=args.timeout, workers=args.jobs, collect_only=args.collect_only)
    print("| scenario | variant | ok | died (timeout) @ step | accuracy (mean ± seed std) |\n|---|---|---|---|---|")
    cells = []
    for config in args.configs:
        scenario = Path(config).stem
        for name in variants:
            present = [s for s in seeds if (name, scenario, s) in results]
            runs = [results[(name, scenario, s)] for s in present]
            if not runs:
                continue
            cells.append(cell(scenario, name, present, runs, ("last_step", "timed_out", "wall_s")))
            died = [r for r in runs if r["status"] == "died"]
            at = ",".join(str(r["last_step"]) for r in died)
            print(f"| {scenario} | {name} | {len(runs) - len(died)}/{len(runs)} | {len(died)} "
                  f"({sum(r['timed_out'] for r in died)}){f' @ {at}' if died else ''} | "
                  f"{mean_std(r['accuracy'] for r in runs)} |")  # fmt: skip
            if args.baseline and name != args.baseline:
                acc = {s: r["accuracy"] for s, r in zip(present, runs, strict=True) if r["accuracy"] is not None}
                ref = {s: results[(args.baseline, scenario, s)]["accuracy"] for s in seeds
                       if results.get((args.baseline, scenario, s), {}).get("accuracy") is not None}  # fmt: skip
                diff = paired_difference(acc, ref)
                if diff is not None:
                    print(f"|  | {name} − {args.baseline} (paired) | | | {diff[0]:+.3f} ± {diff[1]:.3f} ({diff[2]}) |")
    if args.results:
        doc = results_doc("experiments", cells, command=script_command("experiments.py"), sha=sha,
                          model=", ".join(args.configs), steps=None)  # fmt: skip
        write_results(args.results, doc, merge=args.merge)


if __name__ == "__main__":
    main()
