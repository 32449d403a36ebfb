"""The step end's optimizer-state recovery (``guards.opefo``; docs/DESIGN.md, the "OPEFO" sections): the
second-moment floor, the health check, an in-place repair of the moments or a rollback to the last snapshot (LR cut
for ``recovery_steps``; step, data, schedule and RNG go forward), and the snapshots. A snapshot holds once what the
ranks share: the trainable weights (equal on every rank) on the first rank only, the Adam state there too under DDP
(replicas) and on every rank under ZeRO (each its partition); a rollback broadcasts the rest from the first rank, so
at 7B on 8 ranks a disk or memory snapshot is one copy of the weights, not eight. It works on the innermost torch
optimizer: all moments under DDP (equal on all ranks: the floor runs locally), this rank's fp32 partitions under
ZeRO-2 (the floor and error feedback, which it makes for the step gate, reduce over ranks); the checks always reduce.
Observe mode: the same decisions, counted as ``opefo/would_*``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from steadyrl.guards.error_feedback import ErrorFeedback
from steadyrl.guards.moment_floor import SecondMomentFloor
from steadyrl.guards.opefo import OpefoConfig
from steadyrl.guards.optimizer_state import (
    distributed_ops,
    nonfinite_moment_entries,
    optimizer_device,
    optimizer_state_finite,
    repair_moments,
)
from steadyrl.guards.rollback import RollbackPolicy, SnapshotStore
from steadyrl.metrics import (
    EVENT_ROLLBACK,
    EVENT_STATE_REPAIR,
    OPEFO_EF_PENDING,
    OPEFO_FLOOR_RAISED_FRAC_PREFIX,
    OPEFO_FLOOR_TRIGGERED,
    OPEFO_RECOVERY_ACTIVE,
    OPEFO_REPAIRED_ENTRIES,
    OPEFO_REPAIRS,
    OPEFO_ROLLBACKS,
    OPEFO_SNAPSHOT_FAILURES,
    OPEFO_WOULD_FEED_BACK,
    OPEFO_WOULD_FLOOR_ENTRIES,
    OPEFO_WOULD_REPAIR,
    OPEFO_WOULD_ROLLBACK,
)
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.context import RuntimeContext, StepNotes, identity

logger = logging.getLogger("steadyrl.opefo")


def optimizer_chain(optimizer: Any) -> list[Any]:
    """The optimizer and every optimizer it wraps (accelerate wrapper -> DeepSpeed ZeRO -> torch AdamW)."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None and chain[-1].optimizer is not chain[-1]:
        chain.append(chain[-1].optimizer)
    return chain


def restore_payload(
    payload: dict[str, Any], trainable: list[tuple[str, torch.nn.Parameter]], base: Any, zero: Any
) -> None:
    """Copy a snapshot's trainable tensors (and ZeRO's fp32 partitions) back and load its optimizer state into the
    innermost optimizer ``base``. The schedule is not rewound: each param group's current LR (and other scheduled
    values) stay, not the snapshot's."""
    with torch.no_grad():
        for name, p in trainable:
            p.copy_(payload["params"][name].to(p.device))
        partitions = zero.single_partition_of_fp32_groups if zero is not None else []
        for live, saved in zip(partitions, payload.get("fp32_partitions", []), strict=True):
            live.copy_(saved.to(live.device))
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]
    base.load_state_dict(payload["optimizer"])
    for group, current in zip(base.param_groups, hyper, strict=True):
        group.update(current)


def _cause(bad_weights: int, state_ok: bool) -> str:
    weights = f"non-finite parameters ({bad_weights} tensor(s) over all ranks)" if bad_weights else ""
    state = "" if state_ok else "non-finite optimizer state (exp_avg / exp_avg_sq)"
    return " and ".join(c for c in (weights, state) if c)


def keeps_adam_moments(optimizer: Any) -> bool:
    """Whether the innermost optimizer keeps Adam's per-parameter ``exp_avg`` / ``exp_avg_sq`` (what OPEFO reads);
    DeepSpeed's FusedAdam and DeepSpeedCPUAdam keep torch's state layout."""
    adam = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
    return adam or type(optimizer).__name__ in ("FusedAdam", "DeepSpeedCPUAdam")


class SnapshotWriteError(RuntimeError):
    """OPEFO's first disk snapshot could not be written (the message names the folder and the fix)."""


