"""Fault-injection stability benchmark: each defence layer alone and all together, against plain TRL.

Every run trains GRPO from one SFT checkpoint on the arithmetic task (``configs/tiny/grpo.yaml``) as its own
``python -m steadyrl train`` process, with one fault from ``steadyrl.faults`` (reward-side faults are reward
functions; trainer-side faults are callbacks configured through ``STEADYRL_FAULT_*`` environment variables):

    clean              no fault
    nan_loss           NaN hidden states in the loss pass of one micro-batch at step k (NanLossAtStep)
    inf_exp_avg_sq     inf written into one Adam exp_avg_sq entry at the end of step k (InfExpAvgSqAtStep)
    cauchy_reward      exact match + Cauchy noise of scale 1, every step (exact_match_cauchy)
    nonfinite_rewards  25% of rows None/NaN/+inf/-inf during steps k .. k+4 (exact_match_nonfinite_burst)
    grad_spike         every gradient x1e4 at step k, clipping off (GradSpikeAtStep, max_grad_norm=1e9)
    repetition_reward  the reward pays for one repeated character: forced entropy collapse (repetition_reward)

"Clipping off" is ``trainer.max_grad_norm=1e9`` for every variant in grad_spike: GEPO and OPEFO refuse
``max_grad_norm <= 0`` (the Trainer calls the step guard only when it clips), and clipping at 1e9 multiplies
every gradient below that norm by exactly 1.0, so it is numerically no clipping, for plain TRL too.

"plain TRL" is steadyrl with every guard off, which tests/integration/test_equivalence.py shows is bit-identical
to ``trl.GRPOTrainer``. Accuracy is greedy exact match on the held-out problems (noise-free, the weight-0
``exact_match`` reward), over the runs that completed with finite weights. A run "died" when its process failed
(the step is the last one logged in metrics.jsonl); one that exited 0 but saved non-finite weights is counted
apart ("NaN weights"). QUATRO is listed but skipped while ``guards.quatro.enabled=true`` does not validate.

    python scripts/bench_stability.py --sft runs/tiny-sft/final --out-md stability.md --png docs/img/stability.png
    python scripts/bench_stability.py --sft runs/tiny-sft/final --quick     # 4 runs, 2 faults, 1 seed, 6 steps
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402
from experiments import merge_results, paired_difference  # noqa: E402, F401  (the tests call them from here)

from steadyrl import metrics as M  # noqa: E402
from steadyrl.faults import FAULT_SCALE_ENV, FAULT_STEP_ENV, FAULT_VALUE_ENV, read_fault_log  # noqa: E402

OPEFO_SHORT_RUNS = ("guards.opefo.rollback.check_interval=2", "guards.opefo.rollback.snapshot_interval=10")
LAYERS = {
    "GRADE": ("guards.grade.enabled=true",),
    "GEPO": ("guards.gepo.enabled=true",),
    "OPEFO": ("guards.opefo.enabled=true", *OPEFO_SHORT_RUNS),
    "QUATRO": ("guards.quatro.enabled=true",),
}
VARIANT_NAMES = ("plain TRL", "GRADE", "GEPO", "OPEFO", "QUATRO", "all on")
# Ablations (issue 13): all on minus one layer or one part (OPEFO's error feedback, QUATRO's), and the layers added
# in the order of the design notes (seed 000 §5.2: bare GRPO, then GEPO + OPEFO, then QUATRO's filters, the KL
# anchor, the entropy floor last).
PARTS_OFF = {  # a layer's part turned off within "all on"
    "feedback": "guards.opefo.error_feedback.enabled=false",
    "kl": "guards.quatro.kl.enabled=false",
    "entropy": "guards.quatro.entropy.enabled=false",
    "filters": "guards.quatro.filters.enabled=false",
}
ABLATIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # name -> (layers on, parts off)
    "all - GRADE": (("GEPO", "OPEFO", "QUATRO"), ()),
    "all - GEPO": (("GRADE", "OPEFO", "QUATRO"), ()),
    "all - OPEFO": (("GRADE", "GEPO", "QUATRO"), ()),
    "all - QUATRO": (("GRADE", "GEPO", "OPEFO"), ()),
    "all - OPEFO feedback": (("GRADE", "GEPO", "OPEFO", "QUATRO"), ("feedback",)),
    "all - QUATRO kl": (("GRADE", "GEPO", "OPEFO", "QUATRO"), ("kl",)),
    "all - QUATRO entropy": (("GRADE", "GEPO", "OPEFO", "QUATRO"), ("entropy",)),
    "all - QUATRO filters": (("GRADE", "GEPO", "OPEFO", "QUATRO"), ("filters",)),
    "GEPO+OPEFO": (("GEPO", "OPEFO"), ()),
    "GEPO+OPEFO+filters": (("GEPO", "OPEFO", "QUATRO"), ("kl", "entropy")),
    "GEPO+OPEFO+filters+kl": (("GEPO", "OPEFO", "QUATRO"), ("entropy",)),
}
ALL_NAMES = (*VARIANT_NAMES, *ABLATIONS)
# RESULTS.md variant names
RESULT_NAMES = {"plain TRL": "plain", "all on": "all"}
QUICK_VARIANTS = ("plain TRL", "GEPO", "all on")
QUICK_SCENARIOS = ("nan_loss", "inf_exp_avg_sq")
QUICK_LEFT_OUT = {("plain TRL", "inf_exp_avg_sq"), ("GEPO", "inf_exp_avg_sq")}  # --quick: the inf moment, all on only
# Every variant runs with a KL term (as the per-size configs do): QUATRO's KL controller needs one, and the
# comparison stays fair only if plain TRL pays for the same reference model.
BETA = "trainer.beta=0.04"
CLEAN_REWARD = "{fn: exact_match, weight: 1.0}"
EVAL_REWARD = "{fn: exact_match, weight: 0.0}"  # logged only: the noise-free accuracy of a faulty-reward run
BURST_STEPS = 5  # nonfinite_rewards: steps k .. k + 4


@dataclass(frozen=True)
class Scenario:
    """One fault. ``reward``: a rewards entry (YAML flow text; ``{seed}``, ``{step}``, ``{burst}`` filled per run)
    that replaces the exact-match reward; ``callback``: a ``steadyrl.faults`` callback class."""

    reward: str | None = None
    callback: str | None = None
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


SCENARIOS = {
    "clean": Scenario(),
    "nan_loss": Scenario(callback="NanLossAtStep"),
    "inf_exp_avg_sq": Scenario(callback="InfExpAvgSqAtStep", env=((FAULT_VALUE_ENV, "inf"),)),
    "cauchy_reward": Scenario(
        reward="{{name: noisy, fn: 'steadyrl.faults:exact_match_cauchy', kwargs: {{scale: 1.0, seed: {seed}}}}}"
    ),
    "nonfinite_rewards": Scenario(
        reward="{{name: bursty, fn: 'steadyrl.faults:exact_match_nonfinite_burst', "
        "kwargs: {{fraction: 0.25, start: {step}, steps: {burst}, seed: {seed}}}}}"
    ),
    "grad_spike": Scenario(
        callback="GradSpikeAtStep", overrides=("trainer.max_grad_norm=1e9",), env=((FAULT_SCALE_ENV, "1e4"),)
    ),
    "repetition_reward": Scenario(reward="{{name: repetition, fn: 'steadyrl.faults:repetition_reward'}}"),
}
STEP_FAULTS = ("nan_loss", "inf_exp_avg_sq", "nonfinite_rewards", "grad_spike")  # the faults at step k


def quatro_validates(sft: str) -> bool:
    """Whether this steadyrl accepts ``guards.quatro.enabled=true`` (``steadyrl validate`` exits 0)."""
    cmd = [sys.executable, "-m", "steadyrl", "validate", str(REPO / "configs/tiny/grpo.yaml"), f"model.path={sft}"]
    proc = subprocess.run([*cmd, BETA, "guards.quatro.enabled=true"], env=X.run_env(), capture_output=True, text=True)
    return proc.returncode == 0


def variants(quatro: bool) -> dict[str, tuple[str, ...] | None]:
    """name -> overrides; None marks a layer that cannot run in this steadyrl version."""
    out: dict[str, tuple[str, ...] | None] = {"plain TRL": ()}
    out.update({name: flags if name != "QUATRO" or quatro else None for name, flags in LAYERS.items()})
    out["all on"] = tuple(f for name, flags in LAYERS.items() if name != "QUATRO" or quatro for f in flags)
    for name, (layers, parts_off) in ABLATIONS.items():
        if "QUATRO" in layers and not quatro:
            out[name] = None
            continue
        out[name] = (*(f for layer in layers for f in LAYERS[layer]), *(PARTS_OFF[p] for p in parts_off))
    return out


def result_name(name: str) -> str:
    """The RESULTS.md spelling of a variant: plain, all, gepo, all-minus-quatro-kl, gepo+opefo+filters, ..."""
    return RESULT_NAMES.get(name, name.lower().replace("all - ", "all-minus-").replace(" ", "-"))


CELL_METRICS = ("skipped", "rollbacks", "repairs", "filtered", "entropy", "grad_norm_cv", "wall_s", "last_step")
SATURATION_METRICS = (  # the last logged value of each counter (cumulative), per seed
    M.QUATRO_KL_AT_MAX,
    M.QUATRO_KL_AT_MIN,
    M.QUATRO_KL_COEF,
    M.QUATRO_KL_TARGET,
    M.QUATRO_ENTROPY_BONUS,
    M.GEPO_SPIKE_REBASES,
    M.GEPO_ZERO_GRAD_STEPS,
)


def results_json(
    results: dict[tuple[str, str, int], dict[str, Any]],
    names: list[str],
    scenarios: list[str],
    seeds: list[int],
    command: str,
    steps: int,
    sha: str,
    fault_step: int | None = None,
) -> dict[str, Any]:
    """The run in the format of the shared RESULTS.md: one cell per (scenario, variant), per-seed lists; with
    ``fault_step`` a step fault's cell is named ``<fault>-<step>`` (runs at several steps merged into one file)."""
    cells = []
    for scenario in scenarios:
        for name in names:
            present = [seed for seed in seeds if (name, scenario, seed) in results]  # the seeds this cell ran
            if not present:
                continue
            runs = [results[(name, scenario, seed)] for seed in present]
            note = None
            if any(r["status"] == "not_run" for r in runs):
                note = "not run: the variant does not validate in this steadyrl version"
            named = f"{scenario}-{fault_step}" if fault_step is not None and scenario in STEP_FAULTS else scenario
            cell = X.cell(named, result_name(name), present, runs, CELL_METRICS, note=note)
            cell["accuracy"] = [r.get("accuracy") for r in runs]
            metrics = cell["metrics"]
            metrics["nonfinite_weights"] = [r["status"] == "nonfinite_weights" for r in runs]
            metrics["inf_left_in_adam"] = [bool(r.get("nonfinite_state_at_end")) for r in runs]
            for key in SATURATION_METRICS:
                metrics[key] = [(r.get("last") or {}).get(key) for r in runs]
            cells.append(cell)
    model = "tiny-llama-0.9m (SFT checkpoint of configs/tiny/sft.yaml)"
    return X.results_doc("stability", cells, command=command, sha=sha, model=model, steps=steps)


