"""``OUTPUT_DIR/best-gold/``: the policy the gold watch keeps (steadyrl/callbacks/gold_watch.py), written once.

- the weights, once: the model (or the LoRA adapter) as ``save_model`` writes it, with PPO's critic; a restore reads
  the trainable tensors back from those files (transformers' safetensors shards, or peft's adapter loader);
- the optimizer state only as the ranks hold it: once (``gold_state.pt``, main process) when every rank holds the
  same state (one process, DDP), per rank (``gold_state_rank<r>.pt``: that rank's Adam state and fp32 master
  partition) under DeepSpeed ZeRO, where each rank holds a part;
- ``gold.json``: step, metric, gold, reward, ranks, whether the state is partitioned.

It is written through the checkpoints' path (``save_atomically``: staged, free space agreed by every rank before any
writes, published by a rename; a failure on any rank removes the staged copy, keeps the previous best and raises
``CheckpointSaveError`` on every rank), never pushed to the Hub. Size: the trainable weights once + the optimizer state
once (DDP) or once in all over the ranks (ZeRO: each rank its part); before, every rank wrote the trainable tensors and
its whole optimizer state beside the model (docs/DESIGN.md, "QUATRO: gold watch", has the formula).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from steadyrl.guards.rollback import cpu_copy
from steadyrl.trainers.checkpoints import save_atomically
from steadyrl.trainers.recovery import restore_payload

logger = logging.getLogger("steadyrl.quatro")

META = "gold.json"
SHARED_STATE = "gold_state.pt"
FORMAT = 2


def rank_state(rank: int) -> str:
    return f"gold_state_rank{rank}.pt"


def write_best(trainer: Any, folder: Path, base: Any, zero: Any, meta: dict[str, Any]) -> None:
    """Keep the current policy in ``folder`` (every rank calls it; see the module docstring)."""
    acc = trainer.accelerator
    partitioned = zero is not None

    def write(staging_root: Path, staged: Path) -> None:
        # every rank calls it (DeepSpeed gathers), the main process writes; internal: never pushed to the Hub
        trainer.save_model(str(staged), _internal_call=True)
        staged.mkdir(parents=True, exist_ok=True)
        if partitioned:
            partition = [t.detach() for t in zero.single_partition_of_fp32_groups]
            payload = {"optimizer": base.state_dict(), "fp32_partitions": partition}
            torch.save(cpu_copy(payload), staged / rank_state(acc.process_index))
        elif acc.is_main_process:
            torch.save(cpu_copy({"optimizer": base.state_dict()}), staged / SHARED_STATE)
        if acc.is_main_process:
            full = {**meta, "ranks": acc.num_processes, "partitioned": partitioned, "format": FORMAT}
            (staged / META).write_text(json.dumps(full, indent=1) + "\n")

    save_atomically(acc, folder.parent, int(meta["step"]), None, write, name=folder.name)


def read_meta(folder: Path) -> dict[str, Any]:
    return json.loads((folder / META).read_text())


def load_trainable(model: torch.nn.Module, folder: Path, names: list[str]) -> None:
    """Copy the kept weights in ``folder`` into ``model``'s parameters (exactly: the files hold the same dtype); every
    name in ``names`` (the trainable ones) must be among them. PPO's ``PolicyAndValue``: the policy from its files,
    the whole critic from ``critic.safetensors`` (both as ``SteadyPPOTrainer.save_model`` writes them)."""
    from steadyrl.ppo.wrapper import CRITIC_FILE, PolicyAndValue

    if isinstance(model, PolicyAndValue):
        from safetensors.torch import load_file

        load_trainable(model.policy, folder, [n.removeprefix("policy.") for n in names if n.startswith("policy.")])
        if not (folder / CRITIC_FILE).is_file():
            raise FileNotFoundError(f"{folder} has no {CRITIC_FILE}: the kept policy's critic is missing")
        model.critic.load_state_dict(load_file(str(folder / CRITIC_FILE)))  # strict: every critic tensor
        return
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        result = set_peft_model_state_dict(model, load_peft_weights(str(folder), device="cpu"))
        missing = set(getattr(result, "missing_keys", ()))
    else:
        from safetensors.torch import load_file

        index = folder / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []
        files = files or (["model.safetensors"] if (folder / "model.safetensors").is_file() else [])
        if not files:
            raise FileNotFoundError(f"{folder} has no model.safetensors (or shards) to restore the kept policy from")
        missing = set(dict(model.named_parameters()))
        for name in files:
            state = load_file(str(folder / name))
            missing -= set(state)
            model.load_state_dict(state, strict=False)
    lost = sorted(set(names) & missing)
    if lost:
        raise RuntimeError(f"{folder} lacks {len(lost)} trainable tensor(s) of the model, e.g. {lost[:3]}")


def restore_best(
    trainer: Any, folder: Path, model: torch.nn.Module, trainable: list[tuple[str, Any]], base: Any, zero: Any
) -> None:
    """The kept policy back into the live model and optimizer (the schedule is not rewound). A ``best-gold/`` from
    another number of ranks under ZeRO (its state partitioned for them): the weights are restored, ZeRO's fp32 master
    copy refreshed from them, and the optimizer moments stay the live ones (warned)."""
    acc = trainer.accelerator
    meta = read_meta(folder)
    if meta.get("format", 1) < 2:  # before: every rank kept its trainable tensors and whole optimizer state
        restore_payload(torch.load(folder / rank_state(acc.process_index), weights_only=False), trainable, base, zero)
        return
    with torch.no_grad():
        load_trainable(model, folder, [n for n, _ in trainable])
    same_layout = bool(meta["partitioned"]) == (zero is not None) and (
        not meta["partitioned"] or int(meta["ranks"]) == acc.num_processes
    )
    if not same_layout:
        if zero is not None:
            zero.refresh_fp32_params()
        logger.warning(
            "the best policy in %s was kept with its optimizer state %s; this run has %d process(es)%s: its weights "
            "are restored and the optimizer moments stay this run's (as after a resume on another number of processes)",
            folder, f"partitioned over {meta['ranks']} ranks" if meta["partitioned"] else "whole",
            acc.num_processes, " under ZeRO" if zero is not None else "",
        )  # fmt: skip
        return
    state_file = folder / (rank_state(acc.process_index) if zero is not None else SHARED_STATE)
    restore_payload(torch.load(state_file, weights_only=False), [], base, zero)  # the weights are in already
