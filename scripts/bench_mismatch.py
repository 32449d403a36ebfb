"""The rollout-trainer mismatch on real vLLM rollouts (vLLM's CPU build, colocate mode): ``mismatch/*`` on healthy
runs and on runs whose weight sync silently stops after step ``--stale-after`` (``steadyrl.faults.StaleVllmAfterStep``),
the doctor's verdict, and how many steps an ESS gate would skip at several ``ess_min`` (its false-alarm rate on the
healthy runs; the gate is deterministic in ``mismatch/ess``, so this is what it would do).

Runs ``configs/tiny/grpo.yaml`` on a random tiny model with a dense reward (``byte_mean``: a random model learns from
step 1), every layer on. Needs vLLM: run it with ``.venv-vllm`` (``bash scripts/test_vllm_cpu.sh --setup``).

    .venv-vllm/bin/python scripts/bench_mismatch.py --seeds 3 --results docs/results/mismatch.json

``--real``: SmolLM2-135M-Instruct instead (``configs/small/grpo.yaml``, full fine-tuning at its lr 1e-5, the
converted model folder from ``steadyrl.tasks.smollm2``, which ``.venv`` makes), completions of up to 128 tokens at the
base config's sampling (temperature 0.9, top_p 0.95) with ``token_truncate``: where TRL 1.16's ratio carries the
kept probability mass (``steadyrl.guards.mismatch.truncation_band``). About 90 s a step on 2 cores.

    .venv-vllm/bin/python scripts/bench_mismatch.py --real --seeds 1 --steps 8 --results F
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

from steadyrl import metrics as M  # noqa: E402
from steadyrl.evidence.doctor import diagnose, doctor_config_for  # noqa: E402

NAMES = ("ess", "kl", "chi2", "corrected_share", "log_ppl_diff", "ratio_q01", "ratio_q99")
TRL_RATIO_MEAN = "sampling/importance_sampling_ratio/mean"  # TRL's: the kept mass, where sampling truncates
GATES = (0.5, 0.9, 0.99, 0.999)  # ess_min values whose would-be skips are counted
SCENARIOS = {  # name: (learning rate, stale)
    "healthy-lr1e-3": (1.0e-3, False),
    "healthy-lr1e-4": (1.0e-4, False),
    "stale-weights-lr1e-3": (1.0e-3, True),
    "stale-weights-lr1e-4": (1.0e-4, True),  # the policy moves 10x slower from vLLM's stale copy: the hard case
}
REAL = {  # SmolLM2, 128-token completions at top_p 0.95 (--real)
    "healthy-smollm2-top_p0.95-len128": (1.0e-5, False),
    "stale-weights-smollm2-top_p0.95-len128": (1.0e-5, True),
}
EVERY_LAYER = tuple(f"guards.{layer}.enabled=true" for layer in ("gepo", "opefo", "quatro", "grade"))


def _run(config: str, model: Path, out: Path, seed: int, steps: int, lr: float, stale: bool, *more: str) -> list[str]:
    """The overrides every run of this bench shares (vLLM colocate, one row per step, no checkpoints), then ``more``."""
    return X.train_command(
        REPO / config,
        f"model.path={model}",
        f"trainer.output_dir={out}",
        f"trainer.seed={seed}",
        f"trainer.max_steps={steps}",
        f"trainer.learning_rate={lr}",
        "trainer.use_vllm=true",
        "trainer.vllm_mode=colocate",
        "trainer.logging_steps=1",
        'trainer.save_strategy="no"',
        *more,
        'callbacks=["steadyrl.faults:StaleVllmAfterStep"]' if stale else "callbacks=[]",
    )


def real_command(model: Path, out: Path, seed: int, steps: int, lr: float, stale: bool) -> list[str]:
    return _run("configs/small/grpo.yaml", model, out, seed, steps, lr, stale,
                "trainer.max_completion_length=128", "trainer.temperature=0.9", "trainer.top_p=0.95",
                "trainer.vllm_importance_sampling_mode=token_truncate", "eval.enabled=false")  # fmt: skip


def command(model: Path, out: Path, seed: int, steps: int, lr: float, stale: bool) -> list[str]:
    return _run("configs/tiny/grpo.yaml", model, out, seed, steps, lr, stale,
                "trainer.per_device_train_batch_size=16", "trainer.max_completion_length=6", "trainer.beta=0.02",
                "trainer.report_to=[]", "rewards=[{fn: 'tests.integration.helpers:byte_mean'}]", "eval.every=0",
                "eval.max_samples=16", *EVERY_LAYER)  # fmt: skip


def summarise(job: X.Job, run: X.Outcome, stale_after: int) -> dict[str, Any]:
    out: dict[str, Any] = {"status": run.status, "wall_s": run.wall_s, "last_step": run.last_step}
    history = run.history
    if history is None:
        return out
    series = {name: history.finite(M.SAMPLING_LOGP_GAP if name == "gap" else f"mismatch/{name}")[1].tolist()
              for name in ("gap", *NAMES)}  # fmt: skip
    series["trl_ratio_mean"] = history.finite(TRL_RATIO_MEAN)[1].tolist()
    out["per_step"] = series
    ess = series["ess"]
    late = slice(stale_after, None)  # healthy: every step after the first stale_after; stale: the stale ones
    for name, values in series.items():
        if values[late]:
            out[f"{name}_median_late"] = statistics.median(values[late])
    out["ess_min"] = min(ess) if ess else None
    for gate in GATES:
        out[f"gate_{gate:g}_would_skip"] = sum(v < gate for v in ess)
    findings = diagnose(history, doctor_config_for(job.out))
    out["doctor"] = [f"{f.severity} {f.mode}: {f.summary}" for f in findings]
    out["off_policy_found"] = any(f.mode == "off_policy_rollouts" for f in findings)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--stale-after", type=int, default=2, help="the sync stops reaching vLLM after this step")
    ap.add_argument("--out", default="runs/bench-mismatch")
    ap.add_argument("--results", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reuse", action="store_true", help="read finished runs instead of running them again")
    ap.add_argument("--real", action="store_true", help="SmolLM2 at 128 tokens and top_p 0.95 (module docstring)")
    ap.add_argument("--scenarios", nargs="+", default=None, help="a subset of the scenarios (default: all)")
    ap.add_argument("--tag", default="", help="appended to each scenario's name in the results (e.g. =-200steps)")
    args = ap.parse_args()

    import vllm  # noqa: F401  (fail here, not in every run, when vLLM is missing)

    from steadyrl.tasks import build_tiny_model

    root = Path(args.out)
    model = root / "model"
    scenarios, build = (REAL, real_command) if args.real else (SCENARIOS, command)
    unknown = sorted(set(args.scenarios or ()) - set(scenarios))
    if unknown:
        ap.error(f"unknown scenarios {unknown}; valid: {', '.join(scenarios)}")
    scenarios = {k: v for k, v in scenarios.items() if args.scenarios is None or k in args.scenarios}
    if args.real:
        from steadyrl.tasks.smollm2 import cache_root

        found = sorted(cache_root().glob("smollm2-135m-instruct-*/config.json"))
        if not found:
            raise SystemExit("no converted SmolLM2 folder: run `steadyrl train configs/small/grpo.yaml` in .venv once")
        model = found[-1].parent
    elif not (model / "config.json").is_file():
        build_tiny_model(model, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    env = (("OMP_NUM_THREADS", str(args.threads)), ("VLLM_CPU_KVCACHE_SPACE", "2" if args.real else "1"),
           ("STEADYRL_FAULT_STEP", str(args.stale_after)))  # fmt: skip
    jobs = []
    for scenario, (lr, stale) in scenarios.items():
        for seed in range(args.seeds):
            out = root / f"{scenario}-s{seed}"
            jobs.append(X.Job("all", scenario, seed, out, tuple(build(model, out, seed, args.steps, lr, stale)), env))

    def progress(job: X.Job, r: dict[str, Any]) -> None:
        late = r.get("ess_median_late")
        print(f"{job.scenario} seed {job.seed}: {r.get('status')}, ESS late {late}, {r.get('doctor')}", flush=True)

    done = X.run_jobs(
        jobs, lambda job, run: summarise(job, run, args.stale_after), timeout=3600, reuse=args.reuse, after=progress
    )
    seeds = list(range(args.seeds))
    keys = ["ess_min", *(f"{n}_median_late" for n in ("gap", *NAMES, "trl_ratio_mean")),
            *(f"gate_{g:g}_would_skip" for g in GATES), "off_policy_found", "doctor", "per_step", "wall_s"]  # fmt: skip
    cells = [
        X.cell(
            scenario + args.tag,
            "all",
            seeds,
            [done[("all", scenario, s)] for s in seeds],
            keys,
            died=lambda r: r["status"] != "ok",
        )
        for scenario in scenarios
    ]
    doc = X.results_doc(
        "mismatch", cells, command=X.script_command("bench_mismatch.py"), sha=X.commit(),
        model=("SmolLM2-135M-Instruct" if args.real else "tiny-llama (random, 64 hidden, 2 layers)")
        + " + vLLM CPU colocate", steps=args.steps,
        stale_after=args.stale_after, late_window=f"steps after {args.stale_after}",
    )  # fmt: skip
    for c in cells:
        m = c["metrics"]
        print(f"{c['scenario']:>22}: ESS min {m['ess_min']}, late median {m['ess_median_late']}, KL late "
              f"{m['kl_median_late']}, doctor off-policy {m['off_policy_found']}, gate 0.99 would skip "
              f"{m['gate_0.99_would_skip']}")  # fmt: skip
    if args.results:
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