class StateRecovery:
    """Floor, check, repair, rollback and snapshots after each optimizer step; the error-feedback residual is per
    rank (``rank_state_dict``). ``observe``: decide and count only; ``notes``: who asks for a check this step."""

    def __init__(self, config: OpefoConfig, observe: bool = False, notes: StepNotes | None = None) -> None:
        self.config = config
        self.notes = notes if notes is not None else StepNotes()
        self.observe = observe
        self.would = {"rollback": 0, "repair": 0, "floor_entries": 0, "feed_back": 0}  # observe mode's counts
        self.policy = RollbackPolicy(config.rollback)
        self._reduce_partitioned = self._reduce_all = identity  # the collectives are bound in ``attach``
        self.floor = SecondMomentFloor(config.floor, reduce_sum=lambda t: self._reduce_partitioned(t))
        self.feedback = ErrorFeedback(config.error_feedback, reduce_sum=lambda t: self._reduce_partitioned(t))
        self.store: SnapshotStore | None = None
        self.snapshot_step: int | None = None  # the step of the snapshot a rollback returns to
        self.snapshot_failures = 0  # snapshots a rank could not write (the previous one kept)
        self.ctx, self.guards = RuntimeContext(), GuardState()
        self._named_parameters: Callable[[], Iterable[tuple[str, torch.nn.Parameter]]] = lambda: []
        self.base: torch.optim.Optimizer | None = None
        self.zero: Any = None
        self._first_rank_holds: bool | None = None  # launched together: the first rank holds the shared part
        self._pending_repair = 0  # entries (all ranks) counted by the last _refuse_repair

    def attach(
        self, ctx: RuntimeContext, optimizer: Any, named_parameters: Callable[[], Iterable[tuple[str, Any]]],
        output_dir: str, guards: GuardState,
    ) -> None:  # fmt: skip
        """Bind to the prepared optimizer (at train begin, after any resume) and take the first snapshot.
        ``guards``: the guard states a snapshot holds and a rollback restores (all but this one's)."""
        self.ctx, self._named_parameters, self.guards = ctx, named_parameters, guards
        chain = optimizer_chain(optimizer)
        self.base = chain[-1]
        if not keeps_adam_moments(self.base):
            raise TypeError(
                f"guards.opefo checks and floors Adam's fp32 moments (exp_avg, exp_avg_sq), but the optimizer is "
                f"{type(self.base).__module__}.{type(self.base).__name__}, whose state it cannot read (a NaN in it "
                "would be reported finite). Use AdamW (trainer.optim=adamw_torch) or set guards.opefo.enabled=false"
            )
        self.zero = next((o for o in chain if hasattr(o, "single_partition_of_fp32_groups")), None)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            reduce_sum, _ = distributed_ops()
            self._reduce_all = reduce_sum
            self._first_rank_holds = torch.distributed.get_rank() == 0
            if self.zero is not None:  # ZeRO partitions differ per rank; DDP replicas are equal (no collective)
                self._reduce_partitioned = reduce_sum
        rb = self.config.rollback
        if self.observe:
            logger.info(
                "OPEFO observe mode: the floor, error feedback and rollback only count what they would do "
                "(opefo/would_*); no snapshot is taken"
            )
        elif rb.enabled:
            directory = None
            if rb.storage == "disk":
                base = Path(rb.snapshot_dir) if rb.snapshot_dir else Path(output_dir) / "opefo_snapshots"
                directory = base / f"rank{ctx.rank}"
            self.store = SnapshotStore(rb.storage, directory)
            self.store.clear()  # a snapshot from an earlier run of this output_dir is not this run's state
            if not self._snapshot(ctx.global_step()):
                raise SnapshotWriteError(
                    f"OPEFO could not write its first snapshot to {directory} ({self._snapshot_cause()}): a rollback "
                    "would have nothing to return to. Free space there, set guards.opefo.rollback.snapshot_dir to "
                    "another disk, or guards.opefo.rollback.storage: memory"
                )

    def on_step_end(self) -> float | None:
        """Floor, check, then repair, roll back or snapshot. Returns the recovery factor of the learning rate (1.0
        outside a recovery; None when rollback is off or observing)."""
        step = self.ctx.global_step()
        rb = self.config.rollback
        if self.config.floor.enabled:
            self._floor(step)
        if rb.enabled:
            due = step % rb.check_interval == 0 or step % rb.snapshot_interval == 0
            if self.notes.check_now is not None or due:
                bad_weights, state_ok = self._health()
                if bad_weights or not state_ok:
                    trigger = f" after a {self.notes.check_now}" if self.notes.check_now else ""
                    cause = _cause(bad_weights, state_ok) + trigger
                    refusal = self._refuse_repair(step, bad_weights, state_ok)
                    if self.observe:  # the state is never repaired here: every check that finds it bad counts
                        self._count_would("repair" if refusal is None else "rollback", step, cause)
                    elif refusal is None:
                        self._repair(step, cause)
                    else:
                        self._roll_back(step, cause, refusal)
                elif step % rb.snapshot_interval == 0 and not self.observe and not self._snapshot(step):
                    self.snapshot_failures += 1
                    logger.warning(
                        "step %d: OPEFO's snapshot was not written (%s); the snapshot of step %s stays the rollback "
                        "point. Free space on %s or set guards.opefo.rollback.storage: memory",
                        step,
                        self._snapshot_cause(),
                        self.snapshot_step,
                        self.store.directory,
                    )
            self.notes.check_now = None
            self._log_counters(step)
        if self.observe:
            if self.config.error_feedback.enabled:
                self.ctx.log_metric(OPEFO_WOULD_FEED_BACK, float(self.would["feed_back"]))
            return None
        self.ctx.log_metric(OPEFO_EF_PENDING, float(self.feedback.pending))
        return self.policy.lr_factor(step) if rb.enabled else None  # recovery_steps steps after a rollback

    def _floor(self, step: int) -> None:
        """The second-moment floor on its schedule; observe mode counts the entries it would raise."""
        metrics = self.floor.maybe_apply(self.base, step, apply=not self.observe)
        if not self.observe:
            self.ctx.log_metrics(metrics)
            return
        if metrics:
            self.would["floor_entries"] += self.floor.last_raised
            decided = (OPEFO_FLOOR_TRIGGERED, OPEFO_FLOOR_RAISED_FRAC_PREFIX)  # what it would have done: counted
            self.ctx.log_metrics({k: v for k, v in metrics.items() if not k.startswith(decided)})
        self.ctx.log_metric(OPEFO_WOULD_FLOOR_ENTRIES, float(self.would["floor_entries"]))

    def _count_would(self, what: str, step: int, cause: str) -> None:
        self.would[what] += 1
        if self.would["rollback"] + self.would["repair"] == 1:
            logger.warning(
                "step %d: observe mode: OPEFO would %s here (cause: %s); training goes on with the non-finite "
                "state, as without OPEFO", step, "repair the moments in place" if what == "repair" else "roll back",
                cause,
            )  # fmt: skip

    def _snapshot(self, step: int) -> bool:
        """Save this step's snapshot; True when it is the latest now. Every rank agrees first (one reduce): no rank
        publishes a snapshot of a step another rank could not write, so a rollback restores one step on all ranks."""
        home = optimizer_device(self.base)  # where _health's collectives run too (NCCL: not the CPU)
        agree = lambda ok: int(self._reduce_all(torch.tensor([0.0 if ok else 1.0], device=home)).item()) == 0  # noqa: E731
        assert self.store is not None
        if self.store.save(step, self._payload(), agree=agree):
            self.snapshot_step = step
            return True
        return False

    def _snapshot_cause(self) -> str:
        error = self.store.last_error if self.store is not None else None
        return "another rank's write failed" if error is None else f"{type(error).__name__}: {error}"

    def _log_counters(self, step: int) -> None:
        rb, policy = self.config.rollback, self.policy
        if self.observe:
            self.ctx.log_metric(OPEFO_WOULD_ROLLBACK, float(self.would["rollback"]))
            if rb.repair_state:
                self.ctx.log_metric(OPEFO_WOULD_REPAIR, float(self.would["repair"]))
            return
        self.ctx.log_metric(OPEFO_ROLLBACKS, float(policy.rollbacks))
        if rb.storage == "disk":
            self.ctx.log_metric(OPEFO_SNAPSHOT_FAILURES, float(self.snapshot_failures))
        if rb.repair_state:
            self.ctx.log_metric(OPEFO_REPAIRS, float(policy.repairs))
            self.ctx.log_metric(OPEFO_REPAIRED_ENTRIES, float(policy.repaired_entries))
        self.ctx.log_metric(OPEFO_RECOVERY_ACTIVE, float(policy.recovery_active(step)))

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self._named_parameters() if p.requires_grad]

    def _health(self) -> tuple[int, bool]:
        """(non-finite trainable weight tensors over all ranks, whether every rank's Adam moments are finite)."""
        params = self._trainable()
        bad = torch.zeros(1, dtype=torch.float64, device=params[0][1].device if params else "cpu")
        with torch.no_grad():
            for _, p in params:
                lo, hi = torch.aminmax(p.detach())
                bad += (~(torch.isfinite(lo) & torch.isfinite(hi))).to(bad.device, torch.float64)
        bad_params = int(self._reduce_all(bad).item())
        return bad_params, optimizer_state_finite(self.base, reduce_sum=self._reduce_all)

    def _refuse_repair(self, step: int, bad_weights: int, state_ok: bool) -> str | None:
        """Why this failed check rolls back instead of repairing in place; None: repair. Equal on every rank."""
        if not self.config.rollback.repair_state or bad_weights or state_ok:
            return self.policy.refuse_repair(step, bad_weights, 0 if state_ok else 1, 1)
        local = nonfinite_moment_entries(self.base)
        counts = torch.tensor([local[0], local[1], float(local[0]) ** 2], dtype=torch.float64)
        bad, total, squares = self._reduce_all(counts.to(optimizer_device(self.base))).tolist()
        replicas = self.zero is None and torch.distributed.is_available() and torch.distributed.is_initialized()
        if replicas:  # DDP: each rank holds the whole state; a repair must leave the replicas equal
            world = torch.distributed.get_world_size()
            if bad * bad != world * squares:  # equal local counts <=> (sum b)^2 == world x sum b^2
                return "the ranks' optimizer replicas hold different numbers of non-finite entries"
            bad, total = bad / world, total / world
        self._pending_repair = int(bad)
        return self.policy.refuse_repair(step, bad_weights, int(bad), int(total))

    def _repair(self, step: int, cause: str) -> None:
        """Reset the non-finite moment entries in place; everything else stays as it is."""
        repaired = repair_moments(self.base)
        entries = self._pending_repair
        self.policy.record_repair(step, entries)
        logger.warning(
            "step %d: OPEFO repaired %d non-finite Adam moment entr%s in place (cause: %s; first moment 0, second "
            "moment the largest finite one of its tensor); no rollback, learning rate unchanged",
            step, entries, "y" if entries == 1 else "ies", cause,
        )  # fmt: skip
        self.ctx.emit_event(EVENT_STATE_REPAIR, cause=cause, entries=entries, local_entries=repaired)
        self.notes.check_now = "repair"  # the next step's check confirms the state is finite

    def _payload(self) -> dict[str, Any]:
        """The guard states; the weights (and, replicated, the Adam state) unless another rank holds them; under
        ZeRO this rank's Adam and fp32 master partitions."""
        payload: dict[str, Any] = {"guards": self.guards.snapshot_state_dicts(self)}
        if self._first_rank_holds is not False:
            payload["params"] = {n: p.detach() for n, p in self._trainable()}
        if self.zero is not None or self._first_rank_holds is not False:
            payload["optimizer"] = self.base.state_dict()
        if self.zero is not None:
            payload["fp32_partitions"] = [t.detach() for t in self.zero.single_partition_of_fp32_groups]
        return payload

    def _restore(self, payload: dict[str, Any]) -> None:
        """A snapshot's payload back into the live weights and optimizer; launched together, what the first rank
        holds alone is broadcast from it (every rank calls this at the same rollback)."""
        trainable, dist = self._trainable(), torch.distributed
        if self._first_rank_holds is not None and self.zero is None:  # DDP: the replicas' Adam state, from rank 0
            shared = [payload.get("optimizer")]
            dist.broadcast_object_list(shared, src=0, device=optimizer_device(self.base))
            payload["optimizer"] = shared[0]
        restore_payload(payload, trainable if "params" in payload else [], self.base, self.zero)
        if self._first_rank_holds is not None:
            with torch.no_grad():
                for _, p in trainable:
                    dist.broadcast(p.data, src=0)

    def _roll_back(self, step: int, cause: str, refusal: str | None = None) -> None:
        assert self.store is not None
        snap_step, payload = self.store.load()
        self.policy.record(step, cause)  # raises RollbackLimitError past max_rollbacks within the window
        self._restore(payload)
        self.guards.load_guard_state_dicts(payload["guards"], exclude=self)
        self.feedback.clear()
        rb = self.config.rollback
        why = f"; not repaired in place: {refusal}" if rb.repair_state and refusal else ""
        logger.warning(
            "step %d: OPEFO rollback #%d to the snapshot of step %d (cause: %s%s); learning rate x%g for %d steps",
            step, self.policy.rollbacks, snap_step, cause, why, rb.recovery_lr_factor, rb.recovery_steps,
        )  # fmt: skip
        self.ctx.emit_event(EVENT_ROLLBACK, cause=cause, snapshot_step=snap_step)

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "floor": self.floor.state_dict(), "would": dict(self.would)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.floor.load_state_dict(state["floor"])
        self.would.update({k: int(v) for k, v in state.get("would", {}).items()})  # absent before observe mode

    def rank_state_dict(self) -> dict[str, Any]:
        return {"feedback": self.feedback.state_dict()}

    def load_rank_state_dict(self, state: dict[str, Any]) -> None:
        self.feedback.load_state_dict(state["feedback"])
