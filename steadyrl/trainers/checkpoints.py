"""Checkpoints that are either complete or absent: staged writing, a completion marker, rotation, resume lookup.

``SteadyGRPOTrainer._save_checkpoint`` hands ``save_atomically`` the parent's own save; TRL/transformers then write
``checkpoint-N`` under ``<output_dir>/.staging`` (the trainer's ``_get_output_dir`` answers the staging root while
it runs), steadyrl adds its guard state and per-rank rollout buffers, and once every rank is past a barrier the
main process writes the completion marker and renames the folder to ``<output_dir>/checkpoint-N``. A crash at any
point leaves either the previous complete checkpoints untouched or the new one complete: ``resume: auto`` never
sees a half-written folder. The marker lists the size and hash of every file (``steadyrl.trainers.integrity``), so a
file damaged *after* the save (a truncated copy, a flipped bit) is found on resume: ``auto`` falls back to the newest
checkpoint that verifies. Rotation (``save_total_limit``) counts complete checkpoints only, so the newest
complete one is never deleted; leftovers of a crashed save are removed.

Files steadyrl adds to a checkpoint: ``steadyrl_state.pt`` (main process: every stateful guard's ``state_dict``
and the step gate's counters) and ``steadyrl_rank{rank}.pt`` (each rank: TRL's rollout buffer and micro-step
counter, and the per-rank guard state: OPEFO's error-feedback residual, QUATRO's replay buffer).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from steadyrl.config.loader import ConfigError
from steadyrl.guards.base import RankStateful, Stateful
from steadyrl.trainers import integrity

logger = logging.getLogger(__name__)

GUARD_STATE_FILE = "steadyrl_state.pt"
RANK_STATE_FILE = "steadyrl_rank{rank}.pt"
COMPLETE_MARKER = "steadyrl_complete.json"
STAGING_DIR = ".staging"


@dataclass
class GuardState:
    """What steadyrl saves beside the Trainer's own checkpoint files."""

    stateful: dict[str, Stateful] = field(default_factory=dict)  # saved by the main process
    rank_stateful: dict[str, RankStateful] = field(default_factory=dict)  # saved by every rank, in its rank file
    counters: dict[str, float] = field(default_factory=dict)  # the step gate's skip counters

    @classmethod
    def register(
        cls,
        layers: list[tuple[str, Any]],
        extra: dict[str, Any] | None,
        counters: dict[str, float],
        per_rank: dict[str, Any] | None = None,
    ) -> GuardState:
        """Every layer object with a ``state_dict``, in this order after the ``extra`` named objects; ``per_rank``:
        the objects whose ``rank_state_dict`` goes to the rank files (None entries are left out)."""
        state = cls(dict(extra or {}), counters=counters)
        for name, obj in layers:
            if obj is not None and hasattr(obj, "state_dict"):
                state.stateful.setdefault(name, obj)
        state.rank_stateful.update({name: obj for name, obj in (per_rank or {}).items() if obj is not None})
        return state

    def guard_state_dicts(self, exclude: Any = None) -> dict[str, Any]:
        return {name: obj.state_dict() for name, obj in self.stateful.items() if obj is not exclude}

    def load_guard_state_dicts(self, saved: dict[str, Any], exclude: Any = None, where: str | None = None) -> None:
        """Restore every stateful object found in ``saved``; ``where`` names the checkpoint for the warning about
        the missing ones (None: skip them silently, as a rollback to a snapshot does)."""
        for name, obj in self.stateful.items():
            if obj is exclude:
                continue
            if name in saved:
                obj.load_state_dict(saved[name])
            elif where is not None:
                logger.warning("checkpoint %s has no state for %s: it starts fresh", where, name)


