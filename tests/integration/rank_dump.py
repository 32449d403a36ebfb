"""A TrainerCallback for launch tests: each rank writes its final weights and optimizer facts to disk."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from steadyrl.faults import CorruptOptimizerState


def _optimizer_chain(optimizer) -> list:
    """The optimizer and every optimizer it wraps (accelerate wrapper -> DeepSpeed ZeRO -> torch AdamW)."""
    chain = [optimizer]
    while getattr(chain[-1], "optimizer", None) is not None and chain[-1].optimizer is not chain[-1]:
        chain.append(chain[-1].optimizer)
    return chain


class RankDump(TrainerCallback):
    def __init__(self) -> None:
        self.lrs: list[float] = []  # the scheduler's LR at train begin and after every optimizer step
        self.per_step: list[dict] = []

    def on_train_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        self.lrs.append(lr_scheduler.get_last_lr()[0])

    def on_step_end(self, args, state, control, lr_scheduler=None, model=None, optimizer=None, **kwargs):
        self.lrs.append(lr_scheduler.get_last_lr()[0])
        # this rank's view after every step: weights and the innermost optimizer's moments (a ZeRO partition)
        module = getattr(model, "module", model)
        base = _optimizer_chain(optimizer)[-1]
        self.per_step.append(
            {
                "step": state.global_step,
                "weights": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
                "moments": [
                    {k: v.detach().cpu().clone() for k, v in st.items() if torch.is_tensor(v)}
                    for st in base.state.values()
                ],
            }
        )

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        chain = _optimizer_chain(optimizer)
        zero = [o for o in chain if type(o).__name__ == "DeepSpeedZeroOptimizer"]
        # DeepSpeedZeroOptimizer serves stages 1 and 2; stage 2 is the one that partitions gradients.
        stage = (2 if zero[0].partition_gradients else 1) if zero else None
        module = getattr(model, "module", model)
        out = Path(args.output_dir) / "rank_dump"
        out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "global_step": state.global_step,
                "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                "optimizer_chain": [type(o).__name__ for o in chain],
                "zero_stage": stage,
                "lrs": self.lrs,
                "per_step": self.per_step,
                "log_history": list(state.log_history),  # this rank's own log rows (every rank logs)
                "weights": {k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
            },
            out / f"rank{rank}.pt",
        )


class NanGradOnRank1(TrainerCallback):
    """Poisons one parameter's gradient with NaN on rank 1 only, during the second optimizer step."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if int(os.environ.get("RANK", "0")) != 1:
            return
        param = next(p for p in getattr(model, "module", model).parameters() if p.requires_grad)
        param.register_hook(lambda g: g * float("nan") if state.global_step == 1 else g)


class SpikeGradOnRank1(TrainerCallback):
    """Multiplies one parameter's gradient by 1e6 on rank 1 only at the third optimizer step: a finite spike."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if int(os.environ.get("RANK", "0")) != 1:
            return
        param = next(p for p in getattr(model, "module", model).parameters() if p.requires_grad)
        param.register_hook(lambda g: g * 1e6 if state.global_step == 2 else g)


class MicroSpikeOnRank1(TrainerCallback):
    """Multiplies one parameter's gradient by 1e6 on rank 1 only, in one micro-batch: the 11th backward pass (the
    third micro-batch of step 3 with 4 accumulation steps)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if int(os.environ.get("RANK", "0")) != 1:
            return
        param = next(p for p in getattr(model, "module", model).parameters() if p.requires_grad)
        calls = {"n": 0}

        def hook(grad):
            calls["n"] += 1
            return grad * 1e6 if calls["n"] == 11 else grad

        param.register_hook(hook)


class NanMomentOnRank1(CorruptOptimizerState):
    """NaN written into rank 1's exp_avg_sq (its ZeRO partition, or its DDP replica) at the end of step 2."""

    def __init__(self) -> None:
        super().__init__(step=2, value=float("nan"), rank=1)


class InfMomentOnRank1(CorruptOptimizerState):
    """inf written into rank 1's exp_avg_sq at the end of step 2: its weights stay finite (Adam divides by it)."""

    def __init__(self) -> None:
        super().__init__(step=2, value=float("inf"), rank=1)


class KillDuringSave(TrainerCallback):
    """SIGKILLs this process in the middle of writing checkpoint-4: right before its optimizer.pt is written
    (the model weights of that checkpoint are already on disk)."""

    def on_train_begin(self, args, state, control, **kwargs):
        import signal

        original = torch.save

        def save(obj, f, *a, **kw):
            path = str(f)
            if "checkpoint-4" in path and path.endswith("optimizer.pt"):
                os.kill(os.getpid(), signal.SIGKILL)
            return original(obj, f, *a, **kw)

        torch.save = save


