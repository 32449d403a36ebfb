"""A CPU-only check for the device bugs that only a GPU run shows.

On a GPU the model, its gradients, the rewards and the advantages live on ``cuda``, while a tensor that steadyrl's
own code makes without ``device=`` (``torch.tensor(x)``, ``torch.zeros(n)``) lives on the CPU. An op that mixes
the two raises on CUDA ("Expected all tensors to be on the same device") and passes silently on a CPU machine,
where everything is on the CPU. The H200 smoke run of 7cd9895 died at step 0 with every layer on from one such
tensor (GEPO's clamp bound) while 592 CPU tests passed.

``HostTensorAudit`` is a ``TorchFunctionMode`` that marks every tensor made by a factory call (``torch.tensor``,
``zeros``, ``full``...) from a frame inside the ``steadyrl`` package without a ``device`` argument as *host*,
follows that mark through every op whose tensor inputs are all host, and records each op that mixes a host
tensor with any other tensor (one that came from the model, the data, TRL, or a call that named a device).

It is stricter than CUDA in one way: CUDA lets a 0-dim CPU tensor into most element-wise ops, the audit does not
(naming the device there costs nothing). It also checks what steadyrl sends into its collectives
(``RuntimeContext.reduce_sum``/``gather``, the identity on one process): NCCL takes device tensors only. It misses
what it cannot see: host tensors made by TRL, collectives called on ``torch.distributed`` directly, and ops that
autograd runs in C++ (backward).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import steadyrl
from steadyrl.trainers.context import RuntimeContext

PACKAGE = str(Path(steadyrl.__file__).resolve().parent)
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.arange, torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint,
}  # fmt: skip
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
# reading an attribute (.shape, .grad, .device) is no mixing
IGNORED_NAMES = {"__get__", "__set__", "__repr__", "__format__", "__len__", "__bool__", "__index__"}
# copy_ moves values across devices (the destination keeps its place)
CROSS_DEVICE = {torch.Tensor.copy_}


@dataclass(frozen=True)
class Mix:
    """One op that mixed a host tensor with another: where in steadyrl, which op, the host tensors' origins."""

    where: str
    op: str
    host_from: tuple[str, ...]

    def __str__(self) -> str:
        made = ", ".join(self.host_from)
        if self.op.endswith("(a collective)"):
            return f"{self.where}: {self.op} gets a host tensor (made at {made}); NCCL takes device tensors only"
        return f"{self.where}: {self.op} mixes a host tensor (made at {made}) with a device one"


def _steadyrl_frame(depth: int) -> str | None:
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE):
            return f"steadyrl{name[len(PACKAGE) :]}:{frame.f_lineno}"
        if "/torch/" not in name and not name.endswith("device_audit.py"):
            return None  # called from TRL, transformers or a test: not steadyrl's own tensor
        frame = frame.f_back
    return None


