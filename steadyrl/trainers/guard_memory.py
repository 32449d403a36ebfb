"""The memory the guard layers hold: bytes of every tensor storage reachable from a layer's objects (snapshots,
error-feedback residuals, replayed rows, histories), each counted once, for the first layer that reaches it; buffers
held only during a step are estimated from the parameter sizes (peak RSS is too noisy: docs/results/overhead.json).
Never counted: the model, the optimizer and its state, the trainer, the runtime context, functions, objects of other
packages (only steadyrl's own objects are walked).
"""

from __future__ import annotations

import json
import types
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from steadyrl.storage import write_report
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.context import RuntimeContext

_LEAVES = (str, bytes, int, float, bool, complex, type(None), types.ModuleType, type)
# GuardState: the registry of every layer (OPEFO keeps it to restore them all), which would credit every layer's
# tensors to whichever layer reaches it first
_NOT_OURS = (torch.nn.Module, torch.optim.Optimizer, RuntimeContext, GuardState, types.FunctionType,
             types.MethodType, types.BuiltinFunctionType, torch.device, torch.dtype)  # fmt: skip


def _children(obj: Any, root: bool = False) -> Iterable[Any]:
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, list | tuple | set | frozenset | deque):
        return obj
    if not root and not type(obj).__module__.startswith("steadyrl."):
        return ()  # past the roots only steadyrl's own objects are walked: a DeepSpeed engine, a tokenizer, ...
    found: list[Any] = []
    if hasattr(obj, "__dict__"):
        found += vars(obj).values()
    for name in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, name):
            found.append(getattr(obj, name))
    return found


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def run_storages(model: torch.nn.Module | None, optimizer: Any = None) -> set[tuple[str, int]]:
    """The storages of the model's parameters and buffers and of the optimizer's state: the run's own, so a guard
    holding a view or a ``state_dict()`` of them is not charged for them."""
    tensors: list[torch.Tensor] = []
    if model is not None:
        tensors += [*model.parameters(), *model.buffers()]
    for state in getattr(optimizer, "state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return {_storage_key(t) for t in tensors if not t.is_meta and not t.is_sparse}


def held_tensor_bytes(
    parts: dict[str, Iterable[Any]], trainer: Any = None, exclude: set[tuple[str, int]] | None = None
) -> dict[str, int]:
    """``{part: bytes}`` of the tensor storages reachable from each part's objects, each storage counted once
    (for the first part that reaches it). ``trainer``: never walked into (guards keep a reference to it);
    ``exclude``: storages that are not the guards' (``run_storages``). The roots themselves are walked whatever
    their package (a user's reward processor); below them only steadyrl's own objects are."""
    seen_objects: set[int] = {id(trainer)} if trainer is not None else set()
    seen_storages: set[tuple[str, int]] = set(exclude or ())
    out: dict[str, int] = {}
    for part, roots in parts.items():
        total = 0
        stack: list[tuple[Any, bool]] = [(r, True) for r in roots if r is not None]
        while stack:
            obj, is_root = stack.pop()
            if id(obj) in seen_objects or isinstance(obj, _LEAVES) or isinstance(obj, _NOT_OURS):
                continue
            seen_objects.add(id(obj))
            if isinstance(obj, torch.Tensor):
                if isinstance(obj, torch.nn.Parameter) or obj.is_meta or obj.is_sparse:
                    continue  # the model's (a sparse tensor has no single storage: not counted)
                storage = obj.untyped_storage()
                key = _storage_key(obj)
                if key not in seen_storages and storage.nbytes():
                    seen_storages.add(key)
                    total += storage.nbytes()
                continue
            stack.extend((child, False) for child in _children(obj, root=is_root))
        out[part] = total
    return out


def write_guard_cost(out: Path, trainer: Any, steps: int) -> None:
    """``OUTPUT_DIR/guard_cost.json`` at the end of training (read by bench_overhead.py): ``guard_seconds`` and
    ``seconds_by_part`` (``pipeline``: the shared reward and advantage plumbing; ``checks``: the finite checks;
    ``ppo``: GAE), ``held_mib_by_part`` (``held_tensor_bytes``) and ``transient_mib_by_part`` (a gradient copy held
    for a while: the micro-batch gate's, error feedback's)."""
    t, p = trainer, trainer.parts
    roots = {
        "grade": [p.reward_processor],
        "gepo": [p.advantage_fn, *p.step_guards, p.nonfinite_guard, t.micro_gate],
        "opefo": [t.step_end.recovery],
        "quatro": [t.step_end.kl, t.step_end.entropy, t.rollout.filter, t.rollout.replay],
        "pipeline": [t.pipeline, t.gate, t.scratch],
    }
    held = held_tensor_bytes(roots, trainer=t, exclude=run_storages(t.model, t.optimizer))
    gradient_mib = sum(q.numel() * q.element_size() for q in t.model.parameters() if q.requires_grad) / 2**20
    transient = {"gepo": gradient_mib if t.micro_gate is not None else 0.0}
    transient["opefo"] = gradient_mib if p.opefo is not None and t.gate.feedback is not None else 0.0
    doc = {
        "steps": steps,
        "guard_seconds": round(t.ctx.seconds, 6),
        "seconds_by_part": {name: round(value, 6) for name, value in sorted(t.ctx.seconds_by_part.items())},
        "held_mib_by_part": {name: round(value / 2**20, 3) for name, value in held.items()},
        "transient_mib_by_part": {name: round(value, 3) for name, value in transient.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    write_report(out / "guard_cost.json", json.dumps(doc, indent=1) + "\n")
