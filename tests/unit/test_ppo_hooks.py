"""SteadyPPOTrainer's overrides are listed, match installed TRL/transformers, and the TRL details it uses exist."""

from __future__ import annotations

from trl_contract import PPO_HOOKED_METHODS, hook_signature_mismatches, ppo_internals_problems

from steadyrl.trainers.ppo import SteadyPPOTrainer


def test_ppo_hooked_signatures_match_installed_versions():
    assert hook_signature_mismatches(SteadyPPOTrainer, PPO_HOOKED_METHODS) == []


def test_every_ppo_override_is_listed():
    parents = [k for k in SteadyPPOTrainer.__mro__[1:] if not k.__module__.startswith("steadyrl")]
    overridden = {
        name
        for name, value in vars(SteadyPPOTrainer).items()
        if callable(value) and any(name in vars(p) for p in parents) and name != "__init__"
    }
    assert overridden == set(PPO_HOOKED_METHODS)


def test_trl_details_ppo_relies_on():
    assert ppo_internals_problems() == []
