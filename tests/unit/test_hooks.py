"""The TRL methods steadyrl hooks still exist with the signatures it was written against."""

from __future__ import annotations

import trl
from trl_contract import HOOKED_METHODS, TESTED_TRL, hook_signature_mismatches, internals_problems

from steadyrl.trainers import SteadyGRPOTrainer


def test_installed_trl_is_the_tested_minor_release():
    assert trl.__version__.startswith(TESTED_TRL + "."), f"steadyrl is tested with trl {TESTED_TRL}.x"


def test_hooked_signatures_match_installed_trl():
    assert hook_signature_mismatches(SteadyGRPOTrainer) == []


def test_every_override_is_listed():
    """A method SteadyGRPOTrainer defines that a TRL parent also defines must be in HOOKED_METHODS."""
    parents = [k for k in SteadyGRPOTrainer.__mro__[1:] if not k.__module__.startswith("steadyrl")]
    overridden = {
        name
        for name, value in vars(SteadyGRPOTrainer).items()
        if callable(value) and any(name in vars(p) for p in parents) and name != "__init__"
    }
    assert overridden == set(HOOKED_METHODS)


def test_mismatch_is_reported():
    class Fake(trl.GRPOTrainer):
        pass

    Fake._clip_grad_norm = lambda self, model, extra: None  # type: ignore[method-assign]
    Fake.__module__ = "fake_trl"
    problems = hook_signature_mismatches(Fake)
    assert len(problems) == 1 and problems[0].startswith("_clip_grad_norm: signature is (self, model, extra)")


def test_accelerate_and_deepspeed_internals_are_as_relied_on():
    """The LR-schedule flag and the ZeRO step order the step guards depend on (see trl_contract.py)."""
    assert internals_problems() == []