def train_command(
    sft: str, out: Path, flags: tuple[str, ...], scenario: str, seed: int, steps: int, fault_step: int, quick: bool
) -> tuple[list[str], dict[str, str]]:
    """The ``steadyrl train`` command line and the extra environment of one run."""
    sc = SCENARIOS[scenario]
    rewards = CLEAN_REWARD
    if sc.reward is not None:
        rewards = sc.reward.format(seed=seed, step=fault_step, burst=BURST_STEPS) + ", " + EVAL_REWARD
    cmd = X.train_command(
        REPO / "configs/tiny/grpo.yaml", f"model.path={sft}",
        f"trainer.output_dir={out}", f"trainer.max_steps={steps}", f"trainer.seed={seed}", "trainer.logging_steps=1",
        'trainer.save_strategy="no"', "trainer.resume_from_checkpoint=null", f"rewards=[{rewards}]", BETA,
        "eval.metric=exact_match", *sc.overrides, *flags,
    )  # fmt: skip
    if sc.callback is not None:
        cmd.append(f"callbacks=['steadyrl.faults:{sc.callback}']")
    if quick:
        cmd += ["trainer.per_device_train_batch_size=16", "eval.max_samples=50"]
    return cmd, {FAULT_STEP_ENV: str(fault_step), **dict(sc.env)}


