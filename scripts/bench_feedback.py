"""Error feedback after a skipped gradient spike: what feeding the skipped step's gradient back does to a run's end
metrics (issue 39; one SmolLM2 run with a x1e4 spike at step 65 ended 36 points under its control).

Per seed, one healthy run with every layer on saves a checkpoint ``--lead`` steps before each spike step k; from it,
three runs train to k + ``--after`` with clipping off (``trainer.max_grad_norm=1e9``, as the spike fault everywhere):

    control-<k>     / all                   no spike (GradSpikeAtStep with scale 1: the same hooks, gradients x1)
    grad_spike-<k>  / all                   every gradient x1e4 at step k; every layer on (error feedback on)
    grad_spike-<k>  / all-minus-feedback    the same with guards.opefo.error_feedback.enabled=false

Reported per run: end accuracy and every eval metric the config logs, skipped steps, the steps error feedback
injected into; the table gives each arm's mean and its paired difference against the control, seed by seed. SmolLM2
(``--model small``, constant learning rate) by default; the tiny model's counterpart is bench_stability's ablation
``all - OPEFO feedback`` under ``grad_spike`` (full 200-step runs, where the resumed schedule would differ).

    python scripts/bench_feedback.py --seeds 3 --steps 65 --threads 2 --results docs/results/error_feedback.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402
from bench_precision import CONFIGS, command, healthy_summary, seed_list  # noqa: E402

from steadyrl import metrics as M  # noqa: E402
from steadyrl.faults import FAULT_SCALE_ENV, FAULT_STEP_ENV  # noqa: E402

CLIP_OFF = "trainer.max_grad_norm=1e9"
NO_FEEDBACK = "guards.opefo.error_feedback.enabled=false"
ARMS = {  # (scenario prefix, variant) -> (spike scale, overrides)
    ("control", "all"): ("1", ()),
    ("grad_spike", "all"): ("1e4", ()),
    ("grad_spike", "all-minus-feedback"): ("1e4", (NO_FEEDBACK,)),
}
CONTROL = ("control", "all")


def summarise(job: X.Job, run: X.Outcome) -> dict[str, Any]:
    out = healthy_summary(job, run)
    history = run.history
    injected = 0
    if history is not None and history.has(M.OPEFO_EF_WEIGHT):
        injected = sum(v > 0 for v in history.series(M.OPEFO_EF_WEIGHT)[1].tolist())
    out["feedback_steps"] = injected
    return out


def jobs(args: argparse.Namespace) -> tuple[list[X.Job], dict[tuple[str, str, int], Any]]:
    every = math.gcd(*(k - args.lead for k in args.steps))
    out, how, threads = [], {}, ("OMP_NUM_THREADS", str(args.threads))
    for seed in args.seeds:
        base = Path(args.out) / "base" / f"all-s{seed}"
        save = ("trainer.save_strategy=steps", f"trainer.save_steps={every}", "trainer.save_total_limit=null")
        cmd = command(args.model, args.sft, base, seed, max(args.steps) - args.lead, (*save, "eval.every=0"))
        out.append(X.Job("all", "base", seed, base, tuple(cmd), (threads,)))
        how[out[-1].key] = lambda job, run: {"status": run.status, **_skips(run)}
        for k in args.steps:
            for (prefix, variant), (scale, flags) in ARMS.items():
                folder = Path(args.out) / f"{prefix}-{k}" / f"{variant}-s{seed}"
                resume = f"trainer.resume_from_checkpoint={base / f'checkpoint-{k - args.lead}'}"
                extra = (CLIP_OFF, *flags, "eval.every=0", resume, "callbacks=['steadyrl.faults:GradSpikeAtStep']")
                cmd = command(args.model, args.sft, folder, seed, k + args.after, extra)
                env = (threads, (FAULT_STEP_ENV, str(k)), (FAULT_SCALE_ENV, scale))
                out.append(X.Job(variant, f"{prefix}-{k}", seed, folder, tuple(cmd), env))
                how[out[-1].key] = summarise
    return out, how


def _skips(run: X.Outcome) -> dict[str, int]:
    """A base run must train healthy (no skip): error feedback acts only after one, so the arms share it."""
    history = run.history
    name = M.ledger("skipped_step")
    if history is None or not history.has(name):
        return {"skipped_steps": 0}
    return {"skipped_steps": sum(v > 0 for v in history.series(name)[1].tolist())}


def _eval(control: dict[int, dict[str, Any]], seed: int, run: dict[str, Any]) -> set[str]:
    """The eval metrics both this run and its seed's control logged."""
    return set(run["eval"]) & set(control.get(seed, {}).get("eval", {}))


