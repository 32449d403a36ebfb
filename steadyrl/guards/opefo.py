"""OPEFO optimizer-state protection (docs/DESIGN.md, the "OPEFO" sections): pure torch over an optimizer's state.

Works on any ``torch.optim.Optimizer`` whose state holds ``exp_avg``/``exp_avg_sq`` (torch AdamW; under DeepSpeed
ZeRO-2 pass the base optimizer, whose params are one flat fp32 partition per param group, a different slice on each
rank). Nothing here knows about processes: every cross-rank operation goes through two injected callables,
``reduce_sum(t) -> t summed over ranks`` and ``all_gather(t) -> 1-D tensors of any lengths concatenated in rank
order``, both the identity by default (one process). ``distributed_ops()`` builds them from ``torch.distributed``.
Every collective is called the same number of times on every rank, with tensors on the device of the optimizer
state (or of the gradients); every decision comes from reduced values, so all ranks decide the same (the floor's
from state that is equal on every DDP replica or owned by one ZeRO rank).

Three pieces, with the original design's numbers as defaults:

1. ``SecondMomentFloor``: every ``interval`` = 100 steps, per state tensor (one parameter's ``exp_avg_sq``; under
   ZeRO-2 this rank's flat partition of a param group), the fraction of entries that underflowed: whose v cannot
   explain their m, ``|m| > C (sqrt(v) + eps)`` with C = 7.27 the Cauchy-Schwarz bound for betas (0.9, 0.999)
   (``moment_floor.consistency_bound``); the seed counts ``v <= 1e-20``, which also fires on never-touched entries
   (m = v = 0, a zero step) and on tiny consistent ones. Above ``trigger_frac`` = 1 %, the tensor's live entries
   (m != 0) below its own p10 are raised to it, so
   ``lr * m / (sqrt(v) + eps)`` cannot take a huge step where v underflowed. Deviation from the seed, which floors
   at the param group's p10: a group spans tensors whose second moments differ by orders of magnitude, and a
   group-wide p10 raised a half-zeroed tensor to ~2,800x below its own level (its weights then moved ~500x more
   than without the fault). The percentile is exact up to ``sample_size`` = 65536 entries, else estimated from a
   random sample of that many (a ``torch.Generator`` seeded with ``seed + step``: the same on every DDP replica and
   after resume). Accuracy: for n iid draws the rank of the sample p-quantile has standard deviation
   sqrt(p(1-p)/n); p = 0.1, n = 65536 gives 0.00117, so the floor sits at the 10th percentile +-0.12 percentile
   points (1 sigma). Deviation from the seed, on by default (``exclude_tiny``): the percentile is taken over the
   entries above ``tiny`` (finite ones), because the original rule's literal p10 over all entries is itself ~0
   once more than 10 % underflowed, which switches the floor off exactly when it is most needed;
   ``exclude_tiny=False`` gives the literal rule. No decision needs a collective (DDP replicas are equal, a ZeRO
   partition is one rank's); the counts for the metrics are summed once per check.
2. ``ErrorFeedback``: the gradient of a step GEPO skipped is kept as a residual r and fed back over the next 4
   taken steps with weights 0.3, 0.3, 0.2, 0.2, each piece renormalised to the current gradient's scale:
   ``g += w_k * ||g|| * r / ||r||`` (global norms), so a norm-20 residual cannot become a new spike in a norm-2
   gradient. Only r's direction is used. A second skip while r is pending merges: the not-yet-injected fraction R
   of the old direction plus the new one, ``r <- R * r_old / ||r_old|| + g_new / ||g_new||``, computed in place,
   and the 4-step schedule restarts. Why merge, not replace: replacing drops the old, not-yet-injected signal for
   no reason; merging keeps both directions, each in proportion to what it had left, while every injected piece
   stays at most ``w_k * ||g||`` (the safety bound), at the price that the total fed back is 1 ||g|| rather than
   R + 1. Memory: one copy of this rank's gradients in their own dtype while pending (all trainable parameters
   under DDP, e.g. 28 GB for 7B fp32 grads; this rank's 1/world partition under ZeRO-2); nothing otherwise.
3. Rollback support: ``optimizer_state_finite`` (one ``aminmax`` per state tensor, reduced over ranks),
   ``SnapshotStore`` (a healthy snapshot every ``snapshot_interval`` = 500 steps, in memory or on disk written
   to a temp file and ``os.replace``d), and ``RollbackPolicy`` (after a rollback the learning rate is
   scaled by 0.3 for 100 steps; more than ``max_rollbacks`` within ``rollback_window`` steps stops the run).

What this simplifies or leaves out: under ZeRO-2 the floor's unit is a rank's flat partition, which mixes the
tensors of a param group (their boundaries are not read from DeepSpeed); its partition's alignment padding has
m = v = 0 and is never counted; its sample is drawn with replacement; NaN/inf state entries are neither counted,
sampled nor repaired (that is the rollback's job) and stay NaN/inf. Error feedback never offloads its residual to
the CPU, and a gradient norm whose sum of squares overflows counts as non-finite. Deciding *when* to skip, check,
snapshot or roll back, and restoring the payload into model/optimizer/scheduler, is the trainer's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from steadyrl.guards.error_feedback import ErrorFeedback, ErrorFeedbackConfig
from steadyrl.guards.moment_floor import FloorConfig, SecondMomentFloor
from steadyrl.guards.optimizer_state import AllGather, ReduceSum, distributed_ops, optimizer_state_finite
from steadyrl.guards.rollback import STORAGES, RollbackConfig, RollbackLimitError, RollbackPolicy, SnapshotStore


@dataclass
class OpefoConfig:
    enabled: bool = False
    floor: FloorConfig = field(default_factory=FloorConfig)
    error_feedback: ErrorFeedbackConfig = field(default_factory=ErrorFeedbackConfig)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)


__all__ = [
    "STORAGES",
    "AllGather",
    "ErrorFeedback",
    "ErrorFeedbackConfig",
    "FloorConfig",
    "OpefoConfig",
    "ReduceSum",
    "RollbackConfig",
    "RollbackLimitError",
    "RollbackPolicy",
    "SecondMomentFloor",
    "SnapshotStore",
    "distributed_ops",
    "optimizer_state_finite",
]
