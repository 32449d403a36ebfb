"""Snapshots and rollback (OPEFO, ``guards.opefo.rollback``): healthy snapshots of weights and optimizer state, in
memory or on disk, and the policy that bounds rollbacks and lowers the learning rate after one (docs/DESIGN.md,
"OPEFO: snapshots and rollback"). Deciding when to check and restoring the payload is the runtime's job.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steadyrl.ranges import Checked, bounded

STORAGES = ("memory", "disk")


@dataclass
class RollbackConfig(Checked):
    enabled: bool = True
    snapshot_interval: int = bounded(500, ge=1)
    storage: str = bounded("memory", choices=STORAGES)
    snapshot_dir: str | None = None  # disk storage: base directory; the caller adds one folder per rank
    check_interval: int = bounded(10, ge=1)
    recovery_lr_factor: float = bounded(0.3, gt=0, le=1)
    recovery_steps: int = bounded(100, ge=0)
    max_rollbacks: int = bounded(3, ge=0)
    rollback_window: int = bounded(1000, ge=1)
    # non-finite moments with finite weights: reset the bad entries in place instead of rolling back, unless more
    # than repair_max_share of them are bad or they go bad again within recovery_steps of a repair
    repair_state: bool = True
    repair_max_share: float = bounded(0.01, gt=0, le=1)


def cpu_copy(obj: Any) -> Any:
    """Deep copy of a nested payload with every tensor cloned onto the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):  # an OrderedDict stays one, other dicts become dicts
        return (OrderedDict if isinstance(obj, OrderedDict) else dict)((k, cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, list | tuple):
        return (tuple if isinstance(obj, tuple) else list)(cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


class SnapshotStore:
    """The latest healthy snapshot: ``save(step, payload)``, ``load() -> (step, payload)``, ``clear()``.

    ``payload``: a nested dict of tensors and Python objects. ``memory`` keeps a CPU deep copy and ``load`` returns a
    fresh copy each time (``Optimizer.load_state_dict`` keeps same-device tensors by reference). ``disk`` writes
    ``snapshot-<step>.pt`` atomically (temp file and ``os.replace``), then deletes older ones; a store opened on a
    folder that already holds a snapshot sees it (``clear()`` it when stale). Give each rank its own directory.
    """

    _NAME = re.compile(r"^snapshot-(\d+)\.pt$")

    def __init__(self, storage: str = "memory", directory: str | os.PathLike[str] | None = None) -> None:
        if storage not in STORAGES:
            raise ValueError(f"snapshot storage must be one of {', '.join(STORAGES)}, got {storage!r}")
        if storage == "disk" and directory is None:
            raise ValueError("snapshot storage 'disk' needs a directory (one per rank)")
        self.storage = storage
        self.directory = Path(directory) if directory is not None else None
        self._memory: tuple[int, Any] | None = None
        self.last_error: BaseException | None = None  # the last save's error on this rank (``save``)

    def _files(self) -> list[tuple[int, Path]]:
        assert self.directory is not None
        if not self.directory.is_dir():
            return []
        found = [(self._NAME.match(p.name), p) for p in self.directory.iterdir()]
        return sorted((int(m.group(1)), p) for m, p in found if m)

    def save(self, step: int, payload: dict[str, Any], agree: Callable[[bool], bool] | None = None) -> bool:
        """Keep ``payload`` as the snapshot of ``step``; True when it is now the latest. ``disk``: written to a temp
        file, then ``agree(this rank wrote it)`` (True: every rank did; one collective) decides: published by a rename
        and the older ones deleted, or (a rank could not write, e.g. a full disk) the temp file removed and the
        previous snapshot kept as it was (``last_error``: this rank's error, None when another rank's write failed)."""
        self.last_error = None
        if self.storage == "memory":
            self._memory = (int(step), cpu_copy(payload))
            return True
        assert self.directory is not None
        tmp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".snapshot-", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                torch.save({"version": 1, "step": int(step), "payload": payload}, f)
                f.flush()
                os.fsync(f.fileno())
        except Exception as exc:  # any writer error (OSError, torch's RuntimeError) is a failed write
            self.last_error = exc
        except BaseException:  # an interrupt: no temp file left behind
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise
        written = (self.last_error is None) if agree is None else agree(self.last_error is None)
        if not written or self.last_error is not None:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if agree is None and self.last_error is not None:
                raise self.last_error
            return False
        assert tmp is not None
        final = self.directory / f"snapshot-{int(step):012d}.pt"
        os.replace(tmp, final)  # atomic on POSIX within one filesystem
        for _, path in self._files():
            if path != final:
                path.unlink(missing_ok=True)
        return True

    def load(self) -> tuple[int, dict[str, Any]]:
        if self.storage == "memory":
            if self._memory is None:
                raise LookupError("no snapshot has been saved in memory yet")
            return self._memory[0], cpu_copy(self._memory[1])
        files = self._files()
        if not files:
            raise LookupError(f"no snapshot in {self.directory}")
        # weights_only=False: our own file, and payloads hold numpy RNG states
        data = torch.load(files[-1][1], map_location="cpu", weights_only=False)
        return int(data["step"]), data["payload"]

    def clear(self) -> None:
        self._memory = None
        if self.storage == "disk" and self.directory is not None and self.directory.is_dir():
            for path in self.directory.iterdir():
                if self._NAME.match(path.name) or (path.name.startswith(".snapshot-") and path.suffix == ".tmp"):
                    path.unlink(missing_ok=True)


class RollbackLimitError(RuntimeError):
    """Rollbacks keep happening: restoring the snapshot does not remove the cause."""


class RollbackPolicy:
    """Counts rollbacks, sets the recovery learning-rate factor, stops the run after too many in a window.

    ``step`` is the optimizer-step counter the trainer continues from after the rollback (the same counter is
    then passed to ``lr_factor``/``recovery_active``).
    """

    def __init__(self, config: RollbackConfig | None = None) -> None:
        self.config = config or RollbackConfig()
        self.rollbacks = 0
        self.last_step: int | None = None
        self.recent: list[tuple[int, str]] = []  # (step, cause) within rollback_window of the latest rollback
        self.repairs = 0
        self.repaired_entries = 0
        self.last_repair: int | None = None

    def refuse_repair(self, step: int, bad_weights: int, bad_entries: int, entries: int) -> str | None:
        """Why a failed check at ``step`` must roll back rather than repair the moments in place (None: repair).

        ``bad_weights``: non-finite weight tensors; ``bad_entries`` / ``entries``: non-finite and all moment entries
        (all ranks)."""
        cfg = self.config
        if not cfg.repair_state:
            return "guards.opefo.rollback.repair_state is off"
        if bad_weights:
            return "the weights are not finite (a repair only resets optimizer moments)"
        if bad_entries == 0:
            return "nothing to repair"
        if bad_entries > cfg.repair_max_share * entries:
            return (
                f"{bad_entries} of {entries} moment entries are not finite, more than "
                f"guards.opefo.rollback.repair_max_share={cfg.repair_max_share}"
            )
        if self.last_repair is not None and step - self.last_repair < cfg.recovery_steps:
            since = step - self.last_repair
            return f"the moments went non-finite again {since} steps after the repair at step {self.last_repair}"
        return None

    def record_repair(self, step: int, entries: int) -> None:
        self.repairs += 1
        self.repaired_entries += int(entries)
        self.last_repair = int(step)

    def record(self, step: int, cause: str) -> None:
        """Register a rollback at ``step``; raises RollbackLimitError when more than ``max_rollbacks`` rollbacks
        fall within the last ``rollback_window`` steps (this one included)."""
        cfg = self.config
        self.rollbacks += 1
        self.last_step = int(step)
        self.recent = [(s, c) for s, c in self.recent if step - s < cfg.rollback_window] + [(int(step), cause)]
        if len(self.recent) > cfg.max_rollbacks:
            steps = ", ".join(str(s) for s, _ in self.recent)
            raise RollbackLimitError(
                f"step {step}: rollback #{self.rollbacks} (cause: {cause}) makes {len(self.recent)} rollbacks within "
                f"{cfg.rollback_window} steps (at steps {steps}; max_rollbacks={cfg.max_rollbacks}). "
                "Restoring the last snapshot does not remove the cause: check the rewards, log-probs and loss for "
                "NaN/inf, lower the learning rate, or resume from an earlier checkpoint with another seed"
            )

    def recovery_active(self, step: int) -> bool:
        return self.config.enabled and self.last_step is not None and step < self.last_step + self.config.recovery_steps

    def lr_factor(self, step: int) -> float:
        """``recovery_lr_factor`` during the recovery period after the last rollback, else 1.0."""
        return self.config.recovery_lr_factor if self.recovery_active(step) else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "rollbacks": self.rollbacks,
            "last_step": self.last_step,
            "recent": [list(r) for r in self.recent],
            "repairs": self.repairs,
            "repaired_entries": self.repaired_entries,
            "last_repair": self.last_repair,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollbacks = int(state["rollbacks"])
        self.last_step = None if state["last_step"] is None else int(state["last_step"])
        self.recent = [(int(s), str(c)) for s, c in state["recent"]]
        self.repairs = int(state["repairs"])
        self.repaired_entries = int(state["repaired_entries"])
        self.last_repair = None if state["last_repair"] is None else int(state["last_repair"])
