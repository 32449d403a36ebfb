"""OPEFO in a real tiny GRPO run: rollback after a corrupted Adam moment, error feedback, exact resume."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoTokenizer, TrainerCallback

from steadyrl.faults import CorruptOptimizerState
from steadyrl.guards import moment_floor
from steadyrl.guards.base import StepDecision
from steadyrl.guards.error_feedback import ErrorFeedbackConfig
from steadyrl.guards.moment_floor import FloorConfig
from steadyrl.guards.opefo import OpefoConfig
from steadyrl.guards.rollback import RollbackConfig
from steadyrl.guards.spike import SpikeConfig, SpikeGuard
from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.layers import GuardParts
from steadyrl.trainers.recovery import optimizer_chain
from tests.integration.helpers import assert_same_weights, byte_mean, grpo_args, per_step, small_dataset, weights

pytestmark = pytest.mark.slow


class SkipAt:
    """A step guard that vetoes the given steps (finite gradients: error feedback keeps them)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def decide(self, grad_norm, step):
        return StepDecision(True, "test") if step in self.steps else StepDecision.proceed()

    def on_skip(self, gradients, decision, step):
        pass


class AfterGuards(TrainerCallback):
    """Records each step as it stands after steadyrl's own step-end work (rollback included)."""

    def __init__(self):
        self.weights, self.lrs, self.moments = [], [], []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.weights.append(weights(model))
        self.lrs.append([g["lr"] for g in optimizer.param_groups])
        base = optimizer_chain(optimizer)[-1]
        self.moments.append(copy.deepcopy({k: dict(v) for k, v in base.state_dict()["state"].items()}))


def _trainer(model_dir, out, guards, opefo=None, callbacks=(), **args):
    trainer = SteadyGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(out, **{"max_grad_norm": 1.0, "lr_scheduler_type": "constant", **args}),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        guards=GuardParts(step_guards=guards, opefo=opefo),
        callbacks=[after := AfterGuards(), *callbacks],  # before any fault injector: sees the step as guarded
    )
    return trainer, after


def _opefo(**rollback):
    rb = dict(snapshot_interval=2, check_interval=1, recovery_steps=2, recovery_lr_factor=0.3, **rollback)
    ef = ErrorFeedbackConfig(enabled=True)  # off by default; these tests watch it
    return OpefoConfig(enabled=True, floor=FloorConfig(enabled=False), error_feedback=ef, rollback=RollbackConfig(**rb))


def test_inf_in_exp_avg_sq_rolls_back_and_recovers(tiny_model_dir, tmp_path, caplog):
    """inf written into exp_avg_sq after step 2 (after its snapshot): step 3's check finds it, and weights and
    Adam moments return to the step-2 snapshot, the
    LR runs at 0.3x for the next 2 steps, the run ends finite. Without OPEFO the inf stays in the moment forever."""
    fault = CorruptOptimizerState(step=2, value=float("inf"))
    opefo = _opefo(repair_state=False)  # the rollback path (one bad entry would otherwise be repaired in place)
    guards = [SpikeGuard(SpikeConfig(min_ratio=float("inf")))]
    trainer, after = _trainer(tiny_model_dir, tmp_path / "opefo", guards, opefo, [fault], max_steps=6)
    with caplog.at_level(logging.WARNING, logger="steadyrl.opefo"):
        trainer.train()
    opefo = trainer.step_end.recovery
    assert fault.fired and opefo.policy.rollbacks == 1
    (line,) = [r.getMessage() for r in caplog.records if "OPEFO rollback" in r.getMessage()]
    assert line.startswith("step 3: OPEFO rollback #1 to the snapshot of step 2 (cause: non-finite optimizer state")
    # after step 3's work (index 2) the state is the step-2 snapshot (index 1): weights and every moment
    assert_same_weights(after.weights[2], after.weights[1])
    for pid, state in after.moments[1].items():
        assert all(torch.equal(t, after.moments[2][pid][k]) for k, t in state.items()), pid
    # recovery: LR x0.3 for steps 4 and 5 (set at the ends of steps 3 and 4), back to 1e-3 for step 6
    assert [round(lrs[0], 8) for lrs in after.lrs] == [1e-3, 1e-3, 3e-4, 3e-4, 1e-3, 1e-3]
    assert any(not torch.equal(v, after.weights[3][k]) for k, v in after.weights[2].items()), "training went on"
    assert all(torch.isfinite(v).all() for v in after.weights[-1].values())
    base = optimizer_chain(trainer.optimizer)[-1]
    assert all(torch.isfinite(s["exp_avg_sq"]).all() for s in base.state.values())
    history = trainer.state.log_history
    assert per_step(history, "opefo/rollbacks") == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert per_step(history, "opefo/recovery_active") == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]

    plain_fault = CorruptOptimizerState(step=2, value=float("inf"))
    plain, _ = _trainer(tiny_model_dir, tmp_path / "plain", [], None, [plain_fault], max_steps=6)
    plain.train()
    plain_base = optimizer_chain(plain.optimizer)[-1]
    assert any(torch.isinf(s["exp_avg_sq"]).any() for s in plain_base.state.values())


