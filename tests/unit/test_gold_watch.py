"""The gold watch's rule (steadyrl/guards/gold_watch.py) on constructed histories: a run that games its reward
(training reward up, gold metric down) is confirmed after ``confirm`` evals as "diverged", one whose reward falls with
the gold metric as "regressed"; healthy and noisy runs are not, and a fall inside the evals' own noise (a plateau's
lucky best) is not a fall; the replay over logged rows finds the same verdicts as the live rule."""

from __future__ import annotations

import math

import pytest

from steadyrl.guards.gold_watch import GoldConfig, GoldDetector, binomial_se, eval_points, gold_se, mean_se, replay

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
    # the same fall with the reward falling below its first level: a regression (confirmed unless regression=False)
    points = ((0, 0.21, nan), (10, 0.01, 0.8), (20, 0.0, 0.7))
    collapse = GoldDetector()
    assert [collapse.update(*p) for p in points] == ["best", "falling", "regressed"]
    gaming_only = GoldDetector(regression=False)
    assert [gaming_only.update(*p) for p in points] == ["best", "falling", "ok"]


def test_healthy_and_noisy_runs_are_not_confirmed_and_a_collapse_is_a_regression():
    rising = [(0.5, 0.2), (0.6, 0.3), (0.7, 0.4), (0.8, 0.5)]
    assert _verdicts(rising) == ["best"] * 4
    noisy = [(0.80, 0.5), (0.74, 0.6), (0.79, 0.6), (0.74, 0.7), (0.81, 0.7)]  # never 2 in a row below 0.75
    assert _verdicts(noisy) == ["best", "falling", "ok", "falling", "best"]
    # the gold metric falls, and so does the training reward: a regression, not a gamed reward
    collapse = [(0.80, 0.6), (0.70, 0.5), (0.60, 0.4), (0.50, 0.3)]
    assert _verdicts(collapse) == ["best", "falling", "regressed", "regressed"]
    assert _verdicts(collapse, regression=False) == ["best", "ok", "ok", "ok"]
    # a drop of exactly `drop` is not a fall (strictly below best - drop)
    assert _verdicts([(0.5, 0.0), (0.25, 1.0), (0.25, 1.0)], drop=0.25) == ["best", "ok", "ok"]


def test_reward_slack_confirm_and_non_finite_values():
    points = [(0.80, 0.60), (0.70, 0.58), (0.70, 0.58)]  # the reward slipped by 0.02
    assert _verdicts(points) == ["best", "falling", "regressed"]
    assert _verdicts(points, regression=False) == ["best", "ok", "ok"]
    assert _verdicts(points, reward_slack=0.05) == ["best", "falling", "diverged"]
    assert _verdicts(points, reward_slack=0.05, confirm=1) == ["best", "diverged", "diverged"]
    # a NaN gold metric is skipped without breaking a streak; a NaN reward never counts as "rewarded"
    assert _verdicts([(0.8, 0.6), (0.7, 0.7), (NAN, 0.8), (0.7, 0.8)]) == ["best", "falling", "skip", "diverged"]
    assert _verdicts([(0.8, 0.6), (0.7, NAN), (0.7, NAN)]) == ["best", "falling", "regressed"]
    assert _verdicts([(0.8, 0.6), (0.7, NAN), (0.7, NAN)], regression=False) == ["best", "ok", "ok"]


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
    # a checkpoint from before the noise model (version 1, no standard errors): its reference counts as exact
    old = {"version": 1, "best_gold": 0.8, "best_step": 0, "reward_at_best": 0.6, "streak": 1, "evals": 3}
    again.load_state_dict(old)
    assert (again.best_gold, again.best_se, again.reward_se_at_best, again.streak) == (0.8, 0.0, 0.0, 1)


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
    assert points[0][:3] == (2, 0.5, pytest.approx(0.3)) and points[1][:3] == (4, 0.4, 0.6)
    assert points[2][:3] == (5, 0.3, 0.6)  # none logged since step 4's eval: the last ones logged
    # the reward's standard error: std of (0.2, 0.4) / sqrt(2) = 0.1414.. / 1.414.. = 0.1; one value: unknown
    assert points[0].reward_se == pytest.approx(0.1) and math.isnan(points[1].reward_se)
    assert all(math.isnan(p.gold_se) for p in points)  # no eval/accuracy_se, no eval/num_samples
    assert math.isnan(eval_points([{"step": 0, "eval/accuracy": 0.5}])[0].reward)  # nothing logged yet


