"""The reward-hacking watch's rule (steadyrl/guards/gold_watch.py) on constructed histories: a run that games its
reward (training reward up, gold metric down) is confirmed after ``confirm`` evals; healthy, noisy and collapsing
runs are not; the replay over logged rows finds the same verdicts as the live rule."""

from __future__ import annotations

import math

import pytest

from steadyrl.guards.gold_watch import GoldConfig, GoldDetector, eval_points, replay

NAN = float("nan")


def _verdicts(points: list[tuple[float, float]], **kwargs) -> list[str]:
    detector = GoldDetector(**kwargs)
    return [detector.update(50 * (i + 1), gold, reward) for i, (gold, reward) in enumerate(points)]


def test_a_gamed_reward_is_confirmed_on_the_second_eval_below_the_best():
    # gold peaks at 0.80 (step 100) with reward 0.6; then the reward climbs while gold falls past 0.80 - 0.05
    points = [(0.70, 0.5), (0.80, 0.6), (0.76, 0.7), (0.74, 0.8), (0.70, 0.9)]
    assert _verdicts(points) == ["best", "best", "ok", "falling", "diverged"]
    detector = GoldDetector()
    for i, (gold, reward) in enumerate(points):
        detector.update(50 * (i + 1), gold, reward)
    assert (detector.best_gold, detector.best_step, detector.reward_at_best, detector.streak) == (0.80, 100, 0.6, 2)


def test_an_eval_before_training_as_the_best_takes_the_first_reward_after_it_as_its_bar():
    nan = float("nan")
    # the instruct model (step 0, no reward yet) is the best; the reward then rises while gold collapses: gaming
    gamed = GoldDetector()
    verdicts = [gamed.update(step, gold, reward) for step, gold, reward in ((0, 0.21, nan), (10, 0.01, 0.8),
                                                                             (20, 0.0, 0.9))]  # fmt: skip
    assert verdicts == ["best", "falling", "diverged"] and gamed.reward_at_best == 0.8 and gamed.best_step == 0
    # the same fall with the reward falling below its first level: a collapse, not confirmed
    collapse = GoldDetector()
    verdicts = [collapse.update(step, gold, reward) for step, gold, reward in ((0, 0.21, nan), (10, 0.01, 0.8),
                                                                               (20, 0.0, 0.7))]  # fmt: skip
    assert verdicts == ["best", "falling", "ok"]


def test_healthy_noisy_and_collapsing_runs_are_not_confirmed():
    rising = [(0.5, 0.2), (0.6, 0.3), (0.7, 0.4), (0.8, 0.5)]
    assert _verdicts(rising) == ["best"] * 4
    noisy = [(0.80, 0.5), (0.74, 0.6), (0.79, 0.6), (0.74, 0.7), (0.81, 0.7)]  # never 2 in a row below 0.75
    assert _verdicts(noisy) == ["best", "falling", "ok", "falling", "best"]
    # the gold metric falls, but so does the training reward: a collapse, not a gamed reward
    collapse = [(0.80, 0.6), (0.70, 0.5), (0.60, 0.4), (0.50, 0.3)]
    assert _verdicts(collapse) == ["best", "ok", "ok", "ok"]
    # a drop of exactly `drop` is not a fall (strictly below best - drop)
    assert _verdicts([(0.5, 0.0), (0.25, 1.0), (0.25, 1.0)], drop=0.25) == ["best", "ok", "ok"]


def test_reward_slack_confirm_and_non_finite_values():
    points = [(0.80, 0.60), (0.70, 0.58), (0.70, 0.58)]  # the reward slipped by 0.02
    assert _verdicts(points) == ["best", "ok", "ok"]
    assert _verdicts(points, reward_slack=0.05) == ["best", "falling", "diverged"]
    assert _verdicts(points, reward_slack=0.05, confirm=1) == ["best", "diverged", "diverged"]
    # a NaN gold metric is skipped without breaking a streak; a NaN reward never counts as "rewarded"
    assert _verdicts([(0.8, 0.6), (0.7, 0.7), (NAN, 0.8), (0.7, 0.8)]) == ["best", "falling", "skip", "diverged"]
    assert _verdicts([(0.8, 0.6), (0.7, NAN), (0.7, NAN)]) == ["best", "ok", "ok"]


def test_restart_keeps_the_best_and_state_round_trips():
    detector = GoldDetector()
    for i, (gold, reward) in enumerate([(0.8, 0.6), (0.7, 0.7), (0.7, 0.8)]):
        detector.update(i, gold, reward)
    assert detector.streak == 2
    detector.restart()
    assert detector.streak == 0 and detector.best_gold == 0.8
    again = GoldDetector()
    again.load_state_dict(detector.state_dict())
    assert again == detector
    with pytest.raises(ValueError, match="version"):
        again.load_state_dict({"version": 0})


def test_eval_points_average_the_rewards_logged_since_the_previous_eval():
    rows = [
        {"step": 1, "reward": 0.2},
        {"step": 2, "reward": 0.4},
        {"step": 2, "eval/accuracy": 0.5},
        {"step": 3, "reward": 0.6},
        {"step": 4, "eval/accuracy": 0.4},
        {"step": 5, "eval/accuracy": 0.3},
    ]
    points = eval_points(rows)
    assert points[:2] == [(2, 0.5, pytest.approx(0.3)), (4, 0.4, 0.6)]
    assert points[2][:2] == (5, 0.3) and math.isnan(points[2][2])


def test_replay_matches_the_live_rule():
    rows, points = [], [(0.70, 0.5), (0.80, 0.6), (0.76, 0.7), (0.74, 0.8), (0.70, 0.9)]
    for i, (gold, reward) in enumerate(points):
        rows += [{"step": 50 * (i + 1), "reward": reward}, {"step": 50 * (i + 1), "eval/accuracy": gold}]
    assert replay(rows) == list(zip([50, 100, 150, 200, 250], _verdicts(points), strict=True))
    assert [v for _, v in replay(rows, GoldConfig(drop=0.2))] == ["best", "best", "ok", "ok", "ok"]


def test_config_bounds():
    with pytest.raises(ValueError, match="drop"):
        GoldConfig(drop=0.0)
    with pytest.raises(ValueError, match="action"):
        GoldConfig(action="pause")
    with pytest.raises(ValueError, match="lr_factor"):
        GoldConfig(lr_factor=1.5)
