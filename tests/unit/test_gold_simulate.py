"""scripts/gold_simulate.py: the live gold-watch rule over simulated evals; the eval's standard error as the periodic
eval logs it, the first confirmed fall, and the false-alarm gap between today's rule and the one before it."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _sim() -> Any:
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("gold_simulate", SCRIPTS / "gold_simulate.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_an_eval_is_a_binomial_mean_with_the_sample_standard_error():
    sim = _sim()
    rng = np.random.default_rng(0)
    k = int(np.random.default_rng(0).binomial(200, 0.5))
    mean, se = sim.eval_point(rng, 0.5, 200)
    assert mean == k / 200
    assert se == pytest.approx(math.sqrt(k * (1 - k / 200) / 199 / 200))  # 0/1 scores: s^2 = k (1 - k/n) / (n - 1)


def test_first_alarm_is_the_first_confirmed_fall():
    sim = _sim()
    flat = [(0.5, 0.035, 0.5, 0.01)] * 5
    fall = [(0.5, 0.035, 0.5, 0.01), (0.2, 0.03, 0.5, 0.01), (0.2, 0.03, 0.5, 0.01), (0.1, 0.02, 0.5, 0.01)]
    assert sim.first_alarm(sim.GoldDetector(), flat) is None
    assert sim.first_alarm(sim.GoldDetector(), fall) == 3  # falling at the 2nd eval, confirmed at the 3rd


def test_todays_rule_stays_quiet_on_plateaus_where_the_rule_before_rolls_back():
    sim = _sim()
    args = argparse.Namespace(runs=200, every=20, reward_std=0.05)
    shipped = sim.plateau_cell("shipped", 0.5, 100, args, seed=1)["metrics"]["false_alarm_share_at_50"][0]
    before = sim.plateau_cell("before-noise-model", 0.5, 100, args, seed=1)["metrics"]["false_alarm_share_at_50"][0]
    assert shipped <= 0.01 and before >= 0.5
    caught = sim.fall_cell("shipped", 0.2, argparse.Namespace(runs=60, every=20, reward_std=0.05), seed=2)["metrics"]
    assert caught["caught_share"][0] >= 0.95 and caught["evals_to_catch_median"][0] <= 3