def _ppid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class SignalAtStep(TrainerCallback):
    """Rank 0 sends a signal at the end of one optimizer step, as a scheduler would: configured by
    ``STEADYRL_TEST_SIGNAL=STEP:TARGET[:REPEAT_AFTER_S]``, TARGET ``self`` (this process), ``parent`` (the
    launcher, which relays it to every worker, as Kubernetes signalling the container's first process) or ``all``
    (the launcher and every worker at once, as Slurm's scancel does; each worker then also gets the launcher's
    relayed copy). With REPEAT_AFTER_S it sends a second SIGTERM that long after."""

    def __init__(self) -> None:
        step, target, *repeat = os.environ["STEADYRL_TEST_SIGNAL"].split(":")
        self.step, self.target = int(step), target
        self.repeat = float(repeat[0]) if repeat else None

    def _send(self) -> None:
        import signal

        if self.target == "all":
            launcher = os.getppid()
            workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _ppid(p) == launcher]
            for pid in [launcher, *workers]:
                os.kill(pid, signal.SIGTERM)
        else:
            os.kill(os.getppid() if self.target == "parent" else os.getpid(), signal.SIGTERM)
        # wait for this process's copy (relayed by the launcher) to land, so the stop step is deterministic
        handler = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
        deadline = time.monotonic() + 30
        while handler is not None and handler.received is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step or not state.is_world_process_zero:
            return
        self._send()
        if self.repeat is not None:
            time.sleep(self.repeat)
            self._send()


class GroupMomentSpy(TrainerCallback):
    """Adam's moments per param group (unbraked flag, this rank's states) right after each optimizer step and
    after steadyrl's step-end work (its guard clock runs first). Under ZeRO-2 the states are this rank's partition."""

    def __init__(self) -> None:
        self.after_step: list = []
        self.after_guards: list = []

    @staticmethod
    def _moments(optimizer) -> list:
        from steadyrl.guards.optimizer_state import UNBRAKED_GROUP

        base = _optimizer_chain(optimizer)[-1]
        return [
            (bool(g.get(UNBRAKED_GROUP)), [(base.state[p]["exp_avg"].clone(), base.state[p]["exp_avg_sq"].clone())
                                           for p in g["params"] if p in base.state])
            for g in base.param_groups
        ]  # fmt: skip

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.after_step.append(self._moments(optimizer))

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.after_guards.append(self._moments(optimizer))


FORCED_MOMENT_FACTORS = (0.5, 2.0)


class ForcedBrakeMoments(GroupMomentSpy):
    """Launch tests: the entropy floor's ``brake_moments`` factor is forced to ``FORCED_MOMENT_FACTORS`` (patched on
    the class in this process, so no collapse is needed), and each rank writes its GroupMomentSpy record to
    ``output_dir/brake_spy/rank{RANK}.pt``."""

    def __init__(self) -> None:
        from steadyrl.guards.entropy_floor import EntropyFloor

        super().__init__()
        factors = iter(FORCED_MOMENT_FACTORS)
        EntropyFloor.moment_rescale = lambda self: next(factors)

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        out = Path(args.output_dir) / "brake_spy"
        out.mkdir(parents=True, exist_ok=True)
        record = {"after_step": self.after_step, "after_guards": self.after_guards}
        torch.save(record, out / f"rank{int(os.environ.get('RANK', '0'))}.pt")


def assert_brake_moments_scaled(after_step: list, after_guards: list, factors=FORCED_MOMENT_FACTORS) -> None:
    """Per step: the braked (policy) groups' exp_avg equal the stepped ones times the factor and exp_avg_sq times its
    square, exactly; the unbraked (critic) groups' are unchanged. Both kinds of group must be present, and every
    group's moments non-zero at some step, so the equalities can fail. (At step 1 a ZeRO-2 rank's share of the
    critic can be all zero: the zero-initialised value head passes no gradient to the backbone yet.)"""
    assert len(after_step) == len(after_guards) == len(factors)
    moved = [False] * len(after_step[0])
    for factor, stepped, guarded in zip(factors, after_step, after_guards, strict=True):
        assert {critic for critic, _ in stepped} == {False, True}  # policy and critic groups
        for i, ((critic, before), (_, after)) in enumerate(zip(stepped, guarded, strict=True)):
            expected = 1.0 if critic else factor
            assert before and len(before) == len(after)
            for (m, v), (m2, v2) in zip(before, after, strict=True):
                assert torch.equal(m2, m * expected) and torch.equal(v2, v * (expected * expected))
            moved[i] = moved[i] or any(bool(m.abs().sum() > 0) for m, _ in before)
    assert all(moved), moved