class HostTensorAudit(TorchFunctionMode):
    """Records every op that mixes a tensor steadyrl made without ``device=`` with any other tensor."""

    def __init__(self) -> None:
        super().__init__()
        self._host: dict[int, tuple[weakref.ref, str]] = {}
        self.mixes: set[Mix] = set()
        self._host_devices: dict[int, tuple[torch.device, str]] = {}  # .device read from a host tensor
        self.host_made = 0

    def __enter__(self) -> HostTensorAudit:
        real_load = torch.load

        def load(*args: Any, **kwargs: Any) -> Any:
            """torch.load from steadyrl with map_location="cpu": every tensor it returns is host (guard state read
            back on resume stays on the CPU unless the guard moves it)."""
            out = real_load(*args, **kwargs)
            where = _steadyrl_frame(2)
            if where is not None and kwargs.get("map_location") == "cpu":
                self._mark(out, f"{where} (torch.load)")
            return out

        self._real_load, torch.load = real_load, load
        real_init = RuntimeContext.__init__
        audit = self

        def init(ctx: RuntimeContext, *args: Any, **kwargs: Any) -> None:
            """Every RuntimeContext made while the audit runs checks what its collectives get."""
            real_init(ctx, *args, **kwargs)
            ctx.reduce_sum = audit._collective(ctx.reduce_sum, "reduce_sum")
            ctx.gather = audit._collective(ctx.gather, "gather")

        self._real_init, RuntimeContext.__init__ = real_init, init
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.load = self._real_load
        RuntimeContext.__init__ = self._real_init
        super().__exit__(*exc)

    def _collective(self, fn: Any, name: str) -> Any:
        """A collective (the identity on one process) that records a host tensor sent into it: NCCL takes device
        tensors only, so on GPUs it raises there."""

        def checked(t: torch.Tensor) -> torch.Tensor:
            origin = self._origin(t)
            if origin is not None:
                self.mixes.add(Mix(_steadyrl_frame(2) or "outside steadyrl", f"{name} (a collective)", (origin,)))
            return fn(t)

        return checked

    def _origin(self, t: torch.Tensor) -> str | None:
        entry = self._host.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _device_origin(self, device: Any) -> str | None:
        """Where the host tensor was made whose ``.device`` this object is; None for any other device."""
        entry = self._host_devices.get(id(device))
        return entry[1] if entry is not None and entry[0] is device else None

    def _mark(self, out: Any, origin: str) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = id(t)
                self._host[key] = (weakref.ref(t, lambda _, key=key: self._host.pop(key, None)), origin)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") == "device":
            origin = self._origin(args[0]) if args and isinstance(args[0], torch.Tensor) else None
            if origin is not None:  # a host tensor's .device: what is made there is host too
                self._host_devices[id(out)] = (out, origin)
            return out
        if name in IGNORED_NAMES:
            return out
        if func in FACTORIES:
            device = kwargs.get("device")
            if device is None:
                where = _steadyrl_frame(2)
                if where is not None:
                    self.host_made += 1
                    self._mark(out, where)
            elif (origin := self._device_origin(device)) is not None:
                self._mark(out, origin)
            return out
        if func in CROSS_DEVICE:
            return out
        if func in MOVES:
            return self._moved(func, args, kwargs, out)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        origins = [self._origin(t) for t in tensors]
        host = [o for o in origins if o is not None]
        if not host:
            return out
        if len(host) < len(tensors):
            where = _steadyrl_frame(2) or "outside steadyrl"
            self.mixes.add(Mix(where, name, tuple(sorted(set(host)))))
            return out
        self._mark(out, host[0])
        return out

    def _moved(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """``.to``/``.cpu``/``.cuda``: the result is where it was told to go. ``.cpu()`` and ``.to("cpu")`` from
        steadyrl's code make a host tensor (the rollout filters work on the CPU on purpose); a ``torch.device``
        object (read from a tensor or the accelerator) or another tensor's place is the run's device; a dtype-only
        ``.to`` keeps the mark. A move that is a no-op on this machine returns an alias, so that marking the result
        never marks the tensor it came from."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is torch.Tensor.cpu:
            target = "cpu"
        elif func is torch.Tensor.cuda:
            target = "device"
        else:
            told = [a for a in (*args[1:], kwargs.get("device"), kwargs.get("other"))
                    if isinstance(a, torch.Tensor | torch.device | str)]  # fmt: skip
            if not told:
                target = "same"
            elif isinstance(told[0], str):
                target = "cpu" if told[0].split(":")[0] == "cpu" else "device"
            elif isinstance(told[0], torch.Tensor):
                target = "host" if self._origin(told[0]) is not None else "device"
            elif self._device_origin(told[0]) is not None:
                target = "host"
            else:
                target = "device"
        source_origin = self._origin(source) if source is not None else None
        if target == "same":
            if source_origin is not None:
                self._mark(out, source_origin)
            return out
        where = _steadyrl_frame(3)
        host = target == "host" or (target == "cpu" and where is not None)
        if isinstance(out, torch.Tensor) and out is source and host != (source_origin is not None):
            out = out.view_as(out)  # a no-op move here: give the result its own identity before marking it
        if host:
            self._mark(out, source_origin or where or "a move to the CPU")
        return out
