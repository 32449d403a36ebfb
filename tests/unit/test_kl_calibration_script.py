"""scripts/kl_calibration.py: each calibration rule's target and the KL a run spent, hand-computed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kl_calibration.py"


def _script():
    spec = importlib.util.spec_from_file_location("kl_calibration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rules_and_spent_kl_by_hand() -> None:
    script = _script()
    kl = {s: 0.01 * s for s in range(1, 61)}  # KL grows by 0.01 per step
    kl[15] = 1.0  # one outlier step inside the shipped window
    entropy = {s: 0.2 if s <= 10 else 0.05 for s in range(1, 61)}
    rules = script.calibration(kl, entropy)
    # steps 11-20: 0.11 .. 0.20 with 0.15 -> 1.0: mean (1.55 - 0.15 + 1.0) / 10 = 0.24; median (0.16 + 0.17) / 2
    assert rules["current"] == pytest.approx(2.4)
    assert rules["median"] == pytest.approx(1.65)
    assert rules["w21-40"] == pytest.approx(10 * 0.305)  # mean of 0.21 .. 0.40
    assert rules["entropy"] == pytest.approx(0.2)  # steps 1-10 only
    used = script.spent(kl)
    assert used["kl_last20"] == pytest.approx(0.505)  # mean of 0.41 .. 0.60
    assert used["kl_max10"] == pytest.approx(0.555)  # steps 51-60
