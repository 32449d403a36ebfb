"""QUATRO entropy-floor benchmark: a forced entropy collapse, plain TRL against QUATRO; and the demo with QUATRO on.

Collapse (default mode). GRPO from one SFT checkpoint on the arithmetic prompts (``configs/tiny/grpo.yaml``), but
the only trained reward is ``steadyrl.faults:repetition_reward``: the share of the completion taken by its most
common character ("111" earns 1.0). The learning rate is raised until plain TRL's entropy collapses within the run
(1e-3: lr 1e-4 does not collapse in 150 steps, 3e-3 collapses inside the 10-step baseline). Each run is its own
``python -m steadyrl train`` process, one at a time; every variant starts from trainer.beta=0.04:

    plain TRL                     every guard off (a fixed KL penalty, beta 0.04)
    QUATRO                        guards.quatro.enabled=true, defaults: adaptive KL (target auto), entropy floor
                                  (floor_ratio x mean of the first 10 steps, 10-step window, one PI control driving the
                                  covariance clip and a bonus up to 0.01, clip x 0.5, learning gate), filters
                                  (repetition: > 50 % repeated 3-grams; zero-variance groups; ...); no replay
    + short-answer repetition     the repetition filter on unigrams, > 30 % repeats (answers here are 1-3 characters)
    ablations                     one QUATRO part alone (KL controller / entropy floor / filters), the floor with a
                                  5x larger bonus cap (coef_max 0.05), and plain TRL at a fixed beta 1.0 (overriding
                                  0.04: the value the old fixed-target KL controller reached)

Entropy is measured by ``EntropyProbe`` (a callback the runs load from this file): TRL's logged ``entropy`` covers
the rows QUATRO's filters keep only, so it cannot compare the variants. Per run: the floor band is ``floor_ratio``
(the controller's default, 0.15) x the mean probe entropy of steps 1-10 (the controller's rule, recomputed for every
run, plain ones too); "collapse step" is
the first later step below the band, "below for good" the first step from which every later one is; "end" values
are means over the last 10 steps; repetition drops sum the per-step ``quatro/filtered/repetition`` counts. The
same numbers from TRL's ``entropy``, QUATRO's controller metrics and the greedy exact-match accuracy (weight-0
reward, logged only) go in a diagnostics table.

Demo (``--demo``). ``configs/tiny/grpo.yaml`` as it is (exact-match reward, lr 1e-4, 200 steps) with trainer.beta
0.04, without and with QUATRO, per seed, against the SFT checkpoint's ``eval_results.json`` (the folder above
``--sft``).

    python scripts/bench_entropy_floor.py --sft runs/demo-sft/final --lr 1e-3 --steps 200 --out-md collapse.md \\
        --png docs/img/entropy_floor.png
    python scripts/bench_entropy_floor.py --sft runs/demo-sft/final --demo --out-md demo.md
    python scripts/bench_entropy_floor.py --sft runs/demo-sft/final --quick     # 1 seed, 12 steps per variant
    ... --reuse        # tables and plot again from the finished runs in --out, training only what is missing
    ... --set guards.quatro.entropy.pg_brake=0 --set guards.quatro.entropy.coef_max=0.5
                       # overrides for every QUATRO variant (repeatable): the bonus alone, at a larger cap
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402
from experiments import mean_std  # noqa: E402

from steadyrl.callbacks.periodic_eval import preserved_rng  # noqa: E402
from steadyrl.faults import repetition_reward  # noqa: E402
from steadyrl.guards.entropy_floor import EntropyConfig  # noqa: E402
from steadyrl.tasks.arithmetic import arithmetic_splits  # noqa: E402

BETA = 0.04  # both variants: QUATRO's KL controller needs beta > 0, and plain TRL gets the same KL penalty
QUATRO = "guards.quatro.enabled=true"
KL_OFF, FLOOR_OFF, FILTERS_OFF = (f"guards.quatro.{part}.enabled=false" for part in ("kl", "entropy", "filters"))
# The answers are 1-3 digits + EOS, too short for the default repetition filter (> 50 % repeated 3-grams: "111"
# + EOS has two distinct 3-grams); on unigrams with > 30 % repeats it drops "11", "111", "000", keeps "100", "054".
SHORT_REPETITION = ("guards.quatro.filters.repetition.n=1", "guards.quatro.filters.repetition.max_repeat_share=0.3")
# The default bonus cap is entropy_coef 0.01; this one is 5x higher (does the cap bind?).
SMALL_CAP = ("guards.quatro.entropy.coef_max=0.05",)
# The learning gate reads the weight-0 exact match (the verifier) instead of the repetition reward it trains on,
# which rises with the collapse (steadyrl/guards/entropy_floor.py, "Which reward the gate reads").
VERIFIER_GATE = ("guards.quatro.entropy.gate_reward=exact_match",)
VARIANTS = {  # name -> (folder slug, colour, overrides)
    "plain TRL": ("plain", "C3", ()),
    "QUATRO": ("quatro", "C0", (QUATRO,)),
    "QUATRO + short-answer repetition filter": ("quatro-rep1", "C2", (QUATRO, *SHORT_REPETITION)),
    "QUATRO KL controller only": ("kl-only", "C1", (QUATRO, FLOOR_OFF, FILTERS_OFF)),
    "plain TRL, fixed β 1.0": ("plain-beta1", "C7", ("trainer.beta=1.0",)),  # where QUATRO's controller ends up
    "QUATRO entropy floor only": ("floor-only", "C4", (QUATRO, KL_OFF, FILTERS_OFF)),
    "QUATRO entropy floor only, bonus cap 0.05": ("floor-cap0.05", "C6", (QUATRO, KL_OFF, FILTERS_OFF, *SMALL_CAP)),
    "QUATRO filters only": ("filters-only", "C5", (QUATRO, KL_OFF, FLOOR_OFF)),
    "QUATRO entropy floor only (gate on exact match)": (
        "floor-verifier",
        "C8",
        (QUATRO, KL_OFF, FILTERS_OFF, *VERIFIER_GATE),
    ),
    "QUATRO entropy floor only (gate on exact match) + brake": (  # the policy-gradient brake at 1
        "floor-verifier-brake",
        "C9",
        (QUATRO, KL_OFF, FILTERS_OFF, *VERIFIER_GATE, "guards.quatro.entropy.pg_brake=1.0"),
    ),
}
MAIN_VARIANTS = ("plain TRL", "QUATRO", "QUATRO + short-answer repetition filter")
DEMO_VARIANTS = ("plain TRL", "QUATRO")
BASELINE_STEPS = EntropyConfig().baseline_steps  # the controller's own defaults: the band follows them
FLOOR_RATIO = EntropyConfig().floor_ratio
END_STEPS = 10  # "at the end" = mean over the last END_STEPS logged steps
PROBE_FILE = "probe.jsonl"
PROBE_PROMPTS = 128  # the first held-out arithmetic prompts
PROBE_SEED = 1234  # the same sampling noise at every probe (common random numbers: a smooth curve)
PROBE_CALLBACK = "bench_entropy_floor:EntropyProbe"  # importable with scripts/ on PYTHONPATH
COLLAPSE_REWARDS = (
    "rewards=[{name: repetition, fn: 'steadyrl.faults:repetition_reward'}, {fn: exact_match, weight: 0.0}]"
)


class EntropyProbe(TrainerCallback):
    """The policy's token entropy on a fixed prompt set, after every optimizer step (and before the first).

    TRL's logged ``entropy`` is the mean over the training batch's completion tokens, and QUATRO's filters zero
    the completion mask of the rows they drop, so with QUATRO on it covers the kept rows only (and is 0 at a step
    whose rows were all dropped). Both variants are therefore measured here the same way: sample one completion
    (temperature 1, no top-k/top-p, like the rollouts) for each of the first ``PROBE_PROMPTS`` held-out prompts,
    with the torch seed fixed to ``PROBE_SEED`` inside ``preserved_rng`` (training's RNG stream is untouched), and
    average the entropy of the next-token distribution over the completion tokens up to and including EOS.
    Appends ``{"step", "entropy", "repetition_reward", "distinct"}`` to ``<output_dir>/probe.jsonl``.
    """

    def __init__(self, max_new_tokens: int = 6) -> None:
        _, evaluation = arithmetic_splits(zero_pad_fraction=0.8)
        self.prompts = [row["prompt"] for row in evaluation[:PROBE_PROMPTS]]
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def probe(self, model: torch.nn.Module, tokenizer: Any) -> dict[str, float]:
        was_training, old_side = model.training, tokenizer.padding_side
        model.eval()
        tokenizer.padding_side = "left"
        try:
            enc = tokenizer(self.prompts, return_tensors="pt", padding=True).to(next(model.parameters()).device)
            with preserved_rng():
                torch.manual_seed(PROBE_SEED)
                out = model.generate(
                    **enc, max_new_tokens=self.max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    output_logits=True, return_dict_in_generate=True,
                )  # fmt: skip
        finally:
            tokenizer.padding_side = old_side
            model.train(was_training)
        new = out.sequences[:, enc["input_ids"].shape[1] :]  # (P, T)
        logp = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # (P, T, V)
        entropy = -(logp.exp() * logp).sum(-1)  # (P, T)
        is_eos = new == tokenizer.eos_token_id
        valid = (is_eos.cumsum(1) - is_eos.long()) == 0  # up to and including the first EOS
        texts = tokenizer.batch_decode(new, skip_special_tokens=True)
        return {
            "entropy": float((entropy * valid).sum() / valid.sum()),
            "repetition_reward": statistics.fmean(repetition_reward(texts)),
            "distinct": len(set(texts)) / len(texts),
        }

    def _record(self, args: Any, step: int, model: Any, tokenizer: Any) -> None:
        row = {"step": step, **self.probe(model, tokenizer)}
        with open(Path(args.output_dir) / PROBE_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.is_world_process_zero:
            self._record(args, state.global_step, model, processing_class)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.is_world_process_zero:
            self._record(args, state.global_step, model, processing_class)


def load_probe(run_dir: Path) -> dict[str, np.ndarray]:
    """probe.jsonl as arrays by key (``step`` included), sorted by step; the last row of a step wins."""
    path = run_dir / PROBE_FILE
    rows = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows[row["step"]] = row
    keys = ("step", "entropy", "repetition_reward", "distinct")
    return {k: np.array([rows[s][k] for s in sorted(rows)], dtype=float) for k in keys}


def collapse_command(sft: str, out: Path, flags: tuple[str, ...], seed: int, steps: int, lr: float) -> list[str]:
    return X.train_command(
        REPO / "configs/tiny/grpo.yaml", f"model.path={sft}",
        f"trainer.output_dir={out}", f"trainer.max_steps={steps}", f"trainer.seed={seed}",
        f"trainer.learning_rate={lr}", f"trainer.beta={BETA}", "trainer.logging_steps=1", 'trainer.save_strategy="no"',
        "trainer.resume_from_checkpoint=null", COLLAPSE_REWARDS, "eval.metric=exact_match", "eval.every=0",
        f"callbacks=['{PROBE_CALLBACK}']", *flags,
    )  # fmt: skip


def demo_command(sft: str, out: Path, flags: tuple[str, ...], seed: int) -> list[str]:
    return X.train_command(
        REPO / "configs/tiny/grpo.yaml", f"model.path={sft}",
        f"trainer.output_dir={out}", f"trainer.beta={BETA}", f"trainer.seed={seed}", "trainer.logging_steps=1",
        'trainer.save_strategy="no"', "trainer.resume_from_checkpoint=null", *flags,
    )  # fmt: skip


def _shown(cmd: list[str]) -> str:
    """The command line as it reads from the repository root."""
    return "OMP_NUM_THREADS=1 " + shlex.join(["python", *cmd[1:]]).replace(f"{REPO}/", "")


def _finite_series(history: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    steps, values = history.series(name)
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def _tail_mean(values: np.ndarray) -> float | None:
    return float(values[-END_STEPS:].mean()) if len(values) else None


def _band_and_collapse(steps: np.ndarray, entropy: np.ndarray) -> dict[str, Any]:
    """One entropy series against its floor band.

    band = FLOOR_RATIO x the mean over steps 1 .. BASELINE_STEPS (step 0, the probe before training, excluded);
    first_below: the first step after those whose entropy is below the band (one noisy step is enough);
    stays_below: the first step from which every later step is below the band (None if the last one is not);
    below_share: the share of the steps after the baseline that are below the band.
    """
    base = entropy[(steps >= 1) & (steps <= BASELINE_STEPS)]
    if len(base) < BASELINE_STEPS:
        return {"band": None, "first_below": None, "stays_below": None, "below_share": None}
    band = FLOOR_RATIO * float(base.mean())
    after = steps > BASELINE_STEPS
    s, below = steps[after], entropy[after] < band
    above = np.flatnonzero(~below)
    stays = (
        None
        if not below.any() or (len(above) and above[-1] == len(s) - 1)
        else int(s[above[-1] + 1 if len(above) else 0])
    )
    return {
        "band": band,
        "first_below": int(s[below][0]) if below.any() else None,
        "stays_below": stays,
        "below_share": float(below.mean()) if len(s) else None,
    }


def summarise_collapse(job: X.Job, run: X.Outcome) -> dict[str, Any]:
    """One collapse run: probe and TRL entropy series, floor band, collapse step, end values, QUATRO counters."""
    out: dict[str, Any] = {"returncode": run.returncode, "wall_s": run.wall_s, "status": run.status}
    history = run.history
    if history is None:
        return {**out, "status": "died"}
    probe = load_probe(job.out)
    probe_floor = _band_and_collapse(probe["step"], probe["entropy"])
    train_steps, train_entropy = _finite_series(history, "entropy")
    train_floor = _band_and_collapse(train_steps, train_entropy)
    reward_steps, reward = _finite_series(history, "reward")
    floor_steps, floor = _finite_series(history, "quatro/entropy_floor")
    active_steps, active = _finite_series(history, "quatro/floor_active")
    _, bonus = _finite_series(history, "quatro/entropy_bonus")
    _, repetition = _finite_series(history, "quatro/filtered/repetition")
    _, share = _finite_series(history, "quatro/filtered_share")
    _, kl_coef = _finite_series(history, "quatro/kl_coef")
    _, kl = _finite_series(history, "kl")
    trained = probe["step"] >= 1
    return {
        **out,
        "last_step": history.last_step,
        "probe_steps": probe["step"].tolist(),
        "probe_entropy": probe["entropy"].tolist(),
        "probe_repetition": probe["repetition_reward"].tolist(),
        "train_steps": train_steps.tolist(),
        "train_entropy": train_entropy.tolist(),
        "reward_steps": reward_steps.tolist(),
        "reward": reward.tolist(),
        "floor_steps": floor_steps.tolist(),
        "floor": floor.tolist(),
        "active_steps": active_steps.tolist(),
        "active": active.tolist(),
        "band": probe_floor["band"],
        "collapse_step": probe_floor["first_below"],
        "stays_below": probe_floor["stays_below"],
        "below_share": probe_floor["below_share"],
        "entropy_end": _tail_mean(probe["entropy"][trained]),
        "train_band": train_floor["band"],
        "train_collapse_step": train_floor["first_below"],
        "train_stays_below": train_floor["stays_below"],
        "train_entropy_end": _tail_mean(train_entropy),
        "reward_end": _tail_mean(reward),
        "probe_repetition_end": _tail_mean(probe["repetition_reward"][trained]),
        "distinct_end": _tail_mean(probe["distinct"][trained]),
        "kl_end": _tail_mean(kl),
        "controller_floor": float(floor[-1]) if len(floor) else None,
        "floor_first_active": int(active_steps[active > 0][0]) if (active > 0).any() else None,
        "floor_active_steps": int(active.sum()) if len(active) else None,
        "bonus_max": float(bonus.max()) if len(bonus) else None,
        "repetition_drops": float(repetition.sum()) if len(repetition) else None,
        "filtered_share_mean": float(share.mean()) if len(share) else None,
        "kl_coef_end": float(kl_coef[-1]) if len(kl_coef) else None,
        "accuracy": run.eval["accuracy"] if run.eval else None,
    }


# ------------------------------------------------------------------------------------------------ output


def _collapse(runs: list[dict[str, Any]], key: str, steps: int, what: str = "fell") -> str:
    """Mean ± std of a step that may never happen, over the runs where it did, with their count."""
    fell = [r[key] for r in runs if r[key] is not None]
    if not fell:
        return f"never in {steps} (0/{len(runs)})"
    return f"{mean_std(fell, 1)} ({len(fell)}/{len(runs)} {what})"


def collapse_tables(results: dict[tuple[str, int], dict[str, Any]], steps: int) -> str:
    """Main table (probe entropy, reward, filter drops, accuracy) and a diagnostics table (TRL-logged entropy,
    QUATRO's controllers), one row per variant, seeds aggregated (mean ± seed std)."""
    main = [
        f"| variant | runs ok | floor band ({FLOOR_RATIO:g} × steps 1-{BASELINE_STEPS} mean) | "
        "collapse step (first below band) | "
        "below band for good from step | share of steps 11+ below band | entropy at end | reward at end | "
        "repetition-filter drops (total) | greedy accuracy at end | wall s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    diag = [
        "| variant | TRL `entropy`: band | TRL `entropy`: collapse step | TRL `entropy` at end | "
        "`quatro/entropy_floor` | floor first active (step) | floor active (steps) | max `quatro/entropy_bonus` | "
        "distinct probe completions at end | probe repetition reward at end | mean `quatro/filtered_share` | "
        "`quatro/kl_coef` at end | `kl` at end |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        runs = [r for (v, _), r in sorted(results.items()) if v == name]
        if not runs:
            continue
        ok = [r for r in runs if r["status"] == "ok"]
        no_floor = all(r["floor_active_steps"] is None for r in ok)  # the variant runs no entropy floor
        main.append(
            f"| {name} | {len(ok)}/{len(runs)} | {mean_std([r['band'] for r in ok])} | "
            f"{_collapse(ok, 'collapse_step', steps)} | {_collapse(ok, 'stays_below', steps)} | "
            f"{mean_std([r['below_share'] for r in ok], 2)} | "
            f"{mean_std([r['entropy_end'] for r in ok])} | {mean_std([r['reward_end'] for r in ok])} | "
            f"{mean_std([r['repetition_drops'] for r in ok], 0)} | {mean_std([r['accuracy'] for r in ok])} | "
            f"{statistics.fmean(r['wall_s'] for r in runs):.0f} |"
        )
        diag.append(
            f"| {name} | {mean_std([r['train_band'] for r in ok])} | {_collapse(ok, 'train_collapse_step', steps)} | "
            f"{mean_std([r['train_entropy_end'] for r in ok])} | {mean_std([r['controller_floor'] for r in ok])} | "
            f"{'-' if no_floor else _collapse(ok, 'floor_first_active', steps, 'active')} | "
            f"{mean_std([r['floor_active_steps'] for r in ok], 0)} | {mean_std([r['bonus_max'] for r in ok])} | "
            f"{mean_std([r['distinct_end'] for r in ok], 2)} | {mean_std([r['probe_repetition_end'] for r in ok])} | "
            f"{mean_std([r['filtered_share_mean'] for r in ok], 2)} | {mean_std([r['kl_coef_end'] for r in ok])} | "
            f"{mean_std([r['kl_end'] for r in ok], 4)} |"
        )
    return "\n".join(main) + "\n\nDiagnostics:\n\n" + "\n".join(diag)


def plot_collapse(results: dict[tuple[str, int], dict[str, Any]], png: Path, lr: float) -> None:
    """2 x 2: probe entropy of the main variants and of the ablations (floor band shaded), TRL-logged entropy with
    QUATRO's controller floor, and the batch-mean repetition reward; one line per run, colour per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(14, 9), sharex=True)
    (main_ax, abl_ax), (trl_ax, rew_ax) = axes
    bands = [r["band"] for r in results.values() if r.get("band") is not None]
    first = {name: min(s for v, s in results if v == name) for name, _ in results}
    for ax in (main_ax, abl_ax):
        if bands:
            lo, hi = min(bands), max(bands)
            label = f"floor band: {FLOOR_RATIO:g} × mean of steps 1-{BASELINE_STEPS}, per run ({lo:.3f}-{hi:.3f})"
            ax.axhspan(lo, max(hi, lo * 1.01), color="gray", alpha=0.35, label=label)
    starts = [r["probe_entropy"][0] for r in results.values() if r.get("probe_steps") and r["probe_steps"][0] == 0]
    for ax in (main_ax, abl_ax):
        if starts:
            sft_label = f"SFT checkpoint (probe at step 0: {statistics.fmean(starts):.3f})"
            ax.axhline(statistics.fmean(starts), color="black", linestyle="--", linewidth=0.8, label=sft_label)
    order = list(VARIANTS)
    for (name, seed), r in sorted(results.items(), key=lambda item: (order.index(item[0][0]), item[0][1])):
        if not r.get("probe_steps"):
            continue
        colour, label = VARIANTS[name][1], name if seed == first[name] else None
        main = name in MAIN_VARIANTS
        for ax in (main_ax,) if main else ():
            ax.plot(r["probe_steps"], r["probe_entropy"], color=colour, alpha=0.8, linewidth=1.1, label=label)
        if not main or name == "plain TRL":
            abl_ax.plot(r["probe_steps"], r["probe_entropy"], color=colour, alpha=0.8, linewidth=1.1, label=label)
        if main:
            trl_ax.plot(r["train_steps"], r["train_entropy"], color=colour, alpha=0.45, linewidth=0.7, label=label)
            rew_ax.plot(r["reward_steps"], r["reward"], color=colour, alpha=0.8, linewidth=1, label=label)
        if main and r["floor"]:
            floor_label = "quatro/entropy_floor" if name == "QUATRO" and seed == first[name] else None
            trl_ax.plot(r["floor_steps"], r["floor"], color=colour, linestyle="--", linewidth=1, label=floor_label)
    for ax in (main_ax, abl_ax, trl_ax):
        ax.axvline(BASELINE_STEPS, color="black", linestyle=":", linewidth=1)
    main_ax.set_title(f"Probe entropy ({PROBE_PROMPTS} fixed held-out prompts, sampled at T=1)")
    abl_ax.set_title("Probe entropy: which QUATRO part holds it (ablations; log scale)")
    abl_ax.set_yscale("log")
    trl_ax.set_title("TRL-logged entropy (training batch; with QUATRO: kept rows only)")
    rew_ax.set_title("Repetition reward (training batch mean)")
    for ax in (main_ax, abl_ax, trl_ax):
        ax.set_ylabel("mean token entropy (nats)")
    rew_ax.set_ylabel("reward")
    rew_ax.set_ylim(-0.02, 1.02)
    for ax in axes.flat:
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(
        f"Forced entropy collapse: GRPO on a reward for repeating one character (lr {lr:g}, β 0.04 unless named)"
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


def variant_overrides(name: str, extra: list[str] | None) -> tuple[str, ...]:
    """A variant's overrides, plus ``--set`` ones for every variant with QUATRO on (plain TRL's stay as they are)."""
    overrides = VARIANTS[name][2]
    return (*overrides, *(extra or ())) if QUATRO in overrides else overrides


def main_collapse(args: argparse.Namespace) -> str:
    seeds, steps = (range(1), 12) if args.quick else (range(args.seeds), args.steps)
    names = [n.strip() for n in args.variants.split(",")] if args.variants else list(VARIANTS)
    root, start = Path(args.out), time.time()
    jobs = []
    for seed in seeds:  # seed-major: a partial benchmark still compares both variants
        for name in names:
            out = root / f"{VARIANTS[name][0]}-s{seed}"
            cmd = collapse_command(args.sft, out, variant_overrides(name, args.set), seed, steps, args.lr)
            jobs.append(X.Job(name, "forced_collapse", seed, out, tuple(cmd)))

    def report(job: X.Job, r: dict[str, Any]) -> None:
        print(
            f"{job.variant} seed {job.seed}: rc {r['returncode']}, {r['wall_s']:.0f} s, collapse step "
            f"{r.get('collapse_step')}, entropy end {r.get('entropy_end')}, reward end {r.get('reward_end')}, "
            f"repetition drops {r.get('repetition_drops')}",
            flush=True,
        )

    done = X.run_jobs(jobs, summarise_collapse, timeout=args.timeout, reuse=args.reuse, paths=[REPO / "scripts"],
                      after=report)  # fmt: skip
    results = {(v, seed): r for (v, _, seed), r in done.items()}
    root.mkdir(parents=True, exist_ok=True)
    (root / "results.json").write_text(json.dumps({f"{v}|{s}": r for (v, s), r in results.items()}, indent=1))
    if args.png:
        plot_collapse(results, Path(args.png), args.lr)
    command = X.script_command("bench_entropy_floor.py")
    if args.results:
        write_results(Path(args.results), command, results, names, list(seeds), steps)
    return (
        f"```\nOMP_NUM_THREADS=1 {command}   # {len(results)} runs, one at a time, "
        f"{time.time() - start:.0f} s\n```\n\n"
        f"{steps} steps per run, 64 completions (8 per prompt) per step, learning rate {args.lr:g}, trainer.beta "
        f"{BETA} in every variant but the fixed-β-1.0 one, seeds {', '.join(map(str, seeds))}; mean ± seed std.\n\n"
        + collapse_tables(results, steps)
        + "\n"
    )


RESULT_METRICS = ("band", "collapse_step", "stays_below", "below_share", "entropy_end", "reward_end",
                  "floor_active_steps", "bonus_max", "repetition_drops", "kl_end", "wall_s")  # fmt: skip


def write_results(path: Path, command: str, results: dict, names: list[str], seeds: list[int], steps: int) -> None:
    """The collapse runs in the shared RESULTS.md format: scenario ``forced_collapse``, one cell per variant;
    ``accuracy`` is the greedy exact match at the end (logged only: the trained reward is the repetition one)."""
    cells = [
        X.cell("forced_collapse", name, seeds, [results[(name, seed)] for seed in seeds], RESULT_METRICS,
               died=lambda r: r["status"] != "ok")
        for name in names
    ]  # fmt: skip
    doc = X.results_doc("entropy_floor", cells, command=f"OMP_NUM_THREADS=1 {command}", sha=X.commit(),
                        model="tiny-llama-0.9m (SFT checkpoint)", steps=steps)  # fmt: skip
    X.write_results(path, doc, indent=2)


def summarise_demo(job: X.Job, run: X.Outcome) -> dict[str, Any]:
    """One demo run: final greedy accuracy and rewards, eval accuracy during training, QUATRO's filters and KL."""
    wall_s, result, history = run.wall_s, run.eval, run.history
    if run.status != "ok" or result is None:
        return {"status": "died", "returncode": run.returncode, "wall_s": wall_s}
    eval_steps, eval_accuracy = _finite_series(history, "eval/accuracy")
    _, share = _finite_series(history, "quatro/filtered_share")
    _, repetition = _finite_series(history, "quatro/filtered/repetition")
    _, zero_var = _finite_series(history, "quatro/filtered/zero_variance")
    coef_steps, kl_coef = _finite_series(history, "quatro/kl_coef")
    _, kl = _finite_series(history, "kl")
    _, active = _finite_series(history, "quatro/floor_active")
    at_max = coef_steps[kl_coef >= 0.999 * kl_coef.max()] if len(kl_coef) else []
    return {
        "status": "ok",
        "wall_s": wall_s,
        "accuracy": result["accuracy"],
        "numeric_match": result["rewards"].get("numeric_match"),
        "eval_at_50": float(eval_accuracy[eval_steps == 50][0]) if (eval_steps == 50).any() else None,
        "filtered_share_mean": float(share.mean()) if len(share) else None,
        "filtered_share_max": float(share.max()) if len(share) else None,
        "repetition_drops": float(repetition.sum()) if len(repetition) else None,
        "zero_variance_drops": float(zero_var.sum()) if len(zero_var) else None,
        "kl_coef_end": float(kl_coef[-1]) if len(kl_coef) else None,
        "kl_coef_max_from": int(at_max[0]) if len(at_max) and kl_coef.max() >= 0.999 else None,
        "kl_end": _tail_mean(kl),
        "floor_active_steps": int(active.sum()) if len(active) else None,
    }


def main_demo(args: argparse.Namespace) -> str:
    seeds = range(args.seeds)
    sft_eval = Path(args.sft).parent / "eval_results.json"
    sft = json.loads(sft_eval.read_text()) if sft_eval.is_file() else None
    root, start = Path(args.out), time.time()
    lines = [
        "| model | trainer.beta | runs ok | greedy accuracy (exact_match) | per seed | gain over SFT (points) | "
        "numeric_match | eval accuracy at step 50 | mean `quatro/filtered_share` (max) | repetition drops | "
        "zero-variance drops | `quatro/kl_coef` at end (β_max from step) | `kl` at end | floor active (steps) | "
        "wall s/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    if sft is not None:
        numeric = sft["rewards"].get("numeric_match", math.nan)
        lines.append(f"| SFT ({args.sft}) | - | - | {sft['accuracy']:.3f} | - | - | {numeric:.3f} |" + " - |" * 8)
    commands, jobs = [], []
    for name in DEMO_VARIANTS:
        for seed in seeds:
            out = root / f"demo-{VARIANTS[name][0]}-s{seed}"
            cmd = demo_command(args.sft, out, variant_overrides(name, args.set), seed)
            if seed == 0:
                commands.append(_shown(cmd))
            jobs.append(X.Job(name, "demo", seed, out, tuple(cmd)))
    done = X.run_jobs(jobs, summarise_demo, timeout=args.timeout, reuse=args.reuse, paths=[REPO / "scripts"],
                      after=lambda job, r: print(f"demo {job.variant} seed {job.seed}: {r}", flush=True))  # fmt: skip
    results = {(v, seed): r for (v, _, seed), r in done.items()}
    for name in DEMO_VARIANTS:
        runs = [results[(name, seed)] for seed in seeds]
        ok = [r for r in runs if r["status"] == "ok"]
        gains = [100 * (r["accuracy"] - sft["accuracy"]) for r in ok] if sft is not None else []
        share = mean_std([r["filtered_share_mean"] for r in ok])
        share_max = max((r["filtered_share_max"] for r in ok if r["filtered_share_max"] is not None), default=None)
        coef = mean_std([r["kl_coef_end"] for r in ok])
        coef_from = _collapse(ok, "kl_coef_max_from", 200, "at β_max") if coef != "-" else ""
        per_seed = ", ".join(f"{r['accuracy']:.3f}" for r in ok)
        col = {key: [r[key] for r in ok] for key in ok[0]} if ok else {}
        lines.append(
            f"| GRPO, {name} | {BETA} | {len(ok)}/{len(runs)} | {mean_std([r['accuracy'] for r in ok])} | "
            f"{per_seed} | {mean_std(gains, 1)} | "
            f"{mean_std([r['numeric_match'] for r in ok])} | {mean_std([r['eval_at_50'] for r in ok])} | "
            f"{share}{f' ({share_max:.2f})' if share_max is not None else ''} | "
            f"{mean_std(col.get('repetition_drops', []), 0)} | {mean_std(col.get('zero_variance_drops', []), 0)} | "
            f"{coef}{f' ({coef_from})' if coef_from else ''} | {mean_std([r['kl_end'] for r in ok], 3)} | "
            f"{mean_std(col.get('floor_active_steps', []), 0)} | {statistics.fmean(r['wall_s'] for r in runs):.0f} |"
        )
    root.mkdir(parents=True, exist_ok=True)
    (root / "demo_results.json").write_text(json.dumps({f"{v}|{s}": r for (v, s), r in results.items()}, indent=1))
    command = X.script_command("bench_entropy_floor.py")
    return (
        f"```\nOMP_NUM_THREADS=1 {command}   # {len(results)} runs, one at a time, {time.time() - start:.0f} s\n"
        "# each run (seed 0 shown; trainer.seed=1, 2 for the others):\n" + "\n".join(commands) + "\n```\n\n"
        f"configs/tiny/grpo.yaml as it is (exact-match reward, lr 1e-4, 200 steps, greedy eval on 200 held-out "
        f"problems) with trainer.beta {BETA}; seeds {', '.join(map(str, seeds))}; mean ± seed std.\n\n"
        + "\n".join(lines)
        + "\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sft", required=True, help="SFT checkpoint every run starts from (e.g. runs/demo-sft/final)")
    ap.add_argument("--out", default="runs/bench-entropy-floor", help="one folder per run, and results.json")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3, help="high enough that plain TRL's entropy collapses")
    ap.add_argument("--variants", default=None, help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before a run is killed")
    ap.add_argument("--reuse", action="store_true", help="summarise finished runs in --out instead of rerunning")
    ap.add_argument("--quick", action="store_true", help="1 seed, 12 steps")
    ap.add_argument("--demo", action="store_true", help="the tiny demo without/with QUATRO instead of the collapse")
    ap.add_argument("--out-md", default=None, help="write the markdown (command + table) here; always printed")
    ap.add_argument("--png", default=None, help="entropy plot of the collapse runs (e.g. docs/img/entropy_floor.png)")
    ap.add_argument("--results", default=None, help="collapse mode: RESULTS.md-format JSON (docs/results/...)")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="an override for every variant with QUATRO on (repeatable): guards.quatro.entropy.learning_gate=false",
    )  # fmt: skip
    args = ap.parse_args()
    if args.variants and set(n.strip() for n in args.variants.split(",")) - set(VARIANTS):
        ap.error(f"unknown variant in {args.variants!r}; valid: {', '.join(VARIANTS)}")
    markdown = main_demo(args) if args.demo else main_collapse(args)
    print(markdown, end="")
    if args.out_md:
        Path(args.out_md).write_text(markdown)


if __name__ == "__main__":
    main()
