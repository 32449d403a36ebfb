"""GRADE in its own setting: PPO with a learned reward model, groups A/B/C over seeds (seed 004 §4.1).

Same base model (the tiny SFT checkpoint), same reward model (trained by ``steadyrl reward``), same data, lr, batch
and KL coefficient; only the reward processing differs:

- A ``plain``: raw PPO, the reward model's score goes to GAE as it is;
- B ``grade-whiten``: GRADE's rolling whitening only (no tail clip, no centring), with the KL compensation of §5.3;
- C ``grade``: full GRADE (whitening, quantile tail clip, per-prompt counterfactual centring) + KL compensation.

Two reward settings ("scenarios"): ``rm``, the reward model alone, and ``rm-artefacts``, the same reward model
with occasional large artefacts (``steadyrl.faults.reward_model_artefacts``: 5% of rows get +-U(5, 20) reward-model
standard deviations, seeded by (seed, step), so the three groups see the same artefacts at the same rows), the
long-tailed case the design notes describe (§1.2, §2.3).

Figures (§2.5, §3.5): the policy gradient's L2 norm (``ppo/policy_grad_norm``: the policy's part only, before
clipping; TRL's ``grad_norm`` also holds the critic's), its coefficient of variation (std / mean) per window of W
optimizer steps (mean over windows), its max / mean ratio, the reward std before and after scaling, the share of
tail-clipped rows, final greedy held-out exact match and its seed-to-seed std, and the tail share: per rollout
batch, the share of the batch's reward variance (sum of squared deviations from the batch mean) carried by its 5%
rows farthest from the batch median, on the rewards that reach GAE. The rewards are logged per row by the reward
function; GRADE's output is recomputed offline by replaying ``GradeScaler`` on the logged rollouts (checked
against the std the run logged). In PPO with a terminal reward, a row's policy-gradient weight is its advantage,
linear in its reward for a given critic, so with similar log-prob gradient norms across rows this reward-side
share is the share of the gradient variance the tail carries.

    OMP_NUM_THREADS=1 python scripts/bench_grade.py --sft runs/demo-sft/final --rm runs/demo-rm/final --seeds 5
    python scripts/bench_grade.py --sft runs/demo-sft/final --rm runs/demo-rm/final --seeds 1 --steps 10   # smoke
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

GROUPS = {  # name: (label, overrides)
    "plain": ("A: raw PPO", ["guards.grade.enabled=false"]),
    "grade-whiten": ("B: whitening only + KL compensation", [
        "guards.grade.enabled=true", "guards.grade.clip=false", "guards.grade.centring_beta=0",
        "guards.grade.kl_compensation=true",
    ]),
    "grade": ("C: full GRADE + KL compensation", ["guards.grade.enabled=true", "guards.grade.kl_compensation=true"]),
}  # fmt: skip
SCENARIOS = {"rm": 0.0, "rm-artefacts": 0.05}  # artefact rate
TAIL = 0.05


def train_command(sft: str, rm: str, out: Path, group: str, rate: float, seed: int, steps: int) -> list[str]:
    rewards = (f"rewards=[{{name: rm, fn: 'steadyrl.faults:reward_model_artefacts', kwargs: {{path: '{rm}', "
               f"rate: {rate}, seed: {seed}, log: '{out / 'rewards.jsonl'}'}}}}, {{fn: exact_match, weight: 0.0}}, "
               "{fn: numeric_match, weight: 0.0}]")  # fmt: skip
    return X.train_command("configs/tiny/ppo.yaml", f"model.path={sft}", rewards,
           *GROUPS[group][1], f"trainer.output_dir={out}", f"trainer.seed={seed}", f"trainer.max_steps={steps}",
           "trainer.logging_steps=1", 'trainer.save_strategy="no"', "trainer.resume_from_checkpoint=null",
           "eval.metric=exact_match", "eval.every=0")  # fmt: skip


def cv(values: list[float]) -> float:
    """Coefficient of variation: sample std / mean."""
    if len(values) < 2 or not statistics.mean(values):
        return math.nan
    return statistics.stdev(values) / statistics.mean(values)


def tail_share(values: list[float], tail: float = TAIL) -> float:
    """Share of sum((r - mean)^2) carried by the ceil(tail * n) rows farthest from the median."""
    n = len(values)
    mean, median = statistics.fmean(values), statistics.median(values)
    dev = [(v - mean) ** 2 for v in values]
    total = sum(dev)
    if n < 2 or total == 0:
        return math.nan
    far = sorted(range(n), key=lambda i: abs(values[i] - median), reverse=True)[: math.ceil(tail * n)]
    return sum(dev[i] for i in far) / total


def replay(batches: list[dict[str, Any]], group: str, steps_per_rollout: int) -> list[list[float]]:
    """GRADE's output on the logged rollouts, recomputed with the group's settings (A: the raw rewards)."""
    import torch

    from steadyrl.config.guard_sections import GradeSection
    from steadyrl.guards.reward_scaler import GradeConfig, GradeScaler

    if group == "plain":
        return [b["rewards"] for b in batches]
    section = GradeSection(enabled=True, **({"clip": False, "centring_beta": 0.0} if group == "grade-whiten" else {}))
    config = GradeConfig(**{f: getattr(section, f) for f in GradeConfig.__dataclass_fields__})
    scaler = GradeScaler(config)
    out = []
    for batch in batches:
        raw = torch.tensor([math.nan if r is None else r for r in batch["rewards"]], dtype=torch.float64)
        out.append(scaler(raw, batch["prompts"], 1).tolist())
        for _ in range(steps_per_rollout):
            scaler.step()
    return out


def analyse(out: Path, history: Any, group: str, window: int, steps_per_rollout: int) -> dict[str, Any]:
    rows = [r for r in history.rows if r.get("ppo/policy_grad_norm") is not None]
    policy = [float(r["ppo/policy_grad_norm"]) for r in rows]
    total = [float(r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
    windows = [policy[i : i + window] for i in range(0, len(policy) - window + 1, window)]
    batches = [json.loads(line) for line in (out / "rewards.jsonl").read_text().splitlines() if line.strip()]
    scaled = replay(batches, group, steps_per_rollout)
    raw = [b["rewards"] for b in batches]
    logged = {int(r["step"]): float(r["grade/scaled_std"]) for r in history.rows if r.get("grade/scaled_std")}
    replay_err = [abs(statistics.stdev(s) - logged[b["step"] + 1]) for b, s in zip(batches, scaled, strict=True)
                  if b["step"] + 1 in logged and all(math.isfinite(v) for v in s)]  # fmt: skip
    clip = [float(r.get("grade/clip_frac_low", 0)) + float(r.get("grade/clip_frac_high", 0))
            for r in history.rows if r.get("grade/clip_frac_low") is not None]  # fmt: skip
    betas = [float(r["ppo/beta"]) for r in history.rows if r.get("ppo/beta") is not None]
    return {
        "policy_grad_norm": policy,
        "grad_norm_cv_window": statistics.fmean(cv(w) for w in windows) if windows else math.nan,
        "grad_norm_cv_run": cv(policy),
        "grad_norm_max_over_mean": max(policy) / statistics.fmean(policy) if policy else math.nan,
        "total_grad_norm_cv_window": statistics.fmean(cv(total[i : i + window]) for i in
                                                      range(0, len(total) - window + 1, window)) if total else math.nan,
        "reward_std_raw": statistics.fmean(statistics.stdev(r) for r in raw),
        "reward_std_scaled": statistics.fmean(statistics.stdev(s) for s in scaled),
        "clipped_share": statistics.fmean(clip) if clip else 0.0,
        "tail_share_raw": statistics.fmean(tail_share(r) for r in raw),
        "tail_share_scaled": statistics.fmean(tail_share(s) for s in scaled),
        "raw_kurtosis": kurtosis([v for r in raw for v in r]),
        "beta_mean": statistics.fmean(betas) if betas else math.nan,
        "replay_max_abs_std_error": max(replay_err) if replay_err else None,
        "rollouts": len(batches),
    }  # fmt: skip


def kurtosis(values: list[float]) -> float:
    """Excess kurtosis (0 for a normal distribution): how heavy the tails are."""
    mean = statistics.fmean(values)
    m2 = statistics.fmean((v - mean) ** 2 for v in values)
    return statistics.fmean((v - mean) ** 4 for v in values) / (m2 * m2) - 3.0 if m2 else math.nan


def mean_std(values: list[float | None]) -> str:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return "-"
    spread = statistics.stdev(vals) if len(vals) > 1 else 0.0
    fmt = ".3f" if max(abs(v) for v in vals) < 100 else ".0f"
    return f"{statistics.fmean(vals):{fmt}} ± {spread:{fmt}}"


def table(cells: list[dict[str, Any]]) -> str:
    keys = [("grad_norm_cv_window", "policy grad-norm CV (per window)"), ("grad_norm_max_over_mean", "max / mean"),
            ("reward_std_raw", "reward std raw"), ("reward_std_scaled", "reward std into GAE"),
            ("clipped_share", "clipped rows"), ("tail_share_raw", "tail 5% share of reward variance, raw"),
            ("tail_share_scaled", "tail 5% share, into GAE")]  # fmt: skip
    lines = ["| reward | group | " + " | ".join(k[1] for k in keys) + " | held-out exact match |",
             "|---|---|" + "---|" * (len(keys) + 1)]  # fmt: skip
    for c in cells:
        m = c["metrics"]
        figures = " | ".join(mean_std(m.get(k, [])) for k, _ in keys)
        lines.append(f"| {c['scenario']} | {GROUPS[c['variant']][0]} | {figures} | {mean_std(c['accuracy'])} |")
    return "\n".join(lines)


def plot(cells: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = list(dict.fromkeys(c["scenario"] for c in cells))
    fig, axes = plt.subplots(len(scenarios), 1, figsize=(8, 3 * len(scenarios)), squeeze=False)
    for ax, scenario in zip(axes[:, 0], scenarios, strict=True):
        for c in cells:
            if c["scenario"] == scenario and c["variant"] in ("plain", "grade") and not c["died"][0]:
                ax.plot(c["metrics"]["policy_grad_norm"][0], label=GROUPS[c["variant"]][0], lw=0.9)
        ax.set_title(f"policy grad norm per step, reward: {scenario}, seed {cells[0]['seeds'][0]}")
        ax.set_xlabel("optimizer step")
        ax.set_yscale("log")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="runs/demo-sft/final")
    parser.add_argument("--rm", default="runs/demo-rm/final", help="from: steadyrl reward configs/tiny/reward.yaml")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20, help="W: optimizer steps per grad-norm CV window")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--workers", "--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before a run is killed (counted as died)")
    parser.add_argument("--out", default="runs/bench-grade")
    parser.add_argument("--results", default="docs/results/grade_ppo.json")
    parser.add_argument("--plot", default="docs/img/grade_ppo_grad_norm.png")
    args = parser.parse_args()
    if not (Path(args.rm) / "config.json").is_file():
        raise SystemExit(
            f"{args.rm} is not a reward model folder: train one with `steadyrl reward "
            f"configs/tiny/reward.yaml model.path={args.sft} trainer.output_dir={Path(args.rm).parent}`"
        )
    code_commit = X.commit()
    seeds = list(range(args.seeds))
    jobs = []
    for scenario in args.scenarios.split(","):
        for group in args.groups.split(","):
            for seed in seeds:
                out = REPO / args.out / scenario / f"{group}-s{seed}"
                cmd = train_command(args.sft, args.rm, out, group, SCENARIOS[scenario], seed, args.steps)
                jobs.append(X.Job(group, scenario, seed, out, tuple(cmd)))

    def summarise(job: X.Job, run: X.Outcome) -> dict[str, Any]:
        row: dict[str, Any] = {"command": " ".join(job.cmd[1:]), "returncode": run.returncode, "wall_s": run.wall_s}
        row["died"] = run.status != "ok"
        if not row["died"]:
            row["accuracy"] = run.eval["rewards"]["exact_match"]
            row["numeric_match"] = run.eval["rewards"]["numeric_match"]
            row.update(analyse(job.out, run.history, job.variant, args.window, steps_per_rollout=2))  # 2 epochs
        return row

    def report(job: X.Job, row: dict[str, Any]) -> None:
        print(
            f"[bench_grade] {job.scenario} {job.variant} s{job.seed}: acc {row.get('accuracy')} cv "
            f"{row.get('grad_norm_cv_window')} tail {row.get('tail_share_raw')} {row['wall_s']:.0f} s",
            flush=True,
        )

    done = X.run_jobs(jobs, summarise, timeout=args.timeout, workers=args.workers, log_name="bench.log", after=report)
    done = {(scenario, group, seed): row for (group, scenario, seed), row in done.items()}
    cells = []
    for scenario in args.scenarios.split(","):
        for group in args.groups.split(","):
            rows = [done[(scenario, group, seed)] for seed in seeds]
            names = sorted({k for r in rows for k in r} - {"accuracy", "died", "command", "returncode"})
            note = f"{GROUPS[group][0]}; python {rows[0]['command']}"
            cells.append(X.cell(scenario, group, seeds, rows, names, died=lambda r: r["died"], note=note))
    results = X.results_doc(
        "grade_ppo", cells, command=X.script_command("bench_grade.py").strip(), sha=code_commit,
        model="tiny-llama-0.9m (runs/demo-sft/final) + its reward model", steps=args.steps, window=args.window,
        artefacts={"rate": SCENARIOS["rm-artefacts"], "magnitude": [5.0, 20.0], "unit": "reward-model std"},
    )  # fmt: skip
    path = REPO / args.results
    X.write_results(path, results, indent=2)
    plot(cells, REPO / args.plot)
    print(table(cells))
    print(f"wrote {path} and {args.plot}")


if __name__ == "__main__":
    main()
