"""The storage plan (issue 57): before the model loads, the bytes a run will write to ``output_dir`` -- its
checkpoints, OPEFO's disk snapshots, the gold watch's ``best-gold/`` -- from the config, the model's parameter count
(its ``config.json`` built on the meta device: no weights read) and the world size, against the free space there.

Per item (P parameters of b bytes, P_t trainable; LoRA adapters are fp32; Adam keeps two moments per trainable
weight in its dtype, ZeRO adds an fp32 master copy and partitions both over the ranks)::

    weights      = P_t x 4 (LoRA adapter)  |  P x b (full model)
    adam         = 2 x P_t x m   (m = 4 for fp32 weights or under ZeRO, else b), + 4 x P_t under ZeRO (fp32 master)
    checkpoint   = weights + adam (+ weights again: DeepSpeed's model states) + 4 x P_t per rank (error feedback)
    snapshot     = P_t x b + adam, over all ranks (the first rank the weights; DDP: it the Adam state, ZeRO: each
                   rank its part)                                                             (disk snapshots only)
    best-gold    = weights + adam                                                              (gold watch, save_best)
    steady       = checkpoint x save_total_limit + snapshots + best-gold
    peak         = steady + the largest one being written beside its predecessor

An estimate (tokenizer, scheduler and RNG files are left out: kilobytes to megabytes); at 135M it is checked against
a real checkpoint in tests/integration/test_storage_plan.py. The run refuses when the peak exceeds the free space and
warns above ``WARN_SHARE`` of it; ``steadyrl preflight`` prints the same plan.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("steadyrl")

WARN_SHARE = 0.8  # warn when the plan's peak takes more than this share of the free space
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class StorageError(RuntimeError):
    """The run would fill its disk: the plan, the free space and what to change."""


@dataclass(frozen=True)
class ModelSize:
    parameters: int  # all parameters (tied ones once)
    trainable: int  # what the optimizer updates (the LoRA adapter, or every parameter)
    weight_bytes: int  # bytes per weight in the dtype the model trains in
    lora: bool


@dataclass(frozen=True)
class StoragePlan:
    checkpoint: int
    checkpoints_kept: int
    snapshots: int  # all ranks' disk snapshots (0: in memory)
    best_gold: int  # 0: no gold watch keeping a policy
    free: int | None  # free bytes on the disk of output_dir (None: unknown)
    ranks: int
    existing: int = 0  # bytes of checkpoints, snapshots and best-gold/ already in output_dir (a resume replaces them)

    @property
    def steady(self) -> int:
        return self.checkpoint * self.checkpoints_kept + self.snapshots + self.best_gold

    @property
    def peak(self) -> int:
        return self.steady + max(self.checkpoint, self.snapshots, self.best_gold)

    def lines(self) -> list[str]:
        kept = f"x {self.checkpoints_kept} kept" if self.checkpoints_kept else "none kept"
        rows = [
            f"checkpoint {human(self.checkpoint)} ({kept})",
            f"OPEFO disk snapshots {human(self.snapshots)}" if self.snapshots else "OPEFO snapshots in memory",
            f"best-gold/ {human(self.best_gold)}" if self.best_gold else "no best-gold/",
            f"peak {human(self.peak)} while one is written beside the last",
            f"free {human(self.free)}" if self.free is not None else "free space unknown",
        ]
        if self.existing:
            rows.append(f"{human(self.existing)} of them already there")
        return rows

    def __str__(self) -> str:
        return "; ".join(self.lines())


def human(size: float | None) -> str:
    if size is None:
        return "?"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 1e3:.1f} kB"


def model_size(model_path: str, lora: dict[str, Any] | None, dtype: str | None, **hub: Any) -> ModelSize | None:
    """The model's parameter counts from its ``config.json`` (local folder or the Hugging Face cache), built on the
    meta device with the LoRA adapter when given; None when the config cannot be read without downloading."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path, **hub)
    except (OSError, ValueError):
        return None
    with torch.device("meta"):  # no memory; tied embeddings tie (and count once, as in the saved files)
        model = AutoModelForCausalLM.from_config(config)
    name = dtype if dtype not in (None, "auto") else str(getattr(config, "dtype", None) or "float32")
    weight_bytes = DTYPE_BYTES.get(str(name).removeprefix("torch."), 4)
    total = sum(p.numel() for p in model.parameters())
    if lora is None:
        return ModelSize(total, total, weight_bytes, False)
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(**lora, task_type="CAUSAL_LM"))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return ModelSize(total, trainable, weight_bytes, True)


def plan(
    size: ModelSize,
    ranks: int,
    zero: bool,
    save_total_limit: int | None,
    saves: int,
    error_feedback: bool,
    disk_snapshots: bool,
    best_gold: bool,
    output_dir: str | Path,
) -> StoragePlan:
    """The plan of one run (``saves``: checkpoints the run writes, 0 when unknown; the count kept without
    ``save_total_limit``)."""
    p, pt, b = size.parameters, size.trainable, size.weight_bytes
    weights = pt * 4 if size.lora else p * b
    moment = 4 if (size.lora or zero or b == 4) else b
    adam = 2 * pt * moment + (4 * pt if zero else 0)
    ds_states = weights if size.lora else p * b  # DeepSpeed's own model states (frozen weights left out under peft)
    checkpoint = weights + adam + (ds_states if zero else 0) + (4 * pt * ranks if error_feedback else 0)
    # saves 0: unknown (an epoch-based run): save_total_limit of them, or one when unlimited (then more, by the run)
    kept = (min(save_total_limit, saves) if saves else save_total_limit) if save_total_limit else max(saves, 1)
    snapshots = pt * (4 if size.lora else b) + adam if disk_snapshots else 0  # held once over the ranks
    gold = weights + adam if best_gold else 0
    return StoragePlan(checkpoint, kept, snapshots, gold, free_bytes(output_dir), ranks, existing_bytes(output_dir))