@pytest.mark.parametrize("regression", [True, False])
def test_a_divergence_is_confirmed_when_trl_logs_less_often_than_the_eval_runs(regression):
    # TRL's default logging_steps 10 against eval.every 5; at a step with both, the Trainer logs the eval row first.
    # Gold 0.5 -> 0.2 from step 25 (n 200: margin 0.18), the reward holding at 0.8: every other eval has no reward
    # row of its own; it is judged with the last one logged, so the fall is confirmed, and as what it is: diverged
    rows = []
    for step in range(5, 45, 5):
        rows.append({"step": step, "eval/accuracy": 0.5 if step < 25 else 0.2, "eval/num_samples": 200})
        if step % 10 == 0:
            rows.append({"step": step, "reward": 0.8})
    verdicts = replay(rows, GoldConfig(regression=regression))
    assert verdicts[4:] == [(25, "falling"), (30, "diverged"), (35, "diverged"), (40, "diverged")]  # no rollback here


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


# ----------------------------------------------------------------------------------- the noise model, by hand

SE = 0.0354  # sqrt(0.5 * 0.5 / 200): a 0/1 metric near 0.5 on 200 samples


def _noisy(points: list[tuple[float, float]], **kwargs) -> list[str]:
    detector = GoldDetector(**kwargs)
    return [detector.update(20 * (i + 1), gold, reward, SE, 0.01) for i, (gold, reward) in enumerate(points)]


def test_a_plateaus_lucky_best_is_not_a_fall_but_a_fall_beyond_the_noise_is():
    # a plateau at 0.50 whose second eval was lucky (+2.8 se), then evals back at the plateau, the reward flat: the
    # old rule (z=0: drop 0.05 alone) rolls it back; with z=4 a fall must exceed 4 * sqrt(2) * SE = 0.2002
    plateau = [(0.49, 0.5), (0.60, 0.5), (0.50, 0.5), (0.49, 0.5), (0.47, 0.5), (0.51, 0.5)]
    assert _noisy(plateau, z=0.0) == ["best", "best", "falling", "diverged", "diverged", "diverged"]
    assert _noisy(plateau) == ["best", "best", "ok", "ok", "ok", "ok"]
    detector = GoldDetector()
    detector.update(0, 0.60, 0.5, SE, 0.01)
    assert detector.margin(SE) == pytest.approx(4 * math.sqrt(2) * SE)
    # the gamed run: gold 0.60 -> 0.30 -> 0.25 (0.30 > 0.2002 below) while the reward rises: confirmed on the second
    gamed = [(0.55, 0.5), (0.60, 0.6), (0.30, 0.8), (0.25, 0.9)]
    assert _noisy(gamed) == ["best", "best", "falling", "diverged"]
    # 0.20 below is inside the noise, 0.21 below is not
    assert _noisy([(0.60, 0.5), (0.40, 0.5), (0.40, 0.5)]) == ["best", "ok", "ok"]
    assert _noisy([(0.60, 0.5), (0.39, 0.5), (0.39, 0.5)]) == ["best", "falling", "diverged"]


def test_drop_stays_a_floor_when_the_noise_is_small():
    # se 0.001 (a huge eval): z * sqrt(2) * se = 0.0057, so drop=0.05 decides
    detector = GoldDetector()
    verdicts = [detector.update(i, g, 0.5, 0.001, 0.0) for i, g in enumerate((0.8, 0.76, 0.76, 0.74, 0.74))]
    assert verdicts == ["best", "ok", "ok", "falling", "diverged"]


