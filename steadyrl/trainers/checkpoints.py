"""Checkpoints that are either complete or absent: staged writing, a completion marker, rotation, resume lookup.

``save_atomically`` runs the Trainer's save into ``<output_dir>/.staging/checkpoint-N``, adds ``steadyrl_state.pt``
(main process: guard state, step-gate counters) and ``steadyrl_rank{rank}.pt`` (each rank: TRL's rollout buffer,
per-rank guard state); after a barrier the main process writes the completion marker (size and hash of every file)
and renames the folder into ``<output_dir>``. Rotation counts complete checkpoints only. A failed save (a full disk)
raises ``CheckpointSaveError`` on every rank and removes the staged folder.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
# what a failed write raises: any exception (OSError for ENOSPC/EIO, RuntimeError from torch.save, safetensors' own
# SafetensorError, a filesystem client's): every one is a failed save, agreed by every rank before anything is published
SAVE_ERRORS = (Exception,)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the run stops with the last complete checkpoint untouched."""


class PeerSaveError(RuntimeError):
    """Another rank's part of this save failed (``agree_before_collectives``): this rank stops writing too."""


def agree_before_collectives(accelerator: Any, error: BaseException | None) -> None:
    """Every rank learns whether any rank's write so far failed, before a writer with collectives of its own starts
    (DeepSpeed's ``save_checkpoint``: a rank that stopped on its model write would leave the others in its barrier).
    One gather; raises ``error`` on the rank that had it, ``PeerSaveError`` on the others."""
    failed = [(rank, text) for rank, text in enumerate(_every_rank(accelerator, error)) if text is not None]
    if error is not None:
        raise error
    if failed:
        raise PeerSaveError("; ".join(f"rank {rank}: {text}" for rank, text in failed))


