"""held_tensor_bytes: what the guard layers hold, each storage once, nothing of the run's own state."""

from __future__ import annotations

import types

import torch

from steadyrl.guards.rollout_filters import LengthHistory, RolloutFilter
from steadyrl.trainers.checkpoints import GuardState
from steadyrl.trainers.guard_memory import held_tensor_bytes, run_storages


def test_counts_each_storage_once_and_skips_what_belongs_to_the_run() -> None:
    history = LengthHistory(100)  # a steadyrl object: an int64 buffer of 100 -> 800 bytes
    shared = torch.zeros(50, dtype=torch.float32)  # 200 bytes, reached from two parts
    model = torch.nn.Linear(10, 10)  # the run's: neither its parameters nor its buffers count
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 10)).sum().backward()
    optimizer.step()  # Adam state now exists (the run's, not a guard's)
    foreign = types.SimpleNamespace(big=torch.zeros(1000))  # not a steadyrl object: not walked
    first = {"history": history, "shared": shared, "view": shared[10:20], "model": model, "opt": optimizer}
    second = [shared, (torch.zeros(3, dtype=torch.int64),), foreign, model.weight, model.weight.grad]
    held = held_tensor_bytes({"first": [first], "second": [second]})
    # second: the shared storage was credited to first; 3 int64 = 24 bytes; a .grad is a plain tensor the guard holds
    assert held == {"first": 800 + 200, "second": 24 + model.weight.grad.nbytes}


def test_the_guard_registry_and_the_trainer_are_not_walked() -> None:
    filt = RolloutFilter()  # its length history: 2048 float64 = 16384 bytes
    registry = GuardState.register([("filter", filt)], {}, {})
    assert registry.stateful["filter"] is filt
    holder = LengthHistory(20)  # 160 bytes; gets a reference to the registry, like OPEFO keeps the trainer's
    holder.registry = registry  # type: ignore[attr-defined]
    trainer = types.SimpleNamespace()
    holder.trainer = trainer  # type: ignore[attr-defined]
    held = held_tensor_bytes({"opefo": [holder], "quatro": [filt]}, trainer=trainer)
    assert held == {"opefo": 160, "quatro": 2048 * 8}


def test_views_of_the_models_and_optimizers_storages_are_the_runs() -> None:
    model = torch.nn.Linear(100, 100)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 100)).sum().backward()
    optimizer.step()
    history = LengthHistory(10)  # 80 bytes, the guard's own
    held_views = {"weight": model.weight.detach(), "moments": optimizer.state_dict()["state"], "own": history}
    exclude = run_storages(model, optimizer)
    assert held_tensor_bytes({"opefo": [held_views]}, exclude=exclude) == {"opefo": 80}
    assert held_tensor_bytes({"opefo": [held_views]})["opefo"] > 80_000  # without the exclusion: 40 KB + moments


def test_a_root_from_another_package_is_walked_one_level() -> None:
    user_processor = types.SimpleNamespace(window=torch.zeros(25, dtype=torch.float64))  # a user's reward processor
    assert held_tensor_bytes({"grade": [user_processor]}) == {"grade": 200}
    nested = types.SimpleNamespace(inner=types.SimpleNamespace(big=torch.zeros(1000)))  # not steadyrl's below a root
    assert held_tensor_bytes({"grade": [nested]}) == {"grade": 0}