def test_the_reference_is_the_highest_lower_bound_not_the_luckiest_eval():
    detector = GoldDetector()
    assert detector.update(0, 0.70, 0.5, 0.01, 0.0) == "best"  # bound 0.70 - 4 * 0.01 = 0.66
    assert detector.update(1, 0.74, 0.5, 0.05, 0.0) == "ok"  # higher, but its bound 0.54 is lower: not the reference
    assert (detector.best_gold, detector.best_step, detector.best_se) == (0.70, 0, 0.01)
    assert detector.update(2, 0.76, 0.5, 0.01, 0.0) == "best"  # bound 0.72 > 0.66


def test_the_reward_holds_by_a_test_and_labels_the_fall():
    detector = GoldDetector()
    detector.update(0, 0.60, 0.60, SE, 0.02)
    # allowed fall of the reward: 4 * sqrt(0.02^2 + 0.02^2) = 0.113
    assert detector.held(0.49, 0.02) and not detector.held(0.48, 0.02)
    assert not detector.held(NAN, 0.02)
    gamed, regressed = GoldDetector(), GoldDetector()
    for d, reward in ((gamed, 0.55), (regressed, 0.40)):
        verdicts = [
            d.update(i, g, r, SE, 0.02) for i, (g, r) in enumerate(((0.60, 0.60), (0.30, reward), (0.30, reward)))
        ]
        assert verdicts[:2] == ["best", "falling"]
    assert (
        gamed.update(3, 0.30, 0.55, SE, 0.02) == "diverged" and regressed.update(3, 0.30, 0.40, SE, 0.02) == "regressed"
    )


def test_standard_errors_by_hand_and_from_a_logged_row():
    assert binomial_se(0.5, 100) == pytest.approx(0.05)
    assert binomial_se(0.0, 100) == 0.0 and math.isnan(binomial_se(1.5, 100)) and math.isnan(binomial_se(0.5, 0))
    mean, se = mean_se([1.0, 2.0, 3.0, NAN])  # std 1, n 3
    assert mean == 2.0 and se == pytest.approx(1 / math.sqrt(3))
    assert math.isnan(mean_se([]).__getitem__(0)) and math.isnan(mean_se([4.0])[1])
    assert gold_se({"eval/accuracy_se": 0.02, "eval/num_samples": 100}, 0.5) == 0.02
    assert gold_se({"eval/num_samples": 100}, 0.5) == pytest.approx(0.05)  # the binomial bound
    assert math.isnan(gold_se({"eval/num_samples": 100}, 3.0))  # not a metric in [0, 1]: unknown
    assert gold_se({"eval/reward_se": 0.3}, 2.0, "eval/reward") == 0.3


def test_a_collapse_inside_the_first_interval_is_a_regression_by_the_first_reward_after_the_eval_before_training():
    # the eval before training (0.55); the reward of its own rollouts is 0.5 at step 1, then 0 from step 2 on (a
    # learning rate far too high): the interval's mean (0.025) would make the fall look like a held reward
    rows = [{"step": 0, "eval/accuracy": 0.55, "eval/accuracy_se": 0.035}]
    for step in range(1, 61):
        rows.append({"step": step, "reward": 0.5 if step == 1 else 0.0})
        if step % 20 == 0:
            rows.append({"step": step, "eval/accuracy": 0.0, "eval/accuracy_se": 0.0})
    points = eval_points(rows)
    assert points[1].first_reward == 0.5 and points[1].reward == pytest.approx(0.025)
    assert [v for _, v in replay(rows)] == ["best", "falling", "regressed", "regressed"]
    # without the first reward the bar is the interval's mean, and the same fall reads as a held reward
    detector = GoldDetector()
    assert [detector.update(*p[:5]) for p in points] == ["best", "falling", "diverged", "diverged"]


