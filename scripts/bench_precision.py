"""Precision and recall of the guard layers at their shipped defaults: how much every layer on changes healthy runs,
and whether it catches every injected fault (issue 39).

Healthy scenarios (``healthy-<setting>``): 200-step GRPO runs from one SFT checkpoint with ``plain`` (every layer
off, = ``trl.GRPOTrainer``) and ``all`` (every layer on at its defaults, ``configs/tiny/grpo-guarded.yaml``), at the
demo's settings and at a lower and a higher learning rate; ``--model small`` runs SmolLM2-135M + LoRA
(``configs/small/grpo-lora.yaml``) instead. Per seed: the interventions ledger (``OUTPUT_DIR/interventions.json``:
steps per kind, the largest per-kind share of steps), skips / rollbacks / repairs, rows filtered outside
zero-variance groups, the doctor's warnings about steadyrl's own controllers, and every eval metric.

Fault scenarios (``fault-<fault>-<step>``): one fault at an early step (inside the warm-ups), a middle and a late
one; each run stops ``AFTER`` steps past it. ``caught``: a ledger action of the kinds in ``ACTIONS`` within
``WINDOW`` steps from the fault, the run finished with finite weights and no non-finite optimizer state left;
``steps_to_action``: the steps from the fault to the first such action (0: the step itself). ``--resume-lead L``
trains the steps before a late fault once: one healthy run per (variant, seed) saves a checkpoint L steps before
each fault step past L, and those fault runs resume from it (the fault's own overrides apply from the resume on;
meant for a constant learning rate, as SmolLM2's config has: a decaying schedule would follow the base run's length).

    python scripts/bench_precision.py --sft runs/tiny-sft/final --seeds 8 --results docs/results/precision_recall.json
    python scripts/bench_precision.py --sft runs/tiny-sft/final --only healthy --seeds 2 --steps 20   # a smoke
    python scripts/bench_precision.py --settings smollm2 --only faults --seeds 2 --variants all --resume-lead 5
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402
from bench_stability import weights_finite  # noqa: E402

from steadyrl import metrics as M  # noqa: E402
from steadyrl.evidence.doctor import diagnose  # noqa: E402
from steadyrl.evidence.history import to_float  # noqa: E402
from steadyrl.evidence.interventions import KINDS, load_summary  # noqa: E402
from steadyrl.faults import FAULT_SCALE_ENV, FAULT_STEP_ENV, FAULT_VALUE_ENV, read_fault_log  # noqa: E402
from steadyrl.guards.spike import ZERO_NORM, SpikeConfig  # noqa: E402
from steadyrl.preflight import calm_spike_margin  # noqa: E402

OFF = tuple(f"guards.{layer}.enabled=false" for layer in ("gepo", "opefo", "quatro", "grade"))
VARIANTS = {"plain": OFF, "all": ()}
CONFIGS = {"tiny": "configs/tiny/grpo-guarded.yaml", "small": "configs/small/grpo-lora.yaml"}
SETTINGS = {  # healthy settings: (model, overrides)
    "demo": ("tiny", ()),
    "lr3e-5": ("tiny", ("trainer.learning_rate=3.0e-5",)),
    "lr3e-4": ("tiny", ("trainer.learning_rate=3.0e-4",)),
    "smollm2": ("small", ()),
    # long runs well past convergence (run with --steps 1000), the gold watch reading an eval every 20 steps: the same
    # 200 problems greedy, or sampled at the training temperature (a fresh draw each eval, seeded by the step)
    "long-greedy": ("tiny", ("eval.every=20", "eval.on_start=true")),
    "long-sampled": ("tiny", ("eval.every=20", "eval.on_start=true", "eval.do_sample=true")),
    "smollm2-eval": ("small", ("eval.every=10", "eval.on_start=true")),
}
BURST_STEPS = 5  # the reward burst makes a quarter of the rewards non-finite on this many steps from the fault on
BURST = "{{name: bursty, fn: 'steadyrl.faults:exact_match_nonfinite_burst', kwargs: {{fraction: 0.25, start: {step}, "
BURST += f"steps: {BURST_STEPS}, " + "seed: {seed}}}}}"
# SmolLM2: the burst on its verifier, under the verifier's name (the entropy gate reads it), its format reward kept
SMALL_BURST = "{{name: math_answer, fn: 'steadyrl.faults:math_answer_nonfinite_burst', kwargs: {{fraction: 0.25, "
SMALL_BURST += f"start: {{step}}, steps: {BURST_STEPS}, " + "seed: {seed}}}}}, "
SMALL_BURST += "{{fn: concise_answer, weight: 0.25, kwargs: {{max_words: 12}}}}"
FAULTS: dict[str, tuple[str | None, tuple[str, ...], dict[str, str]]] = {  # callback, overrides, environment
    "nan_loss": ("NanLossAtStep", (), {}),  # one micro-batch per step: the step's loss
    "nan_micro_batch": (
        "NanLossAtStep",
        ("trainer.per_device_train_batch_size=16", "trainer.gradient_accumulation_steps=4"),
        {},
    ),
    "inf_adam": ("InfExpAvgSqAtStep", (), {FAULT_VALUE_ENV: "inf"}),
    "grad_spike": ("GradSpikeAtStep", ("trainer.max_grad_norm=1e9",), {FAULT_SCALE_ENV: "1e4"}),  # clipping off
    "nonfinite_rewards": (None, (), {}),
}
# SmolLM2's config makes 16 completions a step in one micro-batch: the micro-batch NaN splits those same 16 in 4
SMALL_OVERRIDES = {
    "nan_micro_batch": ("trainer.per_device_train_batch_size=4", "trainer.gradient_accumulation_steps=4"),
}
FAULT_STEPS = {"tiny": (5, 100, 180), "small": (3, 35, 65)}
BASE = "base"  # --resume-lead: the healthy run per (variant, seed) whose checkpoints the later fault runs resume from
AFTER, WINDOW = 15, 12  # fault runs stop AFTER steps past the fault; an action counts within WINDOW steps
ACTIONS = ("skipped_step", "nonfinite_masked", "dropped_micro_batch", "rollback", "state_repair")
OWN_CONTROLLERS = "saturated_controller"  # the doctor's mode for steadyrl's own settings that do not fit a run


def command(model: str, sft: str | None, out: Path, seed: int, steps: int | None, extra: tuple[str, ...]) -> list[str]:
    args = [
        f"trainer.output_dir={out}",
        f"trainer.seed={seed}",
        "trainer.logging_steps=1",
        'trainer.save_strategy="no"',
        "trainer.resume_from_checkpoint=null",
        "trainer.report_to=[]",
    ]
    if sft is not None and model == "tiny":
        args.append(f"model.path={sft}")
    if steps is not None:
        args.append(f"trainer.max_steps={steps}")
    return X.train_command(REPO / CONFIGS[model], *args, *extra)


def calm_statistics(history: Any) -> dict[str, float | None]:
    """How close a run came to each guard's test, whatever the variant (the defaults' margins, docs/DESIGN.md):
    the largest grad norm / the spike guard's baseline and the largest robust z (``preflight.calm_spike_margin``), the
    KL of the last 10 steps over that of steps 11-20 (the auto KL target's window), and the lowest 10-step mean
    entropy over the first 10 steps' (the entropy floor's baseline)."""
    out: dict[str, float | None] = {}
    norms = [v for v in history.finite(M.GRAD_NORM)[1].tolist() if v > ZERO_NORM]
    ratio, z = calm_spike_margin(norms, SpikeConfig()) if len(norms) >= 3 else (None, None)
    out["norm_over_baseline_max"], out["spike_z_max"] = ratio, z if z is None or math.isfinite(z) else None
    kl = history.finite(M.KL)[1].tolist()
    early = statistics.fmean(kl[10:20]) if len(kl) >= 30 else 0.0
    out["kl_last_over_early"] = statistics.fmean(kl[-10:]) / early if early > 0 else None
    entropy = history.finite(M.ENTROPY)[1].tolist()
    if len(entropy) >= 20 and statistics.fmean(entropy[:10]) > 0:
        means = [statistics.fmean(entropy[i - 10 : i]) for i in range(20, len(entropy) + 1)]
        out["entropy_min_over_start"] = min(means) / statistics.fmean(entropy[:10])
    return out


def healthy_summary(job: X.Job, run: X.Outcome) -> dict[str, Any]:
    status = run.status
    final = job.out / "final" / "model.safetensors"
    if status == "ok" and final.is_file() and not weights_finite(final):
        status = "nonfinite_weights"  # exited 0, but the weights it saved are not finite: counted as died
    out: dict[str, Any] = {"status": status, "last_step": run.last_step, "wall_s": run.wall_s}
    out["accuracy"] = (run.eval or {}).get("accuracy")
    out["eval"] = {f"eval/{k}": v for k, v in ((run.eval or {}).get("rewards") or {}).items()}
    history = run.history
    ledger = load_summary(job.out, history) if history is not None else None
    kinds = (ledger or {}).get("kinds", {})
    out["interventions"] = {k: row["steps"] for k, row in kinds.items() if row["steps"]}
    out["intervention_share_max"] = (ledger or {}).get("intervention_share_max")
    out["skipped_steps"] = kinds.get("skipped_step", {}).get("steps", 0)
    out["rollbacks"] = kinds.get("rollback", {}).get("steps", 0)
    out["repairs"] = kinds.get("state_repair", {}).get("steps", 0)
    out["gold_rollbacks"] = kinds.get("gold_rollback", {}).get("steps", 0)
    out["evals"] = len(history.finite(M.EVAL_ACCURACY)[1]) if history is not None else 0
    out["filtered_row_share"] = (ledger or {}).get("filtered_rows", {}).get("share")
    out["steps"] = (ledger or {}).get("steps")
    out.update(calm_statistics(history) if history is not None else {})
    findings = diagnose(history) if history is not None else []
    out["doctor"] = [f"{f.severity}:{f.mode}" for f in findings]
    out["own_controller_warning"] = any(f.mode == OWN_CONTROLLERS for f in findings)
    return out


def burst_fired(history: Any, fault_step: int) -> bool:
    """The reward burst writes no faults.jsonl: it fired where a step of its window logged a non-finite training
    reward (plain TRL's ``reward``, NaN: null in metrics.jsonl) or steadyrl counted non-finite rewards."""
    for row in history.rows:
        if fault_step <= row["step"] < fault_step + BURST_STEPS:
            reward = to_float(row["reward"]) if "reward" in row else 0.0
            if reward is None or not math.isfinite(reward) or (to_float(row.get(M.GEPO_NONFINITE_REWARDS)) or 0) > 0:
                return True
    return False


def fault_summary(job: X.Job, run: X.Outcome, fault_step: int, burst: bool = False) -> dict[str, Any]:
    out = healthy_summary(job, run)
    faults = read_fault_log(job.out)
    out["fired"] = any(row["fault"] not in ("train_end",) for row in faults)
    out["fired"] |= burst and run.history is not None and burst_fired(run.history, fault_step)
    end = [row for row in faults if row["fault"] == "train_end"]
    out["inf_left_in_adam"] = bool(end and end[-1].get("nonfinite_state_entries"))
    first = None
    if run.history is not None:
        for kind in ACTIONS:
            name = M.ledger(kind)
            if not run.history.has(name):
                continue
            steps, values = run.history.series(name)
            hit = [
                int(s)
                for s, v in zip(steps.tolist(), values.tolist(), strict=True)
                if v > 0 and fault_step <= s <= fault_step + WINDOW
            ]
            if hit and (first is None or hit[0] < first):
                first = hit[0]
    out["steps_to_action"] = None if first is None else first - fault_step
    out["caught"] = bool(run.status == "ok" and first is not None and not out["inf_left_in_adam"])
    return out


def seed_list(text: str) -> list[int]:
    """``N`` -> seeds 0..N-1; ``a,b,c`` (or ``a,`` for one) -> those seeds, in that order."""
    return [int(v) for v in text.split(",") if v] if "," in text else list(range(int(text)))


def jobs_and_summaries(args: argparse.Namespace) -> tuple[list[X.Job], dict[str, Any]]:
    jobs, how = [], {}
    seeds = args.seeds
    if args.only in ("all", "healthy"):
        for setting in args.settings:
            model, extra = SETTINGS[setting]
            for variant in args.variants:
                flags = VARIANTS[variant]
                for seed in seeds:
                    out = Path(args.out) / f"healthy-{setting}" / f"{variant}-s{seed}"
                    cmd = command(model, args.sft, out, seed, args.steps, (*extra, *flags))
                    threads = (("OMP_NUM_THREADS", str(args.threads)),)
                    jobs.append(X.Job(variant, f"healthy-{setting}", seed, out, tuple(cmd), threads))
                    how[jobs[-1].key] = healthy_summary
    if args.only in ("all", "faults"):
        model = "small" if "smollm2" in args.settings else "tiny"
        fault_steps = args.fault_steps or FAULT_STEPS[model]
        lead = args.resume_lead
        resumed = [k for k in fault_steps if lead and k > lead]  # these fault runs start from a base checkpoint
        bases = {}
        if resumed:
            every = math.gcd(*(k - lead for k in resumed))
            for variant in args.variants:
                for seed in seeds[: args.plain_fault_seeds] if variant == "plain" else seeds:
                    out = Path(args.out) / BASE / f"{variant}-s{seed}"
                    save = ("trainer.save_strategy=steps", f"trainer.save_steps={every}")
                    save += ("trainer.save_total_limit=null",)
                    extra = (*VARIANTS[variant], "eval.every=0", *save)
                    cmd = command(model, args.sft, out, seed, max(resumed) - lead, extra)
                    jobs.append(X.Job(variant, BASE, seed, out, tuple(cmd), (("OMP_NUM_THREADS", str(args.threads)),)))
                    how[jobs[-1].key] = lambda job, run: {"status": run.status, "last_step": run.last_step}
                    bases[variant, seed] = out
        for fault in args.faults:
            callback, overrides, env = FAULTS[fault]
            overrides = SMALL_OVERRIDES.get(fault, overrides) if model == "small" else overrides
            for step in fault_steps:
                for variant in args.variants:
                    flags = VARIANTS[variant]
                    for seed in seeds[: args.plain_fault_seeds] if variant == "plain" else seeds:
                        scenario = f"fault-{fault}-{step}"
                        out = Path(args.out) / scenario / f"{variant}-s{seed}"
                        extra = [*overrides, *flags, "eval.every=0"]
                        if step in resumed:
                            checkpoint = bases[variant, seed] / f"checkpoint-{step - lead}"
                            extra.append(f"trainer.resume_from_checkpoint={checkpoint}")
                        if callback is not None:
                            extra.append(f"callbacks=['steadyrl.faults:{callback}']")
                        elif model == "small":
                            extra.append(f"rewards=[{SMALL_BURST.format(step=step, seed=seed)}]")
                        else:
                            burst = BURST.format(step=step, seed=seed)
                            extra += [f"rewards=[{burst}, {{fn: exact_match, weight: 0.0}}]", "eval.metric=exact_match"]
                        cmd = command(model, args.sft, out, seed, step + AFTER, tuple(extra))
                        job_env = tuple(
                            {FAULT_STEP_ENV: str(step), "OMP_NUM_THREADS": str(args.threads), **env}.items()
                        )
                        jobs.append(X.Job(variant, scenario, seed, out, tuple(cmd), job_env))
                        how[jobs[-1].key] = lambda job, run, k=step, b=callback is None: fault_summary(job, run, k, b)
    return jobs, how


CALM = ("norm_over_baseline_max", "spike_z_max", "kl_last_over_early", "entropy_min_over_start")
HEALTHY_METRICS = (
    *CALM,
    "skipped_steps",
    "rollbacks",
    "repairs",
    "gold_rollbacks",
    "evals",
    "intervention_share_max",
    "filtered_row_share",
    "interventions",
    "own_controller_warning",
    "doctor",
    "eval",
    "steps",
    "wall_s",
)
FAULT_METRICS = ("caught", "steps_to_action", "fired", "inf_left_in_adam", "last_step", "interventions", "wall_s")


def _head(*columns: str) -> list[str]:
    return ["", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def results_from_cells(cells: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """The per-run summaries ``tables`` reads, back from a results file's cells (``--retable``)."""
    out = {}
    for c in cells:
        for i, seed in enumerate(c["seeds"]):
            run = {key: values[i] for key, values in c["metrics"].items()}
            run.update(status="died" if c["died"][i] else "ok", accuracy=c["accuracy"][i], model=c.get("model"))
            out[c["variant"], c["scenario"], seed] = run
    return out


def tables(results: dict[tuple[str, str, int], dict[str, Any]]) -> str:
    """Markdown: one row per healthy setting (all against plain, paired by seed), one per fault scenario (and
    model, where the runs say which)."""
    lines = [
        "| healthy setting | runs with a skip, rollback or repair | largest per-kind share of steps (worst run) | "
        "interventions per 100 steps, by layer (runs with any) | rows filtered outside zero-variance groups | "
        "runs with a doctor warning on steadyrl's own settings | accuracy, all − plain (paired, mean; worst seed) |",
        "|---|---|---|---|---|---|---|",
    ]
    scenarios = sorted({s for (_, s, _) in results})
    for scenario in [s for s in scenarios if s.startswith("healthy-")]:
        runs = {seed: r for (v, s, seed), r in results.items() if s == scenario and v == "all"}
        plain = {seed: r for (v, s, seed), r in results.items() if s == scenario and v == "plain"}
        if not runs:
            continue
        any_hard = sum(bool(r["skipped_steps"] or r["rollbacks"] or r["repairs"]) for r in runs.values())
        worst = max((r["intervention_share_max"] or 0.0) for r in runs.values())
        steps = sum(r["steps"] or 0 for r in runs.values())
        per_layer = []
        for layer in ("gepo", "opefo", "quatro", "grade"):
            counts = [sum(n for k, n in r["interventions"].items() if KINDS[k].layer == layer) for r in runs.values()]
            rate = 100 * sum(counts) / steps if steps else 0.0
            per_layer.append(f"{layer.upper()} {rate:.2f} ({sum(n > 0 for n in counts)}/{len(runs)})")
        layers = ", ".join(per_layer)
        rows = X.finite(r["filtered_row_share"] for r in runs.values())
        row_share = f"{100 * max(rows):.2f} % max" if rows else "-"
        warned = sum(r["own_controller_warning"] for r in runs.values())
        acc = {s: r["accuracy"] for s, r in runs.items() if r["accuracy"] is not None}
        ref = {s: r["accuracy"] for s, r in plain.items() if r["accuracy"] is not None}
        diffs = [acc[s] - ref[s] for s in acc if s in ref]
        paired = f"{100 * statistics.fmean(diffs):+.1f} pts; {100 * min(diffs):+.1f}" if diffs else "-"
        cells = [f"{any_hard}/{len(runs)}", f"{100 * worst:.2f} %", layers, row_share, f"{warned}/{len(runs)}", paired]
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    lines += _head("healthy setting, every eval metric", "all − plain (paired, mean; worst seed), points")
    for scenario in [s for s in scenarios if s.startswith("healthy-")]:
        pairs = [
            (r, results.get(("plain", s, seed))) for (v, s, seed), r in results.items() if s == scenario and v == "all"
        ]
        pairs = [(a, b) for a, b in pairs if b is not None]
        names = sorted({k for a, b in pairs for k in a["eval"] if k in b["eval"]})
        parts = []
        for name in names:
            diffs = [a["eval"][name] - b["eval"][name] for a, b in pairs if name in a["eval"] and name in b["eval"]]
            parts.append(f"{name} {100 * statistics.fmean(diffs):+.1f}; {100 * min(diffs):+.1f}")
        lines.append(f"| {scenario} | {', '.join(parts) or '-'} |")
    lines += _head(
        "healthy setting, plain TRL: how close a calm run comes",
        "largest norm / spike baseline",
        "largest robust z",
        "KL, last 10 steps / steps 11-20",
        "lowest 10-step entropy / first 10",
    )
    for scenario in [s for s in scenarios if s.startswith("healthy-")]:
        calm = [r for (v, s, _), r in results.items() if s == scenario and v == "plain"]
        spans = []
        for key in CALM:
            vals = X.finite(r.get(key) for r in calm)
            spans.append(f"{min(vals):.2f}–{max(vals):.2f}" if vals else "-")
        if calm:
            lines.append(f"| {scenario} | " + " | ".join(spans) + " |")
    head = ("fault scenario", "model", "caught (all)", "steps to action (max)", "all: runs died", "plain: runs died")
    lines += _head(*head)
    faults = {(s, r.get("model") or "-") for (_, s, _), r in results.items() if s.startswith("fault-")}
    for scenario, model in sorted(faults, key=lambda sm: (sm[1], sm[0].rsplit("-", 1)[0], int(sm[0].rsplit("-")[-1]))):
        mine = [(v, r) for (v, s, _), r in results.items() if s == scenario and (r.get("model") or "-") == model]
        runs, plain = [r for v, r in mine if v == "all"], [r for v, r in mine if v == "plain"]
        delays = [r["steps_to_action"] for r in runs if r["steps_to_action"] is not None]
        died = sum(r["status"] != "ok" for r in runs)
        plain_died = sum(r["status"] != "ok" for r in plain)
        caught = f"{sum(r['caught'] for r in runs)}/{len(runs)}"
        delay = str(max(delays)) if delays else "-"
        row = [scenario, model, caught, delay, f"{died}/{len(runs)}", f"{plain_died}/{len(plain)}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", default="runs/tiny-sft/final", help="the tiny SFT checkpoint (configs/tiny/sft.yaml)")
    ap.add_argument("--seeds", type=seed_list, default=seed_list("8"), help="a count N (seeds 0..N-1) or a list 1,0,2")
    ap.add_argument("--plain-fault-seeds", type=int, default=2, help="plain TRL's seeds per fault scenario")
    ap.add_argument("--settings", nargs="+", default=["demo", "lr3e-5", "lr3e-4"], choices=list(SETTINGS))
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=list(FAULTS))
    ap.add_argument("--fault-steps", nargs="+", type=int, default=None)
    ap.add_argument(
        "--resume-lead",
        type=int,
        default=0,
        help="fault runs at a step past this resume from a checkpoint of one healthy run per (variant, seed) saved "
        "this many steps before the fault, instead of training the steps before it again (0: every run from step 0)",
    )
    ap.add_argument("--only", choices=("all", "healthy", "faults"), default="all")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="in run order")
    ap.add_argument("--steps", type=int, default=None, help="healthy runs' max_steps (default: the config's)")
    ap.add_argument("--out", default="runs/precision")
    ap.add_argument("--results", default=None)
    ap.add_argument("--merge", action="store_true", help="replace only this invocation's cells in --results")
    ap.add_argument("--collect-only", action="store_true")
    ap.add_argument(
        "--commit", default=None, help="with --collect-only: the commit the runs were made at (default: HEAD)"
    )
    ap.add_argument("--reuse", action="store_true", help="read back a run folder that has run.json, run the others")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (SmolLM2 runs: 2)")
    ap.add_argument("--workers", type=int, default=1, help="runs at a time (tiny runs: 2 x 1 thread on 2 cores)")
    ap.add_argument("--retable", action="store_true", help="rewrite --results' table from its cells; run nothing")
    args = ap.parse_args()
    if args.retable:
        doc = json.loads(Path(args.results).read_text())
        doc["table"] = tables(results_from_cells(doc["cells"]))
        print(doc["table"])
        X.write_results(args.results, doc)
        return
    if args.commit and not args.collect_only:
        ap.error("--commit names the commit of runs already made: use it with --collect-only")
    sha = args.commit or X.commit()
    models = sorted({SETTINGS[s][0] for s in args.settings})
    model = ", ".join(
        {"tiny": "tiny-llama-0.9m (SFT checkpoint)", "small": "smollm2-135m-instruct + LoRA"}[m] for m in models
    )
    jobs, how = jobs_and_summaries(args)
    results = X.run_jobs(
        jobs, lambda job, run: {**how[job.key](job, run), "model": model}, timeout=args.timeout,
        collect_only=args.collect_only, reuse=args.reuse, workers=args.workers,
    )  # fmt: skip
    text = tables(results)
    print(text)
    if args.results:
        cells = []
        for scenario in dict.fromkeys(job.scenario for job in jobs if job.scenario != BASE):
            for variant in VARIANTS:
                present = sorted(seed for (v, s, seed) in results if v == variant and s == scenario)
                if not present:
                    continue
                runs = [results[(variant, scenario, seed)] for seed in present]
                keys = HEALTHY_METRICS if scenario.startswith("healthy-") else FAULT_METRICS
                cells.append(X.cell(scenario, variant, present, runs, keys, died=lambda r: r["status"] != "ok"))
        doc = X.results_doc(
            "precision_recall",
            cells,
            command=X.script_command("bench_precision.py"),
            sha=sha,
            model=model,
            steps=args.steps or "config",
            table=text,
        )
        doc = X.write_results(args.results, doc, merge=args.merge)
        if args.merge:  # the table of every cell in the file, not only of this invocation's
            doc["table"] = tables(results_from_cells(doc["cells"]))
            X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