def weights_finite(path: Path) -> bool:
    """Every tensor of a saved ``model.safetensors`` is finite."""
    import torch
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(str(path)).values() if t.is_floating_point())


def summarise_run(job: X.Job, run: X.Outcome) -> dict[str, Any]:
    """One run's outcome from its folder: status, step of death, accuracy, entropy, guard counters, fault log."""
    run_dir, history = job.out, run.history
    final = run_dir / "final" / "model.safetensors"
    finite = weights_finite(final) if run.returncode == 0 and final.is_file() else None
    status = "died" if finite is None else "ok" if finite else "nonfinite_weights"
    faults = read_fault_log(run_dir)
    end = [row for row in faults if row["fault"] == "train_end"]
    out: dict[str, Any] = {
        "status": status,
        "returncode": run.returncode,
        "last_step": run.last_step,
        "accuracy": run.eval["accuracy"] if status == "ok" and run.eval else None,
        "entropy": None,
        "grad_norm_cv": None,
        "skipped": history.count("gepo/skipped_steps", "skip") if history else 0,
        "rollbacks": history.count("opefo/rollbacks", "rollback") if history else 0,
        "repairs": history.count("opefo/repairs", "state_repair") if history else 0,
        "filtered": None,
        "fault_fired_at": next((row["step"] for row in faults if row["fault"] != "train_end"), None),
        "nonfinite_state_at_end": end[-1]["nonfinite_state_entries"] if end else None,
        "wall_s": run.wall_s,
    }
    if history is None:
        return out
    _, entropy = history.series("entropy")
    finite_entropy = [v for v in entropy.tolist() if math.isfinite(v)]
    out["entropy"] = finite_entropy[-1] if finite_entropy else None
    _, norms = history.series("grad_norm")
    norms = [v for v in norms.tolist() if math.isfinite(v)]
    if len(norms) > 1 and statistics.fmean(norms) > 0:
        out["grad_norm_cv"] = statistics.pstdev(norms) / statistics.fmean(norms)
    last = {}
    for key in SATURATION_METRICS:
        if history.has(key):
            values = [v for v in history.series(key)[1].tolist() if math.isfinite(v)]
            last[key] = values[-1] if values else None
    out["last"] = last
    filtered = history.matching("quatro/filtered/")  # per-step counts per reason (logging_steps=1)
    if filtered:
        out["filtered"] = sum(v for name in filtered for v in history.series(name)[1].tolist() if math.isfinite(v))
    return out


