"""TRL-equivalent group advantages, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.base import StepDecision, combine_decisions


def test_group_scaling_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    adv = group_normalized_advantages(r, "group")
    # group 0: mean 0.25, unbiased std sqrt(0.75/3)=0.5 -> (1-0.25)/0.5001 = 1.49970..., (0-0.25)/0.5001
    assert adv[0, 0].item() == pytest.approx(0.75 / 0.5001, abs=1e-6)
    assert adv[0, 1].item() == pytest.approx(-0.25 / 0.5001, abs=1e-6)
    assert torch.equal(adv[1], torch.zeros(4))  # a constant group has no signal


def test_none_and_batch_scaling():
    r = torch.tensor([[1.0, 3.0], [0.0, 0.0]])
    assert torch.allclose(group_normalized_advantages(r, "none"), torch.tensor([[-1.0, 1.0], [0.0, 0.0]]))
    batch_std = math.sqrt(((1 - 1) ** 2 + (3 - 1) ** 2 + 1 + 1) / 3)  # mean 1.0 over all four
    expected = torch.tensor([[-1.0, 1.0], [0.0, 0.0]]) / (batch_std + 1e-4)
    assert torch.allclose(group_normalized_advantages(r, "batch"), expected, atol=1e-6)


def test_nan_rows_are_excluded_and_zeroed():
    r = torch.tensor([[1.0, float("nan"), 0.0]])
    adv = group_normalized_advantages(r, "group")
    assert adv[0, 1].item() == 0.0
    # statistics over the two scorable rows: mean 0.5, std sqrt(0.5)
    assert adv[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), abs=1e-6)


def test_unknown_scale_rewards():
    with pytest.raises(ValueError, match=r"unknown scale_rewards"):
        group_normalized_advantages(torch.zeros(1, 2), "weird")


def test_combine_decisions():
    assert combine_decisions([StepDecision.proceed(), StepDecision.proceed()]) == StepDecision(False)
    both = combine_decisions([StepDecision(True, "spike"), StepDecision.proceed(), StepDecision(True, "nan")])
    assert both == StepDecision(True, "spike,nan")