@contextmanager
def deepspeed_writes_held(engine: Any) -> Iterator[list[BaseException]]:
    """Around DeepSpeed's ``save_checkpoint``: this rank's first failed write (``SAVE_ERRORS``: a disk that fills
    mid-save) is held in the yielded list instead of raised, and its later writes are skipped, so the rank still
    reaches DeepSpeed's remaining collectives (its closing barrier) with the others. DeepSpeed's ``latest`` file
    (an unguarded ``open`` just before that barrier) is written after the barrier, through the same hold. The caller
    agrees on the held error (``agree_before_collectives``)."""
    held: list[BaseException] = []

    def guarded(write: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if held:
                return None
            try:
                return write(*args, **kwargs)
            except SAVE_ERRORS as exc:
                held.append(exc)
                return None

        return call

    real_save = engine.save_checkpoint

    def save_checkpoint(save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):  # noqa: B006 (DeepSpeed's signature)
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
        done = real_save(save_dir, tag, client_state, False, exclude_frozen_parameters)
        if save_latest and engine.global_rank == 0:
            guarded(Path(save_dir, "latest").write_text)(tag)
        return done

    writers = engine.checkpoint_engine
    patches = {
        (writers, "save"): guarded(writers.save),
        (writers, "makedirs"): guarded(writers.makedirs),
        (engine, "_copy_recovery_script"): guarded(engine._copy_recovery_script),
        (engine, "save_checkpoint"): save_checkpoint,
    }
    before = {key: vars(key[0]).get(key[1]) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield held
    finally:
        for (owner, name), value in before.items():
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


NOT_IN_SNAPSHOTS = ("gold",)  # guard state an OPEFO rollback leaves alone


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

    def snapshot_state_dicts(self, owner: Any) -> dict[str, Any]:
        """The guard state an OPEFO snapshot holds: all but the ``owner``'s and ``NOT_IN_SNAPSHOTS`` (the gold
        watch's best, counts and tightening are its own history: a rollback to a snapshot does not undo them)."""
        saved = self.guard_state_dicts(exclude=owner)
        return {name: state for name, state in saved.items() if name not in NOT_IN_SNAPSHOTS}

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
    name: str | None = None,
) -> None:
    """Stage, write, mark, rename, rotate. ``write(staging_root, folder)`` writes ``folder`` =
    ``staging_root/<name>`` (every rank; ``name``: ``checkpoint-N`` unless given, e.g. ``final``, which is not
    rotated); ``run_dir`` is where it is published. A write that fails on any rank (``SAVE_ERRORS``): the staged folder
    is removed, every rank raises CheckpointSaveError, nothing is published (an earlier folder of that name stays)."""
    checkpoint = name is None
    name = name or f"{PREFIX_CHECKPOINT_DIR}-{global_step}"
    staging_root = run_dir / STAGING_DIR
    staged = staging_root / name
    if accelerator.is_main_process and staging_root.is_dir():  # staged folders left by a save that crashed
        for folder in [*(f for _, f in _checkpoint_folders(staging_root)), staged]:
            shutil.rmtree(folder, ignore_errors=True)
    accelerator.wait_for_everyone()
    short = _every_rank(accelerator, _too_little_space(run_dir))  # one gather, before any rank starts writing
    if any(short):
        text = short[0] if len(short) == 1 else "; ".join(f"rank {r}: {t}" for r, t in enumerate(short) if t)
        raise CheckpointSaveError(
            f"{name} was not started: {text}. Free space on that disk (or lower trainer.save_total_limit: the newest "
            f"checkpoint is written before the oldest is removed).{last_checkpoint_note(run_dir)}"
        )
    error: BaseException | None = None
    try:
        write(staging_root, staged)
    except SAVE_ERRORS as exc:
        error = exc
    # the barrier before publishing: all ranks learn of any failure (a peer's failure is that rank's to report)
    errors = _every_rank(accelerator, None if isinstance(error, PeerSaveError) else error)
    if not any(errors):
        if accelerator.is_main_process:
            try:
                publish_checkpoint(staged, run_dir / name, global_step, accelerator.num_processes)
                if checkpoint:
                    rotate_complete_checkpoints(run_dir, save_total_limit)
            except SAVE_ERRORS as exc:
                error = exc
        errors = _every_rank(accelerator, error)
    if any(errors):
        if accelerator.is_main_process:
            shutil.rmtree(staged, ignore_errors=True)
        accelerator.wait_for_everyone()
        failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
        what = failed[0][1] if len(errors) == 1 else "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        removed = "The partial checkpoint was removed."
        if staged.exists():
            removed = f"The partial {staged} could not be removed: delete it to free its space."
        raise CheckpointSaveError(
            f"{staged.name} was not saved: {what} (writing {staged}; {free_space(run_dir)} free on the disk of "
            f"{run_dir}). {removed}{last_checkpoint_note(run_dir)}"
        ) from error


def _every_rank(accelerator: Any, error: BaseException | None) -> list[str | None]:
    """Every rank's error text (None: that rank wrote its part), on every rank; a barrier when launched together."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    if accelerator.num_processes == 1:
        return [text]
    from accelerate.utils import gather_object  # looked up at call time (tests stub it)

    return list(gather_object([text]))


def _human(size: float) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _too_little_space(run_dir: Path) -> OSError | None:
    """An error when the disk of ``run_dir`` has less free space than the newest complete checkpoint there took (this
    rank's view: a node-local disk or a shared one); None when it has enough or there is none to compare with. Checked
    on every rank and agreed before a save starts: under DeepSpeed a rank that failed its first file while the others
    sat in DeepSpeed's own save collectives hung them all."""
    newest = find_resume_checkpoint(run_dir, verify=False)
    if newest is None:
        return None
    try:
        need = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return None
    if free >= need:
        return None
    return OSError(errno.ENOSPC, f"{_human(free)} free on the disk of {run_dir}, and {newest.name} took {_human(need)}")


def free_space(path: Path) -> str:
    """The free space on the disk holding ``path`` (its nearest existing folder), e.g. ``"1.5 GiB"``."""
    existing = next((p for p in (path, *path.parents) if p.exists()), path)
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return "unknown"
    return _human(free)


def last_checkpoint_note(output_dir: str | os.PathLike[str]) -> str:
    """The sentence that tells the user where the run can resume from (with a leading space)."""
    found = find_resume_checkpoint(output_dir, verify=False)
    if found is None:
        return f" No complete checkpoint in {output_dir} yet."
    return f" Last complete checkpoint: {found} (trainer.resume_from_checkpoint: auto resumes from it)."


def save_steady_state(
    folder: Path, state: GuardState, rollouts: dict[str, Any], rank: int, is_main_process: bool
) -> None:
    """Write guard state (main process) and this rank's state into ``folder``; ``rollouts``: ``{"step": trainer._step,
    "buffered_inputs": trainer._buffered_inputs}`` (a resume inside a generation window trains on the same rows)."""
    folder.mkdir(parents=True, exist_ok=True)
    rank_state = {**rollouts, "guards": {name: obj.rank_state_dict() for name, obj in state.rank_stateful.items()}}
    torch.save(rank_state, folder / RANK_STATE_FILE.format(rank=rank))
    if is_main_process:
        saved = {"guards": state.guard_state_dicts(), "counters": dict(state.counters)}
        torch.save(saved, folder / GUARD_STATE_FILE)


def publish_checkpoint(staged: Path, final: Path, global_step: int, num_processes: int) -> None:
    """Mark a fully written staged checkpoint complete and rename it into place (main process only). An existing
    ``final`` (stale, or the same step saved again) is moved aside into the staging folder, then deleted."""
    files = integrity.manifest(staged, exclude=frozenset({COMPLETE_MARKER}), fsync=True)  # hashes and flushes
    marker = {"global_step": global_step, "num_processes": num_processes, "files": files}
    (staged / COMPLETE_MARKER).write_text(json.dumps(marker))
    with open(staged / COMPLETE_MARKER, "rb") as handle:
        os.fsync(handle.fileno())
    _fsync_dir(staged)
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


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_num_processes(folder: Path) -> int | None:
    """The number of processes that wrote checkpoint ``folder`` (its completion marker), None when not recorded."""
    try:
        value = json.loads((folder / COMPLETE_MARKER).read_text()).get("num_processes")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def load_steady_state(
    folder: Path, state: GuardState, rank: int, device: Any, num_processes: int = 1
) -> dict[str, Any] | None:
    """Restore the guard state and this rank's state; returns this rank's saved rollouts (``step``,
    ``buffered_inputs``) or None. Written by another number of processes: every rank drops its per-rank state
    (docs/DESIGN.md, "Resume on another world size")."""
    rank_file = folder / RANK_STATE_FILE.format(rank=rank)
    rollouts = None
    saved = saved_num_processes(folder)
    if saved is not None and saved != num_processes:
        if rank == 0:
            logger.warning(
                "%s was written by %d processes and this run has %d: per-rank state is dropped (rollouts not yet "
                "trained on are generated afresh, replay buffers start empty, a pending error-feedback residual is "
                "lost); weights, optimizer and shared guard state resume. Launch with %d processes to resume exactly",
                folder, saved, num_processes, saved,
            )  # fmt: skip
    elif rank_file.is_file():
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
    shared = torch.load(state_file, map_location="cpu", weights_only=False)
    state.load_guard_state_dicts(shared["guards"], where=str(folder))
    state.counters.update(shared.get("counters", {}))
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
    """None when every file the completion marker lists has its recorded size and hash, else what is wrong (a marker
    without a file list is trusted)."""
    marker = folder / COMPLETE_MARKER
    try:
        files = json.loads(marker.read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        return f"{marker} cannot be read: {exc}"
    return None if files is None else integrity.verify(folder, files)


def find_resume_checkpoint(output_dir: str | os.PathLike[str], verify: bool = True) -> Path | None:
    """The newest complete ``checkpoint-N`` in ``output_dir`` that verifies, or None (start fresh). Damaged ones are
    skipped with a warning; ConfigError when every complete checkpoint is damaged."""
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