def test_inf_in_exp_avg_sq_is_repaired_in_place_with_no_lost_step_and_no_lr_cut(tiny_model_dir, tmp_path, caplog):
    """The default: the same inf (one entry of the whole state, finite weights) is reset at step 3's check, in the
    optimizer the trainer steps: first moment 0, second moment the largest finite one of its tensor. Step 3's update
    is kept (no rollback), the LR never leaves 1e-3, every other entry is the one Adam computed, the run ends
    finite."""
    fault = CorruptOptimizerState(step=2, value=float("inf"))
    opefo = _opefo()
    guards = [SpikeGuard(SpikeConfig(min_ratio=float("inf")))]
    trainer, after = _trainer(tiny_model_dir, tmp_path / "repair", guards, opefo, [fault], max_steps=6)
    with caplog.at_level(logging.WARNING, logger="steadyrl.opefo"):
        trainer.train()
    opefo = trainer.step_end.recovery
    assert fault.fired and opefo.policy.rollbacks == 0 and opefo.policy.repairs == 1
    (line,) = [r.getMessage() for r in caplog.records if "OPEFO repaired" in r.getMessage()]
    assert line.startswith("step 3: OPEFO repaired 1 non-finite Adam moment entry in place")
    assert [round(lrs[0], 8) for lrs in after.lrs] == [1e-3] * 6
    assert any(not torch.equal(v, after.weights[1][k]) for k, v in after.weights[2].items()), "step 3 was kept"
    pid = next(iter(after.moments[2]))  # the fault's entry: the first element of the first state's exp_avg_sq
    repaired = after.moments[2][pid]
    rest = repaired["exp_avg_sq"].reshape(-1)[1:]
    assert repaired["exp_avg_sq"].reshape(-1)[0] == rest.max() and repaired["exp_avg"].reshape(-1)[0] == 0.0
    base = optimizer_chain(trainer.optimizer)[-1]
    assert all(torch.isfinite(t).all() for s in base.state.values() for t in s.values() if t.is_floating_point())
    history = trainer.state.log_history
    assert per_step(history, "opefo/repairs") == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert per_step(history, "opefo/rollbacks") == [0.0] * 6


def test_recovery_lr_factor_scales_the_current_schedule_not_the_snapshot(tiny_model_dir, tmp_path):
    """Linear decay over 6 steps, rollback at step 3 to the step-2 snapshot: the recovery steps 4 and 5 run at 0.3 x
    the schedule's LR of *their* step (restoring the snapshot's optimizer state must not bring back its LR)."""
    fault = CorruptOptimizerState(step=2, value=float("inf"))
    guards = [SpikeGuard(SpikeConfig(min_ratio=float("inf")))]
    trainer, after = _trainer(
        tiny_model_dir,
        tmp_path / "linear",
        guards,
        _opefo(repair_state=False),
        [fault],
        max_steps=6,
        lr_scheduler_type="linear",
    )
    trainer.train()
    assert trainer.step_end.recovery.policy.rollbacks == 1
    schedule = [1e-3 * (6 - k) / 6 for k in range(1, 7)]  # the LR set after step k, for step k + 1
    expected = [lr * (0.3 if k in (3, 4) else 1.0) for k, lr in enumerate(schedule, start=1)]
    assert [lrs[0] for lrs in after.lrs] == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_error_feedback_reinjects_a_skipped_gradient_and_rejects_a_nonfinite_one(tiny_model_dir, tmp_path):
    """Step 1: inf gradient -> skipped, moments untouched, nothing kept. Step 3: vetoed finite gradient -> kept
    and fed back over steps 4..7 with weights 0.3, 0.3, 0.2, 0.2."""
    opefo = _opefo()
    guards = [SpikeGuard(SpikeConfig(min_ratio=float("inf"))), SkipAt({3})]
    trainer, after = _trainer(tiny_model_dir, tmp_path / "ef", guards, opefo, max_steps=8)
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    param.register_hook(lambda g: g * float("inf") if trainer._step == 1 else g)
    trainer.train()
    # the inf step (index 1) left every Adam moment bit-identical
    for pid, state in after.moments[0].items():
        assert all(torch.equal(t, after.moments[1][pid][k]) for k, t in state.items()), pid
    opefo = trainer.step_end.recovery
    assert opefo.feedback.rejected_nonfinite == 1 and opefo.feedback.stored == 1
    history = trainer.state.log_history
    weights_used = [row.get("opefo/ef_weight", 0.0) for row in history if "loss" in row]
    assert weights_used == pytest.approx([0, 0, 0, 0, 0.3, 0.3, 0.2, 0.2])
    assert not opefo.feedback.pending and opefo.policy.rollbacks == 0


