"""Failures nobody injected (issue 56): runs that go wrong by themselves, plain TRL against every layer on, same seeds.

Tiny model from the demo's SFT checkpoint (``configs/tiny/grpo-guarded.yaml``, 200 steps), both variants with the
same periodic eval (every 20 steps and before training: the gold metric's path, which training never sees):

    lr-x10, lr-x30, lr-x100   the learning rate 10x, 30x, 100x the demo's 1e-4
    reward-outliers           exact match plus a reward model's rare huge outliers (1 % of rows, +-20..100)
    false-positives           a verifier with systematic false positives (the last digit right pays)

SmolLM2-135M + LoRA (``configs/small/grpo-lora.yaml``, its 3e-4; run with ``--steps 30`` on 2 cores), an eval every 10
steps and before training:

    smollm2-lr-x10, smollm2-lr-x30   the learning rate 10x, 30x the shipped one

Per run: ``gold_start`` (the eval before training), ``gold_peak``, ``gold_final`` (the final eval of the policy the
run ended on), ``died``, ``acted_at_step`` (the first step with any intervention in the ledger, None: none),
``gold_rollbacks`` (rollbacks and the stop, not the end-of-run swap to the best policy) and the step of the first,
the interventions (steps per kind), and the doctor's findings.

    python scripts/bench_natural.py --sft runs/tiny-sft/final --seeds 5 --results docs/results/natural_failures.json
    python scripts/bench_natural.py --scenarios smollm2-lr-x30 smollm2-lr-x10 --seeds 2 --steps 30 --results F.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402
from bench_precision import VARIANTS, command, healthy_summary, seed_list  # noqa: E402

from steadyrl import metrics as M  # noqa: E402
from steadyrl.evidence.interventions import KINDS  # noqa: E402

GOLD = ("eval.metric=exact_match",)
SCENARIOS: dict[str, tuple[str, ...]] = {
    "lr-x10": ("trainer.learning_rate=1.0e-3",),
    "lr-x30": ("trainer.learning_rate=3.0e-3",),
    "lr-x100": ("trainer.learning_rate=1.0e-2",),
    "reward-outliers": (
        "rewards=[{fn: 'steadyrl.faults:exact_match_outliers', kwargs: {rate: 0.01, seed: {seed}}}, "
        "{fn: exact_match, weight: 0.0}]",
        *GOLD,
    ),
    "false-positives": ("rewards=[{fn: 'steadyrl.faults:last_digit_match'}, {fn: exact_match, weight: 0.0}]", *GOLD),
    "smollm2-lr-x10": ("trainer.learning_rate=3.0e-3",),
    "smollm2-lr-x30": ("trainer.learning_rate=9.0e-3",),
}
EVAL = {"tiny": ("eval.every=20", "eval.on_start=true"), "small": ("eval.every=10", "eval.on_start=true")}
MODELS = {"tiny": "tiny-llama-0.9m (SFT checkpoint)", "small": "smollm2-135m-instruct + LoRA"}


def model_of(scenario: str) -> str:
    return "small" if scenario.startswith("smollm2-") else "tiny"


METRICS = (
    "gold_start",
    "gold_peak",
    "gold_final",
    "acted_at_step",
    "gold_rollbacks",
    "first_gold_rollback_step",
    "interventions",
    "doctor",
    "last_step",
    "wall_s",
)


def first_step(history: Any, name: str) -> int | None:
    if history is None or not history.has(name):
        return None
    steps, values = history.series(name)
    return next((int(s) for s, v in zip(steps.tolist(), values.tolist(), strict=True) if v > 0), None)


def natural_summary(job: X.Job, run: X.Outcome) -> dict[str, Any]:
    out = healthy_summary(job, run)
    history = run.history
    evals = history.finite(M.EVAL_ACCURACY)[1].tolist() if history is not None else []
    out["gold_start"] = evals[0] if evals else None
    out["gold_peak"] = max(evals) if evals else None
    out["gold_final"] = out["accuracy"]
    firsts = [s for kind in KINDS if (s := first_step(history, M.ledger(kind))) is not None]
    out["acted_at_step"] = min(firsts) if firsts else None
    # the watch's rollbacks and stops (a verdict), not the end-of-run swap to the best policy
    events = history.events_of(M.EVENT_GOLD_ROLLBACK) if history is not None else []
    out["gold_rollbacks"] = sum(1 for e in events if e.get("verdict"))
    out["first_gold_rollback_step"] = first_step(history, M.ledger("gold_rollback"))
    return out


def jobs_for(args: argparse.Namespace) -> list[X.Job]:
    jobs = []
    for scenario in args.scenarios:
        for variant in args.variants:
            for seed in args.seeds:
                out = Path(args.out) / scenario / f"{variant}-s{seed}"
                extra = tuple(o.replace("{seed}", str(seed)) for o in SCENARIOS[scenario])
                model = model_of(scenario)
                cmd = command(model, args.sft, out, seed, args.steps, (*extra, *EVAL[model], *VARIANTS[variant]))
                jobs.append(X.Job(variant, scenario, seed, out, tuple(cmd), (("OMP_NUM_THREADS", str(args.threads)),)))
    return jobs


def _fmt(values: list[Any]) -> str:
    finite = X.finite(values)
    if not finite:
        return "-"
    return f"{statistics.fmean(finite):.3f} ({', '.join(f'{v:.2f}' for v in finite)})"


def table(results: dict[tuple[str, str, int], dict[str, Any]]) -> str:
    lines = [
        "| scenario | variant | gold before training | gold peak | gold at the end: mean (per seed) | died | "
        "runs steadyrl acted on (first step) | gold-watch rollbacks | runs the doctor calls healthy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in dict.fromkeys(s for (_, s, _) in results):
        for variant in VARIANTS:
            runs = [r for (v, s, _), r in sorted(results.items()) if v == variant and s == scenario]
            if not runs:
                continue
            acted = [r["acted_at_step"] for r in runs if r.get("acted_at_step") is not None]
            acted_text = f"{len(acted)}/{len(runs)}" + (f" ({min(acted)}-{max(acted)})" if acted else "")
            healthy = sum(not r.get("doctor") for r in runs if r["status"] == "ok")
            cells = [
                _fmt([r.get("gold_start") for r in runs]),
                _fmt([r.get("gold_peak") for r in runs]),
                _fmt([r.get("gold_final") for r in runs]),
                f"{sum(r['status'] != 'ok' for r in runs)}/{len(runs)}",
                acted_text,
                str(sum(r.get("gold_rollbacks") or 0 for r in runs)),
                f"{healthy}/{len(runs)}",
            ]
            lines.append(f"| {scenario} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", default="runs/tiny-sft/final", help="the tiny SFT checkpoint (configs/tiny/sft.yaml)")
    ap.add_argument("--seeds", type=seed_list, default=seed_list("5"), help="a count N (seeds 0..N-1) or a list 1,0,2")
    tiny = [s for s in SCENARIOS if model_of(s) == "tiny"]
    ap.add_argument("--scenarios", nargs="+", default=tiny, choices=list(SCENARIOS), help="default: the tiny ones")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=None, help="max_steps (default: the config's 200)")
    ap.add_argument("--out", default="runs/natural")
    ap.add_argument("--results", default=None)
    ap.add_argument("--merge", action="store_true", help="replace only this invocation's cells in --results")
    ap.add_argument("--reuse", action="store_true", help="read back a run folder that has run.json, run the others")
    ap.add_argument("--collect-only", action="store_true", help="run nothing: read the runs in --out again")
    ap.add_argument("--commit", default=None, help="with --collect-only: the commit the runs were made at")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    ap.add_argument("--workers", type=int, default=1, help="runs at a time (tiny runs: 2 x 1 thread on 2 cores)")
    args = ap.parse_args()
    if args.commit and not args.collect_only:
        ap.error("--commit names the commit of runs already made: use it with --collect-only")
    models = {model_of(s) for s in args.scenarios}
    if len(models) > 1:
        ap.error("one model per invocation (a results file records one model): run the smollm2-* scenarios apart")
    (model,) = models
    jobs = jobs_for(args)
    results = X.run_jobs(
        jobs,
        lambda job, run: natural_summary(job, run),
        timeout=args.timeout,
        collect_only=args.collect_only,
        reuse=args.reuse,
        workers=args.workers,
    )
    text = table(results)
    print(text)
    if args.results:
        cells = []
        for scenario in args.scenarios:
            for variant in args.variants:
                present = sorted(seed for (v, s, seed) in results if v == variant and s == scenario)
                runs = [results[(variant, scenario, seed)] for seed in present]
                cells.append(X.cell(scenario, variant, present, runs, METRICS, died=lambda r: r["status"] != "ok"))
        doc = X.results_doc(
            "natural_failures",
            cells,
            command=X.script_command("bench_natural.py"),
            sha=args.commit or X.commit(),
            model=MODELS[model],
            steps=args.steps or (200 if model == "tiny" else 70),
            table=text,
            summarised_at=X.commit(),  # the code that read the runs (the doctor's findings), when collected later
        )
        X.write_results(args.results, doc, merge=args.merge)


if __name__ == "__main__":
    main()
