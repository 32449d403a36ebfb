"""scripts/peer_signals.py: the common rules it replays beside steadyrl's and soup-cli's, by hand, and the eval it
measures a catch from."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def peer() -> Any:
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("peer_signals", SCRIPTS / "peer_signals.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_mann_kendall_by_hand(peer) -> None:
    # 3 rising values: S = 3, var = 3 * 2 * 11 / 18, z = (S - 1) / sqrt(var) = 1.0445
    assert peer.mann_kendall_z([1.0, 2.0, 3.0]) == pytest.approx(2 / math.sqrt(66 / 18))
    assert peer.mann_kendall_z([3.0, 2.0, 1.0]) == pytest.approx(-2 / math.sqrt(66 / 18))
    assert peer.mann_kendall_z([1.0, 1.0, 1.0]) == 0.0 and peer.mann_kendall_z([1.0, 2.0]) == 0.0


def test_common_rules_fire_where_their_definitions_say(peer) -> None:
    steps = list(range(1, 21))
    # reward 1.0 for 10 steps, then 0.4: the 10-step mean falls below half its best (1.0) once 9 of 10 are 0.4
    # ((1 + 9 * 0.4) / 10 = 0.46), at step 19; the std jumps to 3x its 20-step median only once 20 values are in
    reward = [1.0] * 10 + [0.4] * 10
    std = [0.1] * 20
    entropy = [1.0] * 10 + [0.3] * 10  # read once 20 are logged (the first 10 are its baseline): 0.3 < 0.5 at step 20
    found = peer.first_common(steps, reward, std, entropy)
    assert found == {"reward_std_jump": None, "reward_trend": None, "entropy_collapse": 20, "reward_collapse": 19}
    found = peer.first_common([*steps, 21], [*reward, 0.4], [*std, 0.3], [])  # 0.3 > 2 x median 0.1 at step 21
    assert found["reward_std_jump"] == 21 and found["entropy_collapse"] is None  # no entropy logged: not read


def test_a_run_fell_at_its_first_eval_a_tenth_below_the_start(peer) -> None:
    rows = [{"step": 0, "eval/accuracy": 0.55}, {"step": 20, "eval/accuracy": 0.5}, {"step": 40, "eval/accuracy": 0.4}]
    assert peer.fell_at(rows) == (0.55, 40)
    assert peer.fell_at(rows[1:]) == (None, None)  # no eval before training: no start to fall from