def table(results: dict[tuple[str, str, int], dict[str, Any]], steps: list[int]) -> str:
    lines = [
        "| spike step | arm | accuracy (mean; per seed) | paired − control, points (mean; worst seed) | every eval "
        "metric − control (mean) | skipped steps | steps with feedback injected |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in steps:
        control = {seed: r for (v, s, seed), r in results.items() if (s, v) == (f"control-{k}", "all")}
        for prefix, variant in ARMS:
            runs = {seed: r for (v, s, seed), r in results.items() if (s, v) == (f"{prefix}-{k}", variant)}
            if not runs:
                continue
            acc = {s: r["accuracy"] for s, r in sorted(runs.items()) if r["accuracy"] is not None}
            seeds = ", ".join(f"{a:.3f}" for a in acc.values())
            mean = f"{statistics.fmean(acc.values()):.3f}; {seeds}" if acc else "-"
            diffs = [acc[s] - control[s]["accuracy"] for s in acc if s in control and control[s]["accuracy"]]
            paired = f"{100 * statistics.fmean(diffs):+.1f}; {100 * min(diffs):+.1f}" if diffs else "-"
            names = sorted({n for r in runs.values() for n in r["eval"]})
            evals = []
            for n in names:
                d = [r["eval"][n] - control[s]["eval"][n] for s, r in runs.items() if n in _eval(control, s, r)]
                evals.append(f"{n} {100 * statistics.fmean(d):+.1f}" if d else f"{n} -")
            if (prefix, variant) == CONTROL:
                paired, evals = "(control)", ["(control)"]
            skipped = "/".join(str(r["skipped_steps"]) for _, r in sorted(runs.items()))
            feedback = "/".join(str(r["feedback_steps"]) for _, r in sorted(runs.items()))
            arm = "no spike" if prefix == "control" else variant
            lines.append(f"| {k} | {arm} | {mean} | {paired} | {', '.join(evals)} | {skipped} | {feedback} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(CONFIGS), default="small")
    ap.add_argument("--sft", default=None, help="the tiny model's SFT checkpoint (--model tiny)")
    ap.add_argument("--seeds", type=seed_list, default=seed_list("3"), help="a count N (seeds 0..N-1) or a list 1,0,2")
    ap.add_argument("--steps", nargs="+", type=int, default=[65], help="the spike steps")
    ap.add_argument("--lead", type=int, default=5, help="the arms resume from the base run's checkpoint at k - lead")
    ap.add_argument("--after", type=int, default=15, help="each arm stops this many steps after the spike")
    ap.add_argument("--out", default="runs/feedback")
    ap.add_argument("--results", default=None)
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--reuse", action="store_true", help="read back a run folder that has run.json, run the others")
    args = ap.parse_args()
    if any(k <= args.lead for k in args.steps):
        ap.error(f"every spike step must come after --lead ({args.lead}): {args.steps}")
    sha = X.commit()
    model = {"tiny": "tiny-llama-0.9m (SFT checkpoint)", "small": "smollm2-135m-instruct + LoRA"}[args.model]
    todo, how = jobs(args)
    results = X.run_jobs(todo, lambda job, run: how[job.key](job, run), timeout=args.timeout, reuse=args.reuse)
    bases = [(f"{v}-s{seed}", r) for (v, s, seed), r in results.items() if s == "base"]
    bad = [f"{name}: {r}" for name, r in bases if r["status"] != "ok" or r["skipped_steps"]]
    if bad:
        print("WARNING: a base run died or skipped a step, so its arms do not share a healthy start:", *bad)
    text = table(results, args.steps)
    print(text)
    if args.results:
        cells = []
        for k in args.steps:
            for prefix, variant in ARMS:
                scenario = f"{prefix}-{k}"
                present = sorted(seed for (v, s, seed) in results if (s, v) == (scenario, variant))
                runs = [results[(variant, scenario, seed)] for seed in present]
                keys = ("eval", "skipped_steps", "feedback_steps", "interventions", "wall_s")
                cells.append(X.cell(scenario, variant, present, runs, keys, died=lambda r: r["status"] != "ok"))
        doc = X.results_doc(
            "error_feedback", cells, command=X.script_command("bench_feedback.py"), sha=sha, model=model,
            steps=f"spike at {args.steps}, {args.after} steps after, resumed {args.lead} steps before", table=text,
        )  # fmt: skip
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