class MomentsAtStart(TrainerCallback):
    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.state = copy.deepcopy(optimizer_chain(optimizer)[-1].state_dict()["state"])


class ZeroLiveSecondMoment(TrainerCallback):
    """At the end of step ``step``: exp_avg_sq = 0 where exp_avg is largest, in every param's state (an underflow:
    a live first moment its second moment cannot explain), so the floor has something to floor."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step != self.step:
            return
        with torch.no_grad():
            for st in optimizer.optimizer.state.values():
                st["exp_avg_sq"].view(-1)[st["exp_avg"].abs().argmax()] = 0.0


def test_resume_is_exact_with_every_opefo_feature_on(tiny_model_dir, tmp_path, monkeypatch):
    """Floor (forced to trigger), error feedback pending across the checkpoint, snapshots, checks: 6 straight
    steps == 3 + resume + 3 (torch.equal), and the resumed run starts from exactly the saved Adam moments."""

    monkeypatch.setattr(moment_floor, "TINY", 1e-8)

    def opefo():
        floor = FloorConfig(interval=2, trigger_frac=0.0)
        rollback = RollbackConfig(snapshot_interval=2, check_interval=1)
        ef = ErrorFeedbackConfig(enabled=True)
        return OpefoConfig(enabled=True, floor=floor, error_feedback=ef, rollback=rollback)

    common = dict(max_steps=6, save_steps=3, save_strategy="steps", beta=0.04)
    straight, _ = _trainer(tiny_model_dir, tmp_path / "straight", [SkipAt({1})], opefo(), [ZeroLiveSecondMoment(1)],
                           **common)  # fmt: skip
    straight.train()
    history = straight.state.log_history
    assert max(per_step(history, "opefo/floor_triggered")) > 0, "the floor must really run in this test"
    checkpoint = tmp_path / "straight" / "checkpoint-3"
    rank_state = torch.load(checkpoint / "steadyrl_rank0.pt", weights_only=False)
    assert rank_state["guards"]["opefo"]["feedback"]["position"] == 1  # 1 of 4 pieces fed back

    start = MomentsAtStart()
    resumed, _ = _trainer(tiny_model_dir, tmp_path / "resumed", [SkipAt({1})], opefo(), [start], **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert_same_weights(weights(resumed.model), weights(straight.model))
    keys = ("loss", "reward", "grad_norm", "opefo/ef_weight", "opefo/floor_triggered")
    rows = lambda h: [{k: r.get(k) for k in keys} for r in h if r.get("step", 0) > 3 and "loss" in r]  # noqa: E731
    assert rows(resumed.state.log_history) == rows(history)
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]
    assert saved.keys() == start.state.keys()
    for pid, state in saved.items():
        assert all(torch.equal(t, start.state[pid][k]) for k, t in state.items() if torch.is_tensor(t)), pid


def test_a_disk_snapshot_that_cannot_be_written_keeps_the_last_one_and_training_goes_on(
    tiny_model_dir, tmp_path, monkeypatch, caplog
):
    """The disk fills while step 4's snapshot is written: the warning names the cause and the snapshot that stays the
    rollback point (step 2), ``opefo/snapshot_failures`` counts it, training goes on, step 6's is written again."""
    real_save = torch.save
    full = {4}

    def save(obj, f, *a, **k):
        if isinstance(obj, dict) and obj.get("step") in full and "payload" in obj:
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    opefo = _opefo(storage="disk")
    trainer, _ = _trainer(tiny_model_dir, tmp_path / "snap", [], opefo, max_steps=6)
    with caplog.at_level(logging.WARNING, logger="steadyrl.opefo"):
        trainer.train()
    assert trainer.state.global_step == 6
    assert ("step 4: OPEFO's snapshot was not written (OSError: [Errno 28] No space left on device); the snapshot "
            "of step 2 stays the rollback point") in caplog.text  # fmt: skip
    assert per_step(trainer.state.log_history, "opefo/snapshot_failures") == [0, 0, 0, 1, 1, 1]
    folder = tmp_path / "snap" / "opefo_snapshots" / "rank0"
    assert sorted(p.name for p in folder.iterdir()) == ["snapshot-000000000006.pt"]
    # the first snapshot (before step 1) cannot be written: the run stops before training, naming the fix
    from steadyrl.trainers.recovery import SnapshotWriteError

    full.add(0)
    with pytest.raises(SnapshotWriteError, match=r"could not write its first snapshot to .*rank0 \(OSError: "
                       r"\[Errno 28\].*guards.opefo.rollback.storage: memory"):  # fmt: skip
        _trainer(tiny_model_dir, tmp_path / "snap2", [], _opefo(storage="disk"), max_steps=2)[0].train()