def existing_bytes(output_dir: str | Path) -> int:
    """What an earlier run left in ``output_dir`` that this one replaces: checkpoints, snapshots, ``best-gold/``."""
    root = Path(output_dir)
    folders = [*root.glob("checkpoint-*"), root / "opefo_snapshots", root / "best-gold"]
    try:
        return sum(f.stat().st_size for folder in folders if folder.is_dir() for f in folder.rglob("*") if f.is_file())
    except OSError:
        return 0


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the disk of ``path`` (its nearest existing folder); None when unknown."""
    path = Path(path).resolve()
    existing = next((q for q in (path, *path.parents) if q.exists()), None)
    try:
        return shutil.disk_usage(existing).free if existing is not None else None
    except OSError:
        return None


def write_report(path: str | Path, text: str) -> bool:
    """Write one of the run's reports (``eval_results.json``, ``interventions.json``, ``guard_cost.json``) whole or
    not at all: a temp file beside it, then a rename. A write that fails (``OSError``: a full disk) leaves the previous
    file as it was and no temp file, and is a warning naming the file, the cause and the free space, with the report's
    text when it is short (nothing is lost); returns False. The model and the checkpoints never depend on a report."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
        return True
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        shown = f"; its content:\n{text}" if len(text) <= 4000 else ""
        free = human(free_bytes(path.parent))
        what = "the run, its model and its checkpoints are unaffected"
        logger.warning("could not write %s (%s; %s free on that disk); %s%s", path, exc, free, what, shown)
        return False


def check(storage: StoragePlan, output_dir: str | Path) -> str | None:
    """Raise ``StorageError`` when the peak exceeds the free space; a warning text above ``WARN_SHARE`` of it."""
    if storage.free is None:
        return None
    room = storage.free + storage.existing
    if storage.peak > room:
        raise StorageError(
            f"this run would write up to {human(storage.peak)} to {output_dir}, which has {human(storage.free)} free "
            f"({storage}). Free space there, set trainer.save_total_limit (and guards.opefo.rollback.storage: memory), "
            "or point trainer.output_dir at a larger disk"
        )
    if storage.peak > WARN_SHARE * room:
        return f"this run will write up to {human(storage.peak)} to {output_dir} ({storage})"
    return None


def run_plan(cfg: Any, args: Any, model_path: str, ranks: int, hub: dict[str, Any]) -> StoragePlan | None:
    """The plan of a config (``args``: its TRL arguments; ``hub``: how the model's files load); None when the model's
    config cannot be read without a download."""
    from steadyrl.config.checks import _deepspeed_config

    init = dict(getattr(args, "model_init_kwargs", None) or {})
    dtype = init.get("dtype", init.get("torch_dtype"))
    lora = None if cfg.peft is None else {k: v for k, v in vars(cfg.peft).items() if not k.startswith("_")}
    size = model_size(model_path, lora, None if dtype is None else str(dtype), **hub)
    if size is None:
        return None
    strategy = str(getattr(args, "save_strategy", "no")).lower().removeprefix("savestrategy.")
    saves = 0  # unknown (an epoch-based run)
    if strategy == "steps" and args.max_steps and args.max_steps > 0:
        step = args.save_steps if args.save_steps >= 1 else math.ceil(args.save_steps * args.max_steps)
        saves = max(1, args.max_steps // max(1, int(step)))
    guards = getattr(cfg, "guards", None)
    opefo = getattr(guards, "opefo", None)
    quatro = getattr(guards, "quatro", None)
    ef = bool(opefo and opefo.enabled and opefo.error_feedback.enabled)
    disk = bool(opefo and opefo.enabled and opefo.rollback.enabled and opefo.rollback.storage == "disk")
    eval_on = bool(getattr(cfg, "eval", None) and cfg.eval.enabled and cfg.eval.every > 0)
    gold = bool(quatro and quatro.enabled and quatro.gold.enabled and quatro.gold.save_best and eval_on)
    zero = _deepspeed_config(cfg) is not None
    limit = args.save_total_limit
    planned = plan(size, ranks, zero, limit, saves, ef, disk, gold, args.output_dir)
    return dataclasses.replace(planned, checkpoints_kept=0) if strategy == "no" else planned


HF_DEFAULTS = {
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": None,
    "max_steps": -1,
    "output_dir": "trainer_output",
    "model_init_kwargs": None,
}


def describe(cfg: Any, ranks: int = 1) -> str:
    """The plan of a config as ``steadyrl preflight`` prints it, from the ``trainer`` section (no TRL arguments built;
    builtin models resolve to their local folders)."""
    from types import SimpleNamespace

    from steadyrl.config.checks import BUILTIN_MODELS
    from steadyrl.tasks.smollm2 import BUILTIN_SMOLLM2, smollm2_folder

    path = cfg.model.path
    if path == BUILTIN_SMOLLM2:
        path = str(smollm2_folder())
    elif path in BUILTIN_MODELS:
        return "a builtin tiny model: kilobytes"
    args = SimpleNamespace(**{**HF_DEFAULTS, **{k: v for k, v in cfg.trainer.items() if k in HF_DEFAULTS}})
    planned = run_plan(cfg, args, path, ranks, {})
    if planned is None:
        return f"unknown: the config.json of {path} is not on this machine (the run prints it once the model is there)"
    return str(planned)
