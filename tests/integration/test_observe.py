"""All four layers in observe mode train exactly like all four off (tiny model): same losses, same final weights.
And the observing run did log its would-decisions: the overhead figure is on an unchanged trajectory."""

from __future__ import annotations

import json
import math

import pytest

from steadyrl.config.guard_sections import GuardsSection
from steadyrl.evidence.history import History
from steadyrl.evidence.observe import format_observe_summary
from steadyrl.faults import CorruptOptimizerState, GradSpikeAtStep
from steadyrl.guards.rollout_filters import LENGTH_HISTORY
from steadyrl.metrics import (
    GEPO_SKIPPED_STEPS,
    GEPO_WOULD_ADV_DIFF_MEAN,
    GEPO_WOULD_SKIP,
    GRADE_SCALED_STD,
    GUARD_SECONDS,
    OPEFO_REPAIRS,
    OPEFO_ROLLBACKS,
    OPEFO_WOULD_REPAIR,
    OPEFO_WOULD_ROLLBACK,
    QUATRO_KL_COEF_WOULD,
    QUATRO_WOULD_FILTER_SHARE,
    gepo_would_skip,
    quatro_would_filter,
)
from steadyrl.trainers.layers import guard_parts
from tests.integration.helpers import assert_same_weights, per_step, tiny_grpo_trainer, weights

pytestmark = pytest.mark.slow

STEPS = 4
BETA = 0.04


def observing_guards() -> GuardsSection:
    """Every layer on in observe mode, tuned so each makes a decision within 4 steps on the tiny model."""
    g = GuardsSection()
    g.gepo.enabled, g.gepo.mode = True, "observe"
    g.gepo.spike.warmup_steps = 1  # the x1e4 gradient at step 3 is a would-skip
    g.opefo.enabled, g.opefo.mode = True, "observe"
    g.opefo.floor.interval = 1
    g.opefo.rollback.check_interval = 1  # the inf written into exp_avg_sq at step 2 is a would-rollback
    g.quatro.enabled, g.quatro.mode = True, "observe"
    g.quatro.kl.enabled = True
    g.quatro.kl.target = 1e-9  # any KL is above it: the would-be coefficient climbs away from beta
    g.quatro.kl.beta_range = [0.25, 4.0]  # two-sided, so step 1 (KL 0) lowers it
    g.quatro.entropy.baseline_steps = 1
    g.quatro.filters.length.max_tokens = 2  # completions of 3-4 tokens are would-drops
    g.quatro.replay.enabled = True  # inactive in observe mode (it would change training)
    g.grade.enabled, g.grade.mode = True, "observe"
    g.grade.warmup, g.grade.clip_start = 2, 8
    return g


def _train(model_dir, out, guards: dict):
    trainer = tiny_grpo_trainer(model_dir, out, guards, max_steps=STEPS, beta=BETA)
    trainer.add_callback(GradSpikeAtStep(step=3, scale=1e4))
    trainer.add_callback(CorruptOptimizerState(step=2))  # after the guards' step-end work, as in both runs
    trainer.train()
    return trainer


def test_all_layers_observing_train_like_all_layers_off(tiny_model_dir, tmp_path):
    off = _train(tiny_model_dir, tmp_path / "off", {})
    observing = _train(tiny_model_dir, tmp_path / "observe", guard_parts(observing_guards()))

    losses = per_step(off.state.log_history, "loss")
    assert len(losses) == STEPS
    assert per_step(observing.state.log_history, "loss") == losses
    assert per_step(observing.state.log_history, "reward") == per_step(off.state.log_history, "reward")
    assert per_step(observing.state.log_history, "grad_norm") == per_step(off.state.log_history, "grad_norm")
    assert_same_weights(weights(observing.model), weights(off.model))
    assert observing.beta == BETA and observing.entropy_coef == off.entropy_coef
    assert observing._entropy_bonus_enabled == off._entropy_bonus_enabled

    log = observing.state.log_history
    last = {k: v for row in log for k, v in row.items()}  # the last logged value of every metric
    assert last[GEPO_WOULD_SKIP] == 1 and last[gepo_would_skip("spike")] == 1  # the x1e4 step, taken anyway
    assert last[GEPO_SKIPPED_STEPS] == 0
    # the inf moment (one entry, finite weights): act mode would repair it in place; nothing was repaired or rolled back
    assert last[OPEFO_WOULD_REPAIR] >= 1 and last[OPEFO_WOULD_ROLLBACK] == 0
    assert OPEFO_ROLLBACKS not in last and OPEFO_REPAIRS not in last
    coefs = per_step(log, QUATRO_KL_COEF_WOULD)
    # step 1's KL is exactly 0 (the policy is the reference): x0.8; then above the tiny target: x1.2 per step
    assert coefs[-1] == pytest.approx(BETA * 0.8 * 1.2 ** (STEPS - 1))
    assert sum(per_step(log, quatro_would_filter("length"))) > 0
    assert all(math.isfinite(v) for v in per_step(log, QUATRO_WOULD_FILTER_SHARE))
    assert per_step(log, GEPO_WOULD_ADV_DIFF_MEAN) and per_step(log, GRADE_SCALED_STD)
    overhead = per_step(log, GUARD_SECONDS)
    assert len(overhead) == STEPS and all(s > 0 for s in overhead)  # the exact overhead figure of observing
    cost = json.loads((tmp_path / "observe" / "guard_cost.json").read_text())
    assert cost["steps"] == STEPS and not (tmp_path / "off" / "guard_cost.json").exists()
    assert sum(cost["seconds_by_part"].values()) == pytest.approx(cost["guard_seconds"], rel=1e-4)
    assert cost["guard_seconds"] == pytest.approx(observing.ctx.seconds, abs=1e-6)
    assert {"gepo/spike", "grade", "opefo/state", "quatro/filters", "quatro/controllers"} <= set(
        cost["seconds_by_part"]
    )
    # every layer observing: the filters' length history is QUATRO's; OPEFO observing keeps no snapshot in memory
    history_mib = LENGTH_HISTORY * 8 / 2**20
    assert cost["held_mib_by_part"]["quatro"] == pytest.approx(history_mib, abs=1e-3)

    # the doctor's summary of the run says what each layer would have done
    text = format_observe_summary(History(rows=[r for r in log if "step" in r]), run_dir=None)
    assert "GEPO (guards.gepo.mode: observe)" in text and "would have skipped 1 of 4" in text
    assert "OPEFO (guards.opefo.mode: observe)" in text and "guards.opefo.mode=act applies it" in text
    assert "QUATRO (guards.quatro.mode: observe)" in text


def test_observing_guards_resume_exactly(tiny_model_dir, tmp_path):
    """Observing guards' state (spike EMA, would-counters, controllers, GRADE's window) survives a resume."""
    guards = observing_guards
    args = dict(max_steps=STEPS, beta=BETA, save_strategy="steps", save_steps=2)

    def run(out, resume=None):
        trainer = tiny_grpo_trainer(tiny_model_dir, out, guard_parts(guards()), **args)
        trainer.add_callback(GradSpikeAtStep(step=3, scale=1e4))
        trainer.add_callback(CorruptOptimizerState(step=2))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "straight" / "checkpoint-2"))
    assert_same_weights(weights(resumed.model), weights(straight.model))
    for name in (GEPO_WOULD_SKIP, OPEFO_WOULD_ROLLBACK, QUATRO_KL_COEF_WOULD, GRADE_SCALED_STD):
        assert per_step(resumed.state.log_history, name)[-1] == per_step(straight.state.log_history, name)[-1], name