def save_atomically(
    accelerator: Any,
    run_dir: Path,
    global_step: int,
    save_total_limit: int | None,
    write: Callable[[Path, Path], None],
) -> None:
    """Stage, write, mark, rename, rotate. ``write(staging_root, folder)`` writes ``folder`` =
    ``staging_root/checkpoint-N`` (on every rank); ``run_dir`` is where ``checkpoint-N`` is published."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{global_step}"
    staging_root = run_dir / STAGING_DIR
    if accelerator.is_main_process and (staging_root / name).exists():
        shutil.rmtree(staging_root / name)  # left by a save that crashed
    accelerator.wait_for_everyone()
    write(staging_root, staging_root / name)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        publish_checkpoint(staging_root / name, run_dir / name, global_step, accelerator.num_processes)
        rotate_complete_checkpoints(run_dir, save_total_limit)
    accelerator.wait_for_everyone()


def save_steady_state(
    folder: Path, state: GuardState, rollouts: dict[str, Any], rank: int, is_main_process: bool
) -> None:
    """Write guard state (main process) and this rank's rollout buffer into a checkpoint folder.

    ``rollouts``: ``{"step": trainer._step, "buffered_inputs": trainer._buffered_inputs}``. The rollout buffer and
    the micro-step counter make a resume inside a generation window (``steps_per_generation > 1``) exact: the
    resumed run trains on the same rollouts instead of generating new ones.
    """
    folder.mkdir(parents=True, exist_ok=True)
    rank_state = {**rollouts, "guards": {name: obj.rank_state_dict() for name, obj in state.rank_stateful.items()}}
    torch.save(rank_state, folder / RANK_STATE_FILE.format(rank=rank))
    if is_main_process:
        saved = {"guards": state.guard_state_dicts(), "counters": dict(state.counters)}
        torch.save(saved, folder / GUARD_STATE_FILE)


def publish_checkpoint(staged: Path, final: Path, global_step: int, num_processes: int) -> None:
    """Mark a fully written staged checkpoint complete and rename it into place (main process only).

    An existing ``final`` (a stale folder from a crashed run, or the same step saved again) is first moved
    aside, so there is no moment at which neither the old nor the new folder exists under a checkpoint name
    that ``resume: auto`` would pick.
    """
    files = integrity.manifest(staged, exclude=frozenset({COMPLETE_MARKER}), fsync=True)  # hashes and flushes
    marker = {"global_step": global_step, "num_processes": num_processes, "files": files}
    (staged / COMPLETE_MARKER).write_text(json.dumps(marker))
    _fsync_tree(staged, only=staged / COMPLETE_MARKER)
    trash = None
    if final.exists():
        trash = final.parent / STAGING_DIR / f"{final.name}.old"
        if trash.exists():
            shutil.rmtree(trash)
        os.replace(final, trash)
    os.replace(staged, final)
    _fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def rotate_complete_checkpoints(run_dir: Path, save_total_limit: int | None) -> None:
    """Keep the newest ``save_total_limit`` complete checkpoints; delete older ones and incomplete leftovers."""
    numbered = sorted(_checkpoint_folders(run_dir), reverse=True)
    complete = [folder for _, folder in numbered if is_complete_checkpoint(folder)]
    for _, folder in numbered:
        if not is_complete_checkpoint(folder):
            logger.warning("removing incomplete checkpoint %s (left by a crashed save)", folder)
            shutil.rmtree(folder, ignore_errors=True)
    if save_total_limit is not None and save_total_limit > 0:
        for folder in complete[save_total_limit:]:
            shutil.rmtree(folder, ignore_errors=True)


def _fsync_tree(folder: Path, only: Path | None = None) -> None:
    """Flush every file of a freshly written checkpoint (or ``only`` that one) to disk before it is published."""
    for path in [only] if only is not None else folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_steady_state(folder: Path, state: GuardState, rank: int, device: Any) -> dict[str, Any] | None:
    """Restore guard state and this rank's guard state; returns this rank's saved rollouts (``step``,
    ``buffered_inputs``) for the trainer to put back, or None when the checkpoint has none."""
    rank_file = folder / RANK_STATE_FILE.format(rank=rank)
    rollouts = None
    if rank_file.is_file():
        where = torch.device(device)
        # a CPU process of a multi-process run has device cpu:<rank>, a location torch.load does not know
        where = torch.device("cpu") if where.type == "cpu" else where
        rank_state = torch.load(rank_file, map_location=where, weights_only=False)
        rollouts = {"step": rank_state["step"], "buffered_inputs": rank_state["buffered_inputs"]}
        for name, obj in state.rank_stateful.items():
            if name in rank_state.get("guards", {}):
                obj.load_rank_state_dict(rank_state["guards"][name])
    else:
        logger.warning("%s has no rollout buffer for rank %d: resuming with fresh rollouts", folder, rank)
    state_file = folder / GUARD_STATE_FILE
    if not state_file.is_file():
        if state.stateful:
            logger.warning("%s has no guard state: guards start fresh", folder)
        return rollouts
    saved = torch.load(state_file, map_location="cpu", weights_only=False)
    state.load_guard_state_dicts(saved["guards"], where=str(folder))
    state.counters.update(saved.get("counters", {}))
    return rollouts


def is_complete_checkpoint(folder: Path) -> bool:
    """A checkpoint whose every part was written: the Trainer's state and steadyrl's completion marker."""
    return (folder / "trainer_state.json").is_file() and (folder / COMPLETE_MARKER).is_file()


def _checkpoint_folders(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for child in run_dir.iterdir():
        prefix, _, number = child.name.partition("-")
        if prefix == PREFIX_CHECKPOINT_DIR and number.isdigit() and child.is_dir():
            out.append((int(number), child))
    return out


def verify_checkpoint(folder: Path) -> str | None:
    """None when every file the completion marker lists has its recorded size and hash (``integrity``); else what is
    wrong, naming the file. A marker from before the file list is trusted."""
    marker = folder / COMPLETE_MARKER
    try:
        files = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        return f"{marker} cannot be read: {exc}"
    return None if files is None else integrity.verify(folder, files)


def find_resume_checkpoint(output_dir: str | os.PathLike[str], verify: bool = True) -> Path | None:
    """The newest complete ``checkpoint-N`` folder in ``output_dir`` that verifies (``verify_checkpoint``), or None
    (start fresh). A damaged one is skipped with a warning naming the file; when every complete checkpoint is
    damaged, a ConfigError lists them (starting fresh would silently drop the run)."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    damaged = []
    for _, folder in sorted(_checkpoint_folders(root), reverse=True):
        if not is_complete_checkpoint(folder):
            logger.warning("ignoring incomplete checkpoint %s", folder)
            continue
        problem = verify_checkpoint(folder) if verify else None
        if problem is None:
            return folder
        logger.warning("checkpoint %s is damaged, falling back to an older one: %s", folder, problem)
        damaged.append(problem)
    if damaged:
        raise ConfigError(
            f"trainer.resume_from_checkpoint: every complete checkpoint in {root} is damaged ({'; '.join(damaged)}); "
            "move them aside, or set trainer.resume_from_checkpoint: null to start afresh"
        )
    return None
