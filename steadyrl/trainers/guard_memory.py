"""The memory the guard layers hold: bytes of every tensor reachable from a layer's objects, per layer, at the
moment it is called (``write_guard_cost`` calls it at the end of training; buffers a layer holds only during a
step are estimated there from the parameter sizes).

Peak RSS differences between two runs are a poor measure of what steadyrl costs in memory: on the 135M model two
runs that train bit-identically (observe mode) differ by -93 to +956 MiB of peak RSS (docs/results/overhead.json),
which is the allocator, not steadyrl. This counts what the layers keep instead: snapshots held in memory, pending
error-feedback residuals, replayed rollouts, length histories, controller windows. Each tensor
storage is counted once, for the first layer that reaches it. What belongs to the run itself is never counted:
the model and its parameters, the optimizer and its state, the trainer, the runtime context, functions, and any
object of another package (only steadyrl's own objects, containers and tensors are walked).
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

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