def test_a_resumed_run_judges_its_first_eval_with_the_rewards_logged_before_the_checkpoint():
    # evals every 5, checkpoint at 10: the eval at 5 fell (a streak of 1 in the saved state); the eval of step 10 runs
    # after that checkpoint, so the resumed run runs it first. Its reward level is in the restored history (steps
    # 6-10); read from the resumed rows alone it had none, and the streak restarted (regression off)
    from types import SimpleNamespace

    from steadyrl.callbacks.gold_watch import GoldWatch

    trainer = SimpleNamespace(ctx=SimpleNamespace(log_metrics=lambda *_: None), args=SimpleNamespace(output_dir="."))
    config = GoldConfig(regression=False)
    history = [{"step": 0, "eval/accuracy": 0.9, "eval/num_samples": 200}]
    history += [{"step": s, "reward": 0.8} for s in range(1, 6)]
    history += [{"step": 5, "eval/accuracy": 0.2, "eval/num_samples": 200}]
    history += [{"step": s, "reward": 0.8} for s in range(6, 11)]
    first = GoldWatch(config, trainer, observe=True)
    first.on_train_begin(None, SimpleNamespace(log_history=[]), None)
    first.on_step_begin(None, SimpleNamespace(log_history=history, global_step=10), None)
    assert first.detector.streak == 1 and first.rollbacks == 0

    resumed = GoldWatch(config, trainer, observe=True)
    resumed.load_state_dict(first.state_dict())
    state = SimpleNamespace(log_history=list(history), global_step=10)
    resumed.on_train_begin(None, state, None)
    state.log_history.append({"step": 10, "eval/accuracy": 0.2, "eval/num_samples": 200})
    resumed.on_step_begin(None, state, None)
    assert resumed.detector.streak == 2 and resumed.rollbacks == 1  # confirmed: the reward held at 0.8


def test_mode_min_reads_a_rise_as_the_fall_and_keeps_the_lowest_upper_bound():
    # an error rate (lower is better): 0.30 -> 0.20 is a new reference, 0.27 and 0.28 (more than drop 0.05 above it,
    # reward held) confirm a divergence; read with mode max, 0.20 is the fall
    points = [(0.30, 0.5), (0.20, 0.6), (0.27, 0.7), (0.28, 0.8)]
    assert _verdicts(points, mode="min") == ["best", "best", "falling", "diverged"]
    assert _verdicts(points) == ["best", "falling", "ok", "ok"]
    detector = GoldDetector(mode="min", z=2.0)
    # se 0.02: the reference is the lowest upper bound gold + z*se, not the luckiest (lowest) single eval
    assert detector.update(10, 0.20, 0.5, 0.05) == "best"  # upper bound 0.30
    assert detector.update(20, 0.22, 0.5, 0.01) == "best"  # upper bound 0.24 < 0.30
    assert detector.update(30, 0.19, 0.5, 0.10) == "ok"  # upper bound 0.39: lucky, not a reference
    assert (detector.best_gold, detector.best_step) == (0.22, 20)
    # a rise within z standard errors of the difference is not a fall: 2*hypot(0.01, 0.05) = 0.102 > 0.30 - 0.22
    assert detector.update(40, 0.30, 0.5, 0.05) == "ok"
    assert detector.update(50, 0.33, 0.5, 0.05) == "falling"  # 0.11 > 0.102
    with pytest.raises(ValueError, match="mode 'lowest'"):
        GoldDetector(mode="lowest")


def test_relative_drop_sets_the_floor_in_units_of_the_reference():
    # reference 0.8: relative_drop 0.1 asks for a fall of more than 0.08 (drop 0.05 alone would take 0.06)
    points = [(0.80, 0.5), (0.73, 0.6), (0.73, 0.6), (0.71, 0.7), (0.71, 0.7)]
    assert _verdicts(points) == ["best", "falling", "diverged", "diverged", "diverged"]
    assert _verdicts(points, relative_drop=0.1) == ["best", "ok", "ok", "falling", "diverged"]
    assert GoldDetector(relative_drop=0.1, best_gold=-2.0).margin(0.0) == pytest.approx(0.2)  # |reference|
    # the YAML keys reach the detector
    config = GoldConfig(mode="min", relative_drop=0.25)
    detector = GoldDetector.from_config(config)
    assert (detector.mode, detector.relative_drop) == ("min", 0.25)
    with pytest.raises(ValueError, match="relative_drop"):
        GoldConfig(relative_drop=1.0)