# ------------------------------------------------------------------------------------------------ output


def _outcome(runs: list[dict[str, Any]]) -> str:
    n, parts = len(runs), []
    ok = [r for r in runs if r["status"] == "ok"]
    died = [r for r in runs if r["status"] == "died"]
    nan = [r for r in runs if r["status"] == "nonfinite_weights"]
    if ok:
        parts.append(f"ok {len(ok)}/{n}")
    if died:
        parts.append(f"died {len(died)}/{n} @ step {','.join(str(r['last_step']) for r in died)}")
    if nan:
        parts.append(f"NaN weights {len(nan)}/{n}")
    stuck = [r for r in ok if r["nonfinite_state_at_end"]]
    if stuck:
        parts.append(f"inf left in Adam state {len(stuck)}/{n}")
    return ", ".join(parts)


def table(results: dict[tuple[str, str, int], dict[str, Any]], names: list[str], scenarios: list[str]) -> str:
    """Markdown: one row per scenario x variant, seeds aggregated."""
    lines = [
        "| scenario | variant | outcome | final accuracy (mean ± seed std) | final entropy | grad-norm CV | "
        "skipped steps | rollbacks | in-place repairs | filtered rows | fault fired | wall s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario in scenarios:
        for name in names:
            runs = [r for (v, s, _), r in sorted(results.items()) if v == name and s == scenario]
            if not runs:
                continue
            if runs[0]["status"] == "not_run":
                lines.append(f"| {scenario} | {name} | not implemented yet (does not validate) |" + " - |" * 9)
                continue
            ok = [r for r in runs if r["status"] == "ok"]
            cvs = [r["grad_norm_cv"] for r in runs if r["grad_norm_cv"] is not None]
            filtered = [r["filtered"] for r in runs if r["filtered"] is not None]
            fired = "-"
            if SCENARIOS[scenario].callback is not None:
                fired = f"{sum(r['fault_fired_at'] is not None for r in runs)}/{len(runs)}"
            lines.append(
                f"| {scenario} | {name} | {_outcome(runs)} | {X.mean_std([r['accuracy'] for r in ok])} | "
                f"{X.mean_std([r['entropy'] for r in ok if r['entropy'] is not None], 2)} | "
                f"{f'{statistics.fmean(cvs):.2f}' if cvs else '-'} | "
                f"{statistics.fmean(r['skipped'] for r in runs):.1f} | "
                f"{statistics.fmean(r['rollbacks'] for r in runs):.1f} | "
                f"{statistics.fmean(r.get('repairs', 0) for r in runs):.1f} | "
                f"{f'{statistics.fmean(filtered):.0f}' if filtered else 'n/a'} | {fired} | "
                f"{statistics.fmean(r['wall_s'] for r in runs):.0f} |"
            )
    return "\n".join(lines)


def saturation_table(
    results: dict[tuple[str, str, int], dict[str, Any]], names: list[str], scenarios: list[str]
) -> str:
    """Markdown: the controllers' end-of-run state per scenario x variant (seed means), for the variants with QUATRO
    or GEPO's spike guard. A controller held at a bound shows as kl_at_max close to the steps run."""
    lines = [
        "| scenario | variant | KL updates at max | KL updates at min | final beta | KL target | entropy bonus | "
        "spike re-anchors | zero-grad steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def mean(runs: list[dict[str, Any]], key: str, fmt: str) -> str:
        values = [r["last"][key] for r in runs if r.get("last") and r["last"].get(key) is not None]
        return format(statistics.fmean(values), fmt) if values else "-"

    for scenario in scenarios:
        for name in names:
            runs = [r for (v, s, _), r in sorted(results.items()) if v == name and s == scenario and r.get("last")]
            if not runs or not any(r["last"] for r in runs):
                continue
            cells = [
                mean(runs, M.QUATRO_KL_AT_MAX, ".1f"),
                mean(runs, M.QUATRO_KL_AT_MIN, ".1f"),
                mean(runs, M.QUATRO_KL_COEF, ".3g"),
                mean(runs, M.QUATRO_KL_TARGET, ".3g"),
                mean(runs, M.QUATRO_ENTROPY_BONUS, ".3g"),
                mean(runs, M.GEPO_SPIKE_REBASES, ".1f"),
                mean(runs, M.GEPO_ZERO_GRAD_STEPS, ".1f"),
            ]
            lines.append(f"| {scenario} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


SINGLE_LAYERS = ("GRADE", "GEPO", "OPEFO", "QUATRO")
BAR_CLEAN, BAR_FAULT = -0.01, -0.02  # issue 13: clean all >= plain - 1 point; a fault: within 2 of the best single


def bars_table(results: dict[tuple[str, str, int], dict[str, Any]], scenarios: list[str]) -> str:
    """Markdown: issue 13's bar per scenario, every layer on against its reference, paired by seed.

    Reference: plain TRL on the clean task (bar: -1 point), the single layer with the best mean accuracy under a
    fault (bar: -2 points, and no run of every layer on may die). "within noise" when the bar lies inside two
    standard errors of the paired difference: more seeds would be needed to call it."""

    def accuracies(name: str, scenario: str) -> dict[int, float]:
        return {
            seed: r["accuracy"]
            for (v, sc, seed), r in results.items()
            if v == name and sc == scenario and r["status"] == "ok" and r.get("accuracy") is not None
        }

    def failed(name: str, scenario: str) -> int:
        return sum(v == name and sc == scenario and r["status"] in ("died", "nonfinite_weights")
                   for (v, sc, _), r in results.items())  # fmt: skip

    lines = [
        "| scenario | reference | every layer on − reference (paired, mean ± s.e., seeds) | bar | verdict |",
        "|---|---|---|---|---|",
    ]
    for scenario in scenarios:
        mine = accuracies("all on", scenario)
        if not mine:
            continue
        if scenario == "clean":
            ref, bar = "plain TRL", BAR_CLEAN
        else:
            singles = {n: accuracies(n, scenario) for n in SINGLE_LAYERS}
            singles = {n: acc for n, acc in singles.items() if acc}
            if not singles:
                continue
            ref, bar = max(singles, key=lambda n: statistics.fmean(singles[n].values())), BAR_FAULT
        diff = paired_difference(mine, accuracies(ref, scenario))
        if diff is None:
            continue
        mean, se, n = diff
        died = failed("all on", scenario)
        verdict = "met" if mean >= bar and not died else "missed"
        if died:
            verdict += f" ({died} run(s) of every layer on died)"
        elif abs(mean - bar) <= 2 * se:
            verdict += ", within noise"
        lines.append(
            f"| {scenario} | {ref} | {100 * mean:+.1f} ± {100 * se:.1f} points ({n}) | {100 * bar:+.0f} | {verdict} |"
        )
    return "\n".join(lines)


def plot(
    results: dict[tuple[str, str, int], dict[str, Any]], names: list[str], scenarios: list[str], png: Path
) -> None:
    """Grouped bars: final accuracy per scenario (groups) and variant (bars), seed std as error bars; ✗n marks
    n runs that died or ended with NaN weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in names if any(v == n and r["status"] != "not_run" for (v, _, _), r in results.items())]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(scenarios)), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        for j, scenario in enumerate(scenarios):
            runs = [r for (v, s, _), r in results.items() if v == name and s == scenario]
            acc = [r["accuracy"] for r in runs if r["status"] == "ok" and r["accuracy"] is not None]
            x = j - 0.4 + width * (i + 0.5)
            mean = statistics.fmean(acc) if acc else 0.0
            std = statistics.pstdev(acc) if len(acc) > 1 else 0.0
            ax.bar(x, mean, width, yerr=std, capsize=2, color=f"C{i}", label=name if j == 0 else None)
            failed = len(runs) - len(acc)
            if failed:
                ax.text(x, mean + std + 0.01, f"✗{failed}", ha="center", va="bottom", fontsize=7, color="red")
    ax.set_xticks(range(len(scenarios)), scenarios, rotation=20, ha="right")
    ax.set_ylabel("final greedy exact-match accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title("GRPO under injected faults: accuracy (mean ± seed std; ✗n: n runs died or ended NaN)")
    ax.legend(fontsize=8, ncols=min(len(names), 6), loc="upper center", bbox_to_anchor=(0.5, -0.25))
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def results_from_cells(doc: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """A results JSON's cells back as ``plot``'s per-run records (variant display name, scenario, seed): the chart
    of a file whose cells were merged from several invocations, whose run folders need not all exist."""
    display = {result_name(name): name for name in ALL_NAMES}
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    for cell in doc["cells"]:
        name = display.get(cell["variant"], cell["variant"])
        nonfinite = cell.get("metrics", {}).get("nonfinite_weights") or [False] * len(cell["seeds"])
        for seed, died, acc, bad in zip(cell["seeds"], cell["died"], cell["accuracy"], nonfinite, strict=True):
            status = "died" if died else "nonfinite_weights" if bad else "ok"
            out[(name, cell["scenario"], seed)] = {"status": status, "accuracy": acc}
    return out


def pooled_cells(files: list[str]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """``results_from_cells`` of several results JSONs, pooled: their runs must not overlap (same variant,
    scenario and seed in two files is refused, naming both)."""
    pooled: dict[tuple[str, str, int], dict[str, Any]] = {}
    origin: dict[tuple[str, str, int], str] = {}
    for file in files:
        for key, run in results_from_cells(json.loads(Path(file).read_text())).items():
            if key in pooled:
                raise SystemExit(f"--bars-results: {key[0]} / {key[1]} / seed {key[2]} is in {origin[key]} and {file}")
            pooled[key], origin[key] = run, file
    return pooled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", default=None, help="SFT checkpoint shared by every run (e.g. runs/tiny-sft/final)")
    ap.add_argument("--out", default="runs/bench-stability", help="one folder per run, and results.json")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--first-seed", type=int, default=0, help="seeds FIRST .. FIRST+SEEDS-1 (add seeds to an --out folder)"
    )
    ap.add_argument("--fault-step", type=int, default=20, help="step k of the step faults (after GEPO's warm-up)")
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(ALL_NAMES)}")
    ap.add_argument("--scenarios", default=None, help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    ap.add_argument("--workers", "--jobs", type=int, default=2, help="runs at a time")
    ap.add_argument(
        "--set",
        dest="extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override appended to every run (repeatable; e.g. guards.quatro.kl.calibration_steps=10)",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds before a run is killed (counted as died)")
    ap.add_argument("--quick", action="store_true", help="nan_loss x 3 variants, inf all on, 1 seed, 6 steps")
    ap.add_argument("--out-md", default=None, help="write the markdown (command + table) here; always printed")
    ap.add_argument("--png", default=None, help="write the accuracy bar chart here (e.g. docs/img/stability.png)")
    ap.add_argument("--results", default=None, help="write the RESULTS.md-format JSON here (docs/results/...)")
    ap.add_argument(
        "--commit", default=None, help="with --collect-only: the commit the runs were made with (default: HEAD)"
    )
    ap.add_argument(
        "--collect-only", action="store_true", help="train nothing: rebuild the table from the run folders in --out"
    )
    ap.add_argument(
        "--plot-results",
        default=None,
        metavar="FILE",
        help="train nothing: draw --png from this results JSON's cells (e.g. a file merged with --merge)",
    )
    ap.add_argument(
        "--bars-results",
        default=None,
        nargs="+",
        metavar="FILE",
        help="train nothing: print issue 13's bars (paired by seed) from these results JSONs' cells; several files "
        "pool their seeds (e.g. seeds 0-2 from one invocation, 3-8 from another; a run in two files is an error)",
    )
    ap.add_argument(
        "--name-by-step",
        action="store_true",
        help="with --results: name the step faults' cells <fault>-<k> (to merge runs at several fault steps)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="with --results: replace only this run's (scenario, variant) cells in the existing file, each marked "
        "with its own command and commit; the other cells stay as they were",
    )
    args = ap.parse_args()
    names = list(QUICK_VARIANTS if args.quick else VARIANT_NAMES)
    scenarios = list(QUICK_SCENARIOS if args.quick else SCENARIOS)
    seeds, steps, fault_step = range(args.first_seed, args.first_seed + args.seeds), args.steps, args.fault_step
    if args.quick:
        seeds, steps, fault_step = range(1), 6, 3
    names = [n.strip() for n in args.variants.split(",")] if args.variants else names
    scenarios = [s.strip() for s in args.scenarios.split(",")] if args.scenarios else scenarios
    for bad, valid in ((set(names) - set(ALL_NAMES), ALL_NAMES), (set(scenarios) - set(SCENARIOS), SCENARIOS)):
        if bad:
            ap.error(f"unknown {sorted(bad)}; valid: {', '.join(valid)}")
    if args.bars_results:
        print(bars_table(pooled_cells(args.bars_results), scenarios))
        return
    if args.plot_results:
        if not args.png:
            ap.error("--plot-results needs --png")
        cells = results_from_cells(json.loads(Path(args.plot_results).read_text()))
        present = [n for n in names if any(v == n for v, _, _ in cells)]
        plot(cells, present, [s for s in scenarios if any(c == s for _, c, _ in cells)], Path(args.png))
        return
    if not args.sft:
        ap.error("--sft is required (except with --plot-results)")
    flags_of = variants(quatro_validates(args.sft))
    root = Path(args.out)
    jobs = [(name, scenario, seed) for name in names for scenario in scenarios for seed in seeds]
    jobs = [job for job in jobs if not (args.quick and job[:2] in QUICK_LEFT_OUT)]
    results: dict[tuple[str, str, int], dict[str, Any]] = {
        job: {"status": "not_run"} for job in jobs if flags_of[job[0]] is None
    }

    def job(name: str, scenario: str, seed: int) -> X.Job:
        out = root / f"{name.replace(' ', '_').lower()}-{scenario}-s{seed}"
        flags = (*(flags_of[name] or ()), *args.extra)
        cmd, env = train_command(args.sft, out, flags, scenario, seed, steps, fault_step, args.quick)
        return X.Job(name, scenario, seed, out, tuple(cmd), tuple(env.items()))

    sha = args.commit or X.commit()  # the code being measured: taken before any run starts
    start = time.time()
    # --collect-only: several invocations may share --out, a combination never run is left out
    todo = [job(*key) for key in jobs if key not in results]
    results.update(X.run_jobs(todo, summarise_run, timeout=args.timeout, workers=args.workers,
                              collect_only=args.collect_only))  # fmt: skip
    command = X.script_command("bench_stability.py")
    markdown = (
        f"```\n{command}   # {sum(r['status'] != 'not_run' for r in results.values())} runs, "
        f"{time.time() - start:.0f} s with {args.workers} workers\n```\n\n"
        f"{steps} steps per run, {16 if args.quick else 64} completions per step, step faults at step k = "
        f"{fault_step} (reward burst: steps k .. k + {BURST_STEPS - 1}), seeds {', '.join(map(str, seeds))}; OPEFO "
        f"with {' '.join(OPEFO_SHORT_RUNS)}. QUATRO: "
        f"{'on' if flags_of['QUATRO'] is not None else 'not implemented yet, left out of all on'}.\n\n"
        + table(results, names, scenarios)
        + "\n\nController state at the end of each run (seed means; `-`: the variant has no such controller):\n\n"
        + saturation_table(results, names, scenarios)
        + "\n\nIssue 13's bars, paired by seed:\n\n"
        + bars_table(results, scenarios)
        + "\n"
    )
    print(markdown, end="")
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.json").write_text(json.dumps({"|".join(map(str, k)): v for k, v in results.items()}, indent=1))
    if args.out_md:
        Path(args.out_md).write_text(markdown)
    if args.png:
        plot(results, names, scenarios, Path(args.png))
    if args.results:
        named = fault_step if args.name_by_step else None
        doc = results_json(results, names, scenarios, list(seeds), command, steps, sha, named)
        X.write_results(args.results, doc, merge=args.merge)


if __name__ == "__main__":
    main()
