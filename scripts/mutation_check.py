"""Mutation check: cut a guard off from training, one small patch at a time, and see a test fail.

Each mutant is a named textual patch of the source (an exact string replaced once) that breaks the seam between a
guard and training the way an audit did (issue 14): the trainer ignoring GEPO's advantages, GRADE's rewards dropped
before the advantages or before GAE, the spike guard deciding on the clipped norm, guard state missing from
checkpoints, a rollback that restores nothing. For each mutant the script patches a scratch copy of the working
tree (tracked and untracked-but-not-ignored files; this checkout is never touched), runs the tests that should kill
it, and records whether they failed. Every mutant must be killed; a surviving one means a seam without a test.

    flock /tmp/steadyrl-cpu.lock python scripts/mutation_check.py                 # all mutants, baseline first
    python scripts/mutation_check.py --only gepo_advantage_ignored --no-baseline  # one mutant

The table goes to stdout and ``docs/results/mutation_check.json``; exit status 1 when a mutant survived, the baseline
failed, or a patch no longer applies (the source moved on: update the mutant's text).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results" / "mutation_check.json"
IT = "tests/integration"


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str  # the defect, in words
    patches: tuple[tuple[str, str, str], ...]  # (file, old, new): old must occur exactly once
    tests: tuple[str, ...]  # pytest node ids that must fail


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "gepo_advantage_ignored",
        "the trainer trains on TRL's mean/std advantages, not GEPO's",
        (
            (
                "steadyrl/trainers/advantage_pipeline.py",
                "self.advantage_fn = advantage_fn or partial(",
                "self.advantage_fn = partial(",
            ),
        ),
        (f"{IT}/test_signal_guards.py::test_trl_loss_receives_gepo_advantages_element_by_element",),
    ),
    Mutant(
        "gepo_uses_mean_std",
        "GEPO's advantage function centres on the mean instead of the median",
        (
            (
                "steadyrl/guards/robust_advantage.py",
                "centre = nan_median(r, dim=1, keepdim=True)\n    mad = ",
                "centre = torch.nanmean(r, dim=1, keepdim=True)\n    mad = ",
            ),
        ),
        ("tests/unit/test_gepo.py", "tests/unit/test_advantages.py"),
    ),
    Mutant(
        "grade_dropped_grpo",
        "GRADE's scaled rewards are thrown away before GRPO's advantages",
        (
            (
                "steadyrl/trainers/advantage_pipeline.py",
                "            rewards = scaled\n",
                "            rewards = scaled if type(self).__name__ == 'SequenceRewardPipeline' else rewards\n",
            ),
        ),
        (f"{IT}/test_signal_guards.py::test_grade_scaled_rewards_reach_the_grpo_advantages",),
    ),
    Mutant(
        "grade_dropped_ppo",
        "GRADE's scaled rewards are thrown away before PPO's GAE",
        (
            (
                "steadyrl/trainers/advantage_pipeline.py",
                "            rewards = scaled\n",
                "            rewards = rewards if type(self).__name__ == 'SequenceRewardPipeline' else scaled\n",
            ),
        ),
        (f"{IT}/test_ppo.py::test_grade_feeds_gae_and_the_spike_guard_watches_the_joint_step",),
    ),
    Mutant(
        "spike_on_clipped_norm",
        "the spike guard decides on the already-clipped norm (single process / DDP path)",
        (
            (
                "steadyrl/trainers/step_gate.py",
                "        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())\n",
                "        if grads and max_grad_norm > 0:\n"
                "            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)\n"
                "        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())\n",
            ),
        ),
        (f"{IT}/test_spike_skip.py::test_finite_spike_is_skipped_on_the_pre_clip_norm",),
    ),
    Mutant(
        "spike_state_not_checkpointed",
        "the spike guard's EMA and counters are left out of checkpoints",
        (
            (
                "steadyrl/trainers/grpo.py",
                '        layers += [(f"step_guard_{i}", g) for i, g in enumerate(p.step_guards_in(observing=False))]\n',
                "",
            ),
        ),
        (f"{IT}/test_resume.py::test_resume_is_exact_with_every_stateful_guard",),
    ),
    Mutant(
        "kl_factor_not_checkpointed",
        "GRADE's KL-compensation factor of beta is left out of checkpoints",
        (
            (
                "steadyrl/trainers/grpo.py",
                '            self.guard_state.stateful.setdefault("beta_factors", trl_state.BetaFactors(self))\n',
                "            pass\n",
            ),
        ),
        (f"{IT}/test_resume.py::test_resume_is_exact_with_every_stateful_guard",),
    ),
    Mutant(
        "resume_skips_guard_state",
        "resume restores no guard state (steadyrl_state.pt is read and ignored)",
        (
            (
                "steadyrl/trainers/checkpoints.py",
                '    state.load_guard_state_dicts(shared["guards"], where=str(folder))\n',
                "    pass\n",
            ),
        ),
        (f"{IT}/test_resume.py::test_resume_is_exact_with_every_stateful_guard",),
    ),
    Mutant(
        "fp16_no_unscale",
        "under fp16's GradScaler the gate decides on (and clips) the scaled gradients",
        (("steadyrl/trainers/step_gate.py", "scaler.unscale_(optimizer.optimizer)\n", "pass\n"),),
        (f"{IT}/test_step_guard.py",),
    ),
    Mutant(
        "rollback_lr_from_snapshot",
        "after a rollback the recovery LR factor scales the snapshot's LR, not the current schedule's",
        (("steadyrl/trainers/recovery.py", "group.update(current)\n", "pass\n"),),
        (f"{IT}/test_opefo.py::test_recovery_lr_factor_scales_the_current_schedule_not_the_snapshot",),
    ),
    Mutant(
        "zero2_fp32_partitions_not_restored",
        "a ZeRO-2 rollback restores the bf16/fp32 weights but not ZeRO's fp32 master partitions",
        (("steadyrl/trainers/recovery.py", "live.copy_(saved.to(live.device))\n", "pass\n"),),
        (f"{IT}/test_launch.py::test_nan_in_one_ranks_optimizer_state_rolls_back_every_rank[zero2]",),
    ),
    Mutant(
        "rollback_restores_nothing",
        "an OPEFO rollback restores neither the weights nor the optimizer state",
        (
            (
                "steadyrl/trainers/recovery.py",
                '            p.copy_(payload["params"][name].to(p.device))\n',
                "            pass\n",
            ),
            (
                "steadyrl/trainers/recovery.py",
                '    base.load_state_dict(payload["optimizer"])\n',
                "",
            ),
        ),
        (f"{IT}/test_opefo.py::test_inf_in_exp_avg_sq_rolls_back_and_recovers",),
    ),
    Mutant(
        "kl_auto_target_not_calibrated",
        "the auto KL target ignores the run's own KL and falls to TARGET_MIN",
        (
            (
                "steadyrl/guards/kl_controller.py",
                "self.target = max(c.target_ratio * sum(tail) / len(tail), TARGET_MIN)",
                "self.target = TARGET_MIN",
            ),
        ),
        ("tests/unit/test_quatro.py::test_kl_auto_target_is_calibrated_from_the_runs_own_kl_at_the_users_beta",),
    ),
    Mutant(
        "spike_without_ratio_floor",
        "the spike test is the z-score alone: a run with a tiny spread skips healthy 2x steps",
        (("steadyrl/guards/spike.py", "margin = math.log(c.min_ratio)", "margin = 0.0"),),
        ("tests/unit/test_spike.py::test_the_ratio_floor_holds_where_the_spread_is_tiny",),
    ),
    Mutant(
        "spike_noisy_window_hides_spikes",
        "a noisy window lifts the spike threshold without bound (no max_ratio): a x1e4 gradient goes through",
        (
            (
                "steadyrl/guards/spike.py",
                "min(c.z_threshold * self._spread(median), math.log(c.max_ratio))",
                "c.z_threshold * self._spread(median)",
            ),
        ),
        ("tests/unit/test_spike.py::test_a_noisy_window_never_lifts_the_threshold_past_max_ratio",),
    ),
    Mutant(
        "spike_blind_in_warm_up",
        "no spike test before warmup_steps norms: a x1e4 gradient early in the run goes through",
        (
            (
                "steadyrl/guards/spike.py",
                "if not self.window or not c.tests_spikes:",
                "if len(self.window) < c.warmup_steps or not c.tests_spikes:",
            ),
        ),
        ("tests/unit/test_spike.py::test_warm_up_has_the_ratio_floor_only_from_the_first_norm",),
    ),
    Mutant(
        "ledger_never_closes_a_step",
        "the trainer never ends a step in the interventions ledger: nothing counted, the summary says 0 steps",
        (("steadyrl/trainers/step_end.py", "        t.close_ledger_step()\n", ""),),
        (f"{IT}/test_spike_skip.py::test_the_interventions_ledger_counts_the_skip_and_nothing_else",),
    ),
    Mutant(
        "length_filter_on_percentiles",
        "the length filter drops every length outside the rolling quartiles (no fences): healthy rows dropped",
        (("steadyrl/guards/rollout_filters.py", "LENGTH_FENCE = 3.0", "LENGTH_FENCE = 0.0"),),
        ("tests/unit/test_quatro.py::test_the_rolling_length_range_is_tukeys_far_out_fences",),
    ),
    Mutant(
        "gepo_robust_on_every_group",
        "GEPO puts every group on median/MAD with the tanh clip: a bounded reward's small differences muted",
        (
            (
                "steadyrl/guards/robust_advantage.py",
                "    if outlier_z == 0:\n        return enough",
                "    return enough",
            ),
        ),
        ("tests/unit/test_gepo.py::test_a_bounded_reward_keeps_trls_advantage_and_its_small_differences",),
    ),
    Mutant(
        "degenerate_filters_drop_unpaid_rows",
        "the parrot and repetition filters drop rows below their group's mean too: negative signal thrown away",
        (
            (
                "steadyrl/guards/rollout_filters.py",
                "    return (torch.isfinite(values) & (values > mean))",
                "    return (torch.isfinite(values) | (values > mean))",
            ),
        ),
        ("tests/unit/test_quatro.py::test_parrot_repetition_and_reason_order",),
    ),
    Mutant(
        "zscore_filter_on_by_default",
        "the reward z-score filter runs by default: the rare right answer of a sparse reward is dropped",
        (
            (
                "steadyrl/guards/rollout_filters.py",
                "    enabled: bool = False  # off: on a sparse",
                "    enabled: bool = True  # off: on a sparse",
            ),
        ),
        ("tests/unit/test_quatro.py::test_zscore_drops_only_the_outlier_and_ignores_nan",),
    ),
    Mutant(
        "gold_watch_never_restores",
        "a confirmed reward-gold divergence only lowers the learning rate: the gamed policy trains on",
        (
            (
                "steadyrl/callbacks/gold_watch.py",
                "        self._restore()\n        drop_buffered_rollouts(self.trainer)",
                "        drop_buffered_rollouts(self.trainer)",
            ),
        ),
        (
            "tests/integration/test_gold_watch.py::test_a_divergence_restores_the_best_policy_exactly_and_training_goes_on",
        ),
    ),
    Mutant(
        "gold_watch_mode_min_ignored",
        "guards.quatro.gold.mode: min is read as max: an error rate that rises reads as a better policy",
        (
            (
                "steadyrl/guards/gold_watch.py",
                '        return 1.0 if self.mode == "max" else -1.0',
                "        return 1.0",
            ),
        ),
        ("tests/unit/test_gold_watch.py::test_mode_min_reads_a_rise_as_the_fall_and_keeps_the_lowest_upper_bound",),
    ),
    Mutant(
        "gold_watch_relative_drop_ignored",
        "guards.quatro.gold.relative_drop is accepted and never read",
        (
            (
                "steadyrl/guards/gold_watch.py",
                "        relative = self.relative_drop * abs(self.best_gold) if self.best_gold is not None else 0.0",
                "        relative = 0.0",
            ),
        ),
        ("tests/unit/test_gold_watch.py::test_relative_drop_sets_the_floor_in_units_of_the_reference",),
    ),
    Mutant(
        "gold_watch_cut_lasts_one_step",
        "the gold watch's LR cut is written once: a schedule that rewrites the groups (DeepSpeed's) undoes it",
        (
            (
                "steadyrl/trainers/step_end.py",
                "            trl_state.apply_lr_factors(t, lr_factor)",
                "            pass",
            ),
        ),
        (
            "tests/integration/test_gold_watch.py::test_a_divergence_restores_the_best_policy_exactly_and_training_goes_on",
        ),
    ),
    Mutant(
        "gold_watch_trains_on_the_left_policys_rollouts",
        "after a gold rollback TRL's buffered rollouts and the replay rows of the gamed policy are trained on",
        (("steadyrl/trainers/trl_state.py", "    trainer._buffered_inputs = None\n", ""),),
        ("tests/unit/test_gold_station.py::test_a_restore_drops_trls_buffered_rollouts_and_the_replay_rows",),
    ),
    Mutant(
        "opefo_rollback_undoes_the_gold_watch",
        "an OPEFO rollback restores the gold watch's state from its snapshot: its best, counts and tightening reset",
        (("steadyrl/trainers/checkpoints.py", 'NOT_IN_SNAPSHOTS = ("gold",)', "NOT_IN_SNAPSHOTS = ()"),),
        (
            "tests/unit/test_gold_station.py::"
            "test_the_watch_state_stays_out_of_opefo_snapshots_and_of_the_restored_beta_factors",
        ),
    ),
    Mutant(
        "gold_watch_tightening_not_carried",
        "the gold watch's tightening is not guard state: a resume trains at the full learning rate again",
        (("steadyrl/trainers/gold.py", '        self.tightenings = int(state.get("tightenings", 0))', "        pass"),),
        ("tests/unit/test_gold_station.py::test_the_tightening_is_state_and_a_state_from_before_it_loads_untightened",),
    ),
    Mutant(
        "gold_watch_beta_cut_unlogged",
        "with the KL controller off nothing logs the gold watch's beta x 2: the ledger never counts it",
        (
            (
                "steadyrl/trainers/step_end.py",
                "            if t.step_end.kl is None and t.beta_base > 0:",
                "            if False:",
            ),
        ),
        (
            "tests/integration/test_gold_watch.py::"
            "test_with_the_kl_controller_off_the_watchs_beta_factor_is_logged_and_counted",
        ),
    ),
    Mutant(
        "best_gold_state_read_per_rank_under_ddp",
        "every rank reads its own best-gold state file: after a resume on more processes the first rollback dies",
        (
            (
                "steadyrl/trainers/best_policy.py",
                "    state_file = folder / (rank_state(acc.process_index) if zero is not None else SHARED_STATE)",
                "    state_file = folder / rank_state(acc.process_index)",
            ),
        ),
        (
            f"{IT}/test_launch.py::"
            "test_resume_on_another_number_of_processes_drops_per_rank_state_and_rolls_back_to_a_best_kept_by_one",
        ),
    ),
    Mutant(
        "best_gold_other_layout_master_not_refreshed",
        "a ZeRO best kept on another number of ranks restores the weights but not ZeRO's fp32 master copy: the next "
        "step moves on from the diverged weights",
        (
            (
                "steadyrl/trainers/best_policy.py",
                "        if zero is not None:\n            zero.refresh_fp32_params()\n",
                "",
            ),
        ),
        (
            "tests/integration/test_gold_watch.py::"
            "test_a_zero2_resume_on_two_processes_rolls_back_to_a_best_one_process_kept_before_the_checkpoint",
        ),
    ),
    Mutant(
        "decoupled_checkpoint_engine_accepted",
        "a DeepSpeed decoupled checkpoint engine is accepted: checkpoints published before their optimizer state",
        (
            (
                "steadyrl/config/checks.py",
                '    if not (datastates or (isinstance(writer, dict) and writer.get("decoupled"))):',
                "    if True:",
            ),
        ),
        ("tests/unit/test_config.py::test_deepspeeds_decoupled_checkpoint_engines_are_refused",),
    ),
    Mutant(
        "best_gold_weights_twice",
        "best-gold/ keeps the trainable tensors again beside the model save_model wrote (twice the weights)",
        (
            (
                "steadyrl/trainers/best_policy.py",
                '            torch.save(cpu_copy({"optimizer": base.state_dict()}), staged / SHARED_STATE)',
                "            params = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}\n"
                '            torch.save(cpu_copy({"optimizer": base.state_dict(), "params": params}), '
                "staged / SHARED_STATE)",
            ),
        ),
        (
            "tests/integration/test_gold_watch.py::test_a_divergence_restores_the_best_policy_exactly_and_training_goes_on",
        ),
    ),
    Mutant(
        "best_gold_written_outside_the_checkpoint_path",
        "a full disk while keeping a new best: a partial copy and a raw error, not the checkpoints' handling",
        (
            (
                "steadyrl/trainers/best_policy.py",
                '    save_atomically(acc, folder.parent, int(meta["step"]), None, write, name=folder.name)',
                "    write(folder.parent, folder)",
            ),
        ),
        (
            "tests/integration/test_gold_watch.py::"
            "test_a_full_disk_while_keeping_a_new_best_stops_the_run_and_keeps_the_last_best_whole",
        ),
    ),
    Mutant(
        "gold_watch_not_built_from_python",
        "SteadyGRPOTrainer(guards=...) with TRL's own eval never builds the gold watch",
        (
            (
                "steadyrl/trainers/grpo.py",
                "        self.gold_watch = self._trl_eval_gold_watch()",
                "        self.gold_watch = None",
            ),
        ),
        ("tests/integration/test_gold_watch.py::test_the_python_api_runs_the_watch_on_trls_own_eval",),
    ),
    Mutant(
        "gold_watch_trl_eval_without_noise",
        "the watch reads TRL's eval mean with no standard error: drop alone decides, so sampling noise is a fall",
        (
            (
                "steadyrl/trainers/gold.py",
                "    return float(std) / prompts**0.5 if std is not None else None",
                "    return None",
            ),
        ),
        (
            "tests/unit/test_gold_station.py::"
            "test_trls_eval_gives_the_weight_0_rewards_mean_and_its_standard_error_over_prompts",
        ),
    ),
    Mutant(
        "storage_plan_never_refuses",
        "a run that would fill its disk starts anyway: under DeepSpeed it hangs or dies mid-save hours later",
        (("steadyrl/storage.py", "    if storage.peak > room:", "    if False:"),),
        (
            "tests/integration/test_storage_plan.py::test_a_run_that_would_fill_its_disk_stops_before_the_model_loads",
            "tests/unit/test_storage.py::test_refuses_past_the_free_space_warns_near_it_and_counts_what_a_resume_replaces",
        ),
    ),
    Mutant(
        "storage_plan_forgets_zeros_master_copy",
        "the plan leaves out ZeRO's fp32 master copy: a 7B checkpoint is planned 30 GB short",
        (
            (
                "steadyrl/storage.py",
                "    adam = 2 * pt * moment + (4 * pt if zero else 0)",
                "    adam = 2 * pt * moment",
            ),
        ),
        ("tests/unit/test_storage.py::test_full_fine_tuning_under_zero_by_hand",),
    ),
    Mutant(
        "gold_watch_end_swap_after_the_summary",
        "the gold watch is added after the run summary: interventions.json is written before the run's end swap",
        (
            (
                "steadyrl/trainers/build.py",
                "            trainer.add_guard_callback(watch)",
                "            trainer.add_callback(watch)",
            ),
        ),
        ("tests/integration/test_gold_watch.py::test_a_run_the_watch_acted_on_ends_on_the_best_policy",),
    ),
    Mutant(
        "gold_watch_blind_after_an_eval_before_training",
        "a best policy from the eval before training (no reward yet) gets no reward bar: gaming reads as a collapse",
        (
            (
                "steadyrl/guards/gold_watch.py",
                "        if not math.isfinite(self.reward_at_best) and math.isfinite(reward):",
                "        if False:",
            ),
        ),
        (
            "tests/unit/test_gold_watch.py::"
            "test_an_eval_before_training_as_the_best_takes_the_first_reward_after_it_as_its_bar",
        ),
    ),
    Mutant(
        "gold_watch_bar_from_a_collapsed_interval",
        "after an eval before training the reward bar is the first interval's mean: a collapse inside it looks held",
        (("steadyrl/guards/gold_watch.py", "            if math.isfinite(first_reward):", "            if False:"),),
        (
            "tests/unit/test_gold_watch.py::test_a_collapse_inside_the_first_interval_is_a_regression_by_the_first_"
            "reward_after_the_eval_before_training",
        ),
    ),
    Mutant(
        "gold_watch_ignores_eval_noise",
        "a fall counts past drop alone: a plateau's luckiest sampled eval makes later ones falls (12-90 % of runs)",
        (
            (
                "steadyrl/guards/gold_watch.py",
                "        return max(self.drop, relative, self.z * math.hypot(self.best_se, _se(gold_se)))",
                "        return max(self.drop, relative)",
            ),
        ),
        ("tests/unit/test_gold_watch.py::test_a_plateaus_lucky_best_is_not_a_fall_but_a_fall_beyond_the_noise_is",),
    ),
    Mutant(
        "gold_watch_reference_is_the_luckiest_eval",
        "the reference is the highest single eval, however noisy, not the highest lower bound",
        (
            (
                "steadyrl/guards/gold_watch.py",
                "        if self.sign * gold - self.z * _se(gold_se) > self.best_bound:",
                "        if self.best_gold is None or gold > self.best_gold:",
            ),
        ),
        ("tests/unit/test_gold_watch.py::test_the_reference_is_the_highest_lower_bound_not_the_luckiest_eval",),
    ),
    Mutant(
        "gold_watch_reward_held_by_a_coin_flip",
        "the training reward 'holds' only when not below its level at the reference: noise labels gaming a regression",
        (
            (
                "steadyrl/guards/gold_watch.py",
                "        allowed = max(self.reward_slack, self.z * math.hypot(self.reward_se_at_best, _se(reward_se)))",
                "        allowed = self.reward_slack",
            ),
        ),
        ("tests/unit/test_gold_watch.py::test_the_reward_holds_by_a_test_and_labels_the_fall",),
    ),
    Mutant(
        "gold_watch_blind_to_regressions",
        "a gold metric that falls with the training reward (a run failing by itself) is never acted on",
        (
            (
                "steadyrl/guards/gold_watch.py",
                "        self.streak = self.streak + 1 if falling and (held or self.regression) else 0",
                "        self.streak = self.streak + 1 if falling and held else 0",
            ),
        ),
        (
            "tests/unit/test_gold_watch.py::test_healthy_and_noisy_runs_are_not_confirmed_and_a_collapse_is_a_regression",
        ),
    ),
    Mutant(
        "eval_standard_error_not_logged",
        "the periodic eval logs no standard error: the gold watch falls back to a bound or to drop alone",
        (
            (
                "steadyrl/callbacks/periodic_eval.py",
                "        metric_se = sample_mean_se(values[2 * k], values[-3], values[2 * k + 1])",
                "        metric_se = math.nan",
            ),
        ),
        ("tests/unit/test_periodic_eval.py::test_numbers_match_evaluate_rewards_and_hand_values",),
    ),
    Mutant(
        "doctor_eval_fall_ignores_noise",
        "the doctor reads an eval fall past eval_drop alone: a sampled plateau's lucky best reads as a regression",
        (
            (
                "steadyrl/evidence/doctor.py",
                "    margin = max(config.eval_drop, config.eval_z * float(np.hypot(",
                "    margin = max(config.eval_drop, 0 * float(np.hypot(",
            ),
        ),
        ("tests/unit/test_doctor.py::test_an_eval_fall_inside_its_noise_is_no_regression_and_outside_it_is",),
    ),
    Mutant(
        "doctor_calls_a_collapsed_run_healthy",
        "a run whose reward fell to 0 by itself (a learning rate 30x too high) is not a regression",
        (
            (
                "steadyrl/evidence/doctor.py",
                "    fell = reward.z <= -config.reward_fall_z and early - late",
                "    fell = False and early - late",
            ),
        ),
        (
            "tests/unit/test_doctor.py::test_a_run_that_failed_by_itself_is_a_regression_with_no_learning_signal_never_healthy",
        ),
    ),
    Mutant(
        "gold_eval_without_its_own_reward_row_has_no_reward",
        "an eval with no reward row logged since the previous one (logging_steps 10, eval.every 5) has no reward "
        "level: with regression off the streak restarts and a divergence is never confirmed",
        (
            (
                "steadyrl/guards/gold_watch.py",
                "        if self.since:\n            self.last, self.since = self.since, []\n        return self.last",
                "        out, self.since = self.since, []\n        return out",
            ),
        ),
        ("tests/unit/test_gold_watch.py::test_a_divergence_is_confirmed_when_trl_logs_less_often_than_the_eval_runs",),
    ),
    Mutant(
        "gold_resume_forgets_the_rewards_before_the_checkpoint",
        "a resumed run judges the eval it runs first with no reward level: a pending streak restarts",
        (
            (
                "steadyrl/callbacks/gold_watch.py",
                "        for row in state.log_history:\n            self._rewards.add(row.get(REWARD))",
                "        for row in []:\n            self._rewards.add(row.get(REWARD))",
            ),
        ),
        (
            "tests/unit/test_gold_watch.py::test_a_resumed_run_judges_its_first_eval_with_the_rewards_logged_before_"
            "the_checkpoint",
        ),
    ),
    Mutant(
        "gold_restores_an_earlier_runs_best",
        "with save_best: false the watch restores a best-gold/ an earlier run left in the output_dir",
        (
            (
                "steadyrl/callbacks/gold_watch.py",
                "        return self.config.save_best and (self.best_dir / META).is_file()",
                "        return (self.best_dir / META).is_file()",
            ),
        ),
        (f"{IT}/test_gold_watch.py::test_save_best_false_never_restores_a_best_policy_left_by_an_earlier_run",),
    ),
    Mutant(
        "gold_best_pushed_to_the_hub",
        "with push_to_hub set, every new best of the gold watch uploads the whole output_dir",
        (
            (
                "steadyrl/trainers/best_policy.py",
                "        trainer.save_model(str(staged), _internal_call=True)",
                "        trainer.save_model(str(staged))",
            ),
        ),
        (f"{IT}/test_gold_watch.py::test_a_divergence_restores_the_best_policy_exactly_and_training_goes_on",),
    ),
    Mutant(
        "save_started_on_a_full_disk",
        "a checkpoint save starts with less free space than the last checkpoint took (under DeepSpeed: a hang)",
        (("steadyrl/trainers/checkpoints.py", "    if free >= need:\n        return None", "    return None"),),
        (
            "tests/unit/test_disk_full.py::test_a_save_is_not_started_when_the_disk_has_less_room_than_the_last_checkpoint_took",
        ),
    ),
    Mutant(
        "python_api_without_the_monitor",
        'SteadyGRPOTrainer(guards="all") from Python builds no SignalMonitor: GEPO\'s early warnings never run',
        (
            (
                "steadyrl/trainers/grpo.py",
                "        if p.monitor is not None and not any(",
                "        if False and not any(",
            ),
        ),
        (f"{IT}/test_guards_argument.py::test_every_layer_on_at_trls_default_beta_0_trains",),
    ),
    Mutant(
        "safetensors_error_is_not_a_failed_save",
        "a full disk while safetensors writes the weights raises its own SafetensorError: a raw traceback",
        (("steadyrl/trainers/checkpoints.py", "SAVE_ERRORS = (Exception,)", "SAVE_ERRORS = (OSError, RuntimeError)"),),
        (
            f"{IT}/test_disk_full_checkpoint.py::test_a_full_disk_while_trl_saves_the_optimizer_stops_the_run_cleanly"
            "[SafetensorsFullAtCheckpoint4-SafetensorError: Error while serializing: IoError(Os { code: 28, kind: "
            "StorageFull })]",
        ),
    ),
    Mutant(
        "mismatch_quantiles_of_the_whole_batch",
        "the mismatch ratio quantiles read every token: past 2^24 tokens torch.quantile raises and the step dies",
        (("steadyrl/guards/mismatch.py", "    if x.numel() <= size:\n        return x", "    return x"),),
        ("tests/unit/test_mismatch.py::test_ratio_quantiles_of_a_batch_past_torch_quantiles_limit",),
    ),
    Mutant(
        "spike_regime_becomes_the_baseline",
        "4 spikes of x1e4 in a row rebase the spike guard's baseline: the poisoned regime is trained on",
        (
            (
                "steadyrl/guards/spike.py",
                "        return max(self._spike_norms[-c.rebase_after :]) <= c.max_ratio * baseline",
                "        return True",
            ),
        ),
        ("tests/unit/test_spike.py::test_a_streak_above_max_ratio_is_never_a_level_shift_and_stops_the_run",),
    ),
    Mutant(
        "stopped_reward_leaves_its_processes",
        "a reward call stopped at its deadline leaves the processes it started running (a sandbox per timeout)",
        (
            (
                "steadyrl/rewards/guarded.py",
                "        late = _started_since(self.t0)\n",
                "        late = []\n        self.started = []\n",
            ),
        ),
        ("tests/unit/test_reward_timeout.py::test_a_stopped_call_takes_the_processes_it_started_with_it",),
    ),
    Mutant(
        "stopped_reward_leaves_its_alarm",
        "a reward call stopped at its deadline leaves the SIGALRM it armed, to fire later in training code",
        (
            (
                "steadyrl/rewards/guarded.py",
                "                signal.setitimer(signal.ITIMER_REAL, 0)",
                "                pass",
            ),
        ),
        ("tests/unit/test_reward_timeout.py::test_a_stopped_call_leaves_no_sigalrm_armed",),
    ),
    Mutant(
        "async_reward_wrapped_sync",
        "an async def reward gets the plain wrapper: TRL never awaits it and the run stops on 'returned coroutine'",
        (
            (
                "steadyrl/rewards/guarded.py",
                "    cls = AsyncGuardedReward if is_async_reward(fn) else GuardedReward",
                "    cls = GuardedReward",
            ),
        ),
        ("tests/unit/test_reward_async.py::test_an_async_reward_stays_async_so_trl_awaits_it",),
    ),
    Mutant(
        "async_reward_timeout_ignored",
        "an async reward's timeout is not applied: a judge that never answers hangs the step",
        (
            (
                "steadyrl/rewards/guarded.py",
                "            async with asyncio.timeout(timeout):",
                "            async with asyncio.timeout(None):",
            ),
        ),
        ("tests/unit/test_reward_async.py::test_an_async_reward_past_its_timeout_is_cancelled_and_named",),
    ),
    Mutant(
        "doctor_reads_a_reward_fall_over_3_steps",
        "the doctor's reward-fall rule reads windows of any length: a healthy run's early dip is a regression",
        (
            (
                "steadyrl/evidence/doctor.py",
                "    fell = fell and reward.w >= config.reward_fall_points",
                "    fell = fell and reward.w >= 2",
            ),
        ),
        ("tests/unit/test_doctor.py::test_a_reward_dip_over_windows_shorter_than_reward_fall_points_is_no_regression",),
    ),
    Mutant(
        "monitor_entropy_ignores_noise",
        "the monitor's entropy warning ignores the windows' noise: a fall within 2 standard errors warns",
        (
            (
                "steadyrl/evidence/early_warnings.py",
                " or before - now <= ENTROPY_Z * se:",
                " or before - now <= 0 * se:",
            ),
        ),
        ("tests/unit/test_monitor.py::test_entropy_drop_within_the_noise_does_not_warn",),
    ),
    Mutant(
        "monitor_entropy_reads_the_adjacent_window_only",
        "the monitor's entropy warning compares the last window with the one just before it, not the highest of its "
        "lookback: a fall in steps misses",
        (
            (
                "steadyrl/evidence/early_warnings.py",
                "    start = max(range(len(values) - 2 * w + 1), key=lambda i: statistics.fmean(values[i : i + w]))",
                "    start = len(values) - 2 * w",
            ),
        ),
        ("tests/unit/test_monitor.py::test_entropy_drop_reads_the_highest_earlier_window_of_the_lookback",),
    ),
    Mutant(
        "doctor_misses_a_fall_the_run_recovered_from",
        "the doctor reads only the last eval against the best: a run that fell to 0.12 and ended at 0.39 is healthy",
        (
            (
                "steadyrl/evidence/doctor.py",
                '    if any(e.get("verdict") for e in history.events_of(M.EVENT_GOLD_ROLLBACK)):\n        return None',
                "    return None",
            ),
        ),
        (
            "tests/unit/test_doctor.py::test_a_run_that_fell_and_partly_recovered_is_a_regression_by_the_gold_watchs_"
            "rule_replayed",
        ),
    ),
    Mutant(
        "doctor_warns_on_runs_that_learn",
        "the doctor's entropy warning fires on a policy sharpening while its reward rises (healthy SmolLM2 runs)",
        (
            (
                "steadyrl/evidence/doctor.py",
                "        return  # a policy sharpening while it learns",
                "        pass  # a policy sharpening while it learns",
            ),
        ),
        ("tests/unit/test_doctor.py::test_entropy_falling_to_a_tenth_while_reward_rises_is_a_run_that_learns",),
    ),
    Mutant(
        "gold_watch_ends_on_the_last_policy",
        "a run the gold watch acted on ends on its last policy, below the best it kept",
        (
            (
                "steadyrl/callbacks/gold_watch.py",
                "        cause = self.station.end_on_best(self._kept())",
                "        cause = None",
            ),
        ),
        ("tests/integration/test_gold_watch.py::test_a_run_the_watch_acted_on_ends_on_the_best_policy",),
    ),
    Mutant(
        "rollout_hacking_warns_on_shorter_answers",
        "the monitor's length-drift warning fires when completions shrink: a run learning a concise format warns",
        (("steadyrl/evidence/doctor.py", ' if hit.fields.get("way") != "shrank"]', "]"),),
        (
            "tests/unit/test_monitor.py::"
            "test_no_rollout_hacking_warning_on_a_run_that_learns_shorter_answers_or_whose_reward_falls",
        ),
    ),
    Mutant(
        "monitor_never_warns_of_hacking",
        "the monitor never runs the rollout reward-hacking rules",
        (("steadyrl/callbacks/monitor.py", "in rollout_hacking(history):", "in []:"),),
        ("tests/unit/test_monitor.py::test_monitor_warns_once_per_rollout_hacking_rule_while_the_reward_rises",),
    ),
    Mutant(
        "length_rolling_on_by_default",
        "the rolling length range drops by default: a run that learns shorter answers loses them",
        (
            (
                "steadyrl/guards/rollout_filters.py",
                "    rolling: bool = False  # also drop",
                "    rolling: bool = True  # also drop",
            ),
        ),
        ("tests/unit/test_quatro.py::test_default_filters_keep_a_run_that_learns_shorter_answers",),
    ),
    Mutant(
        "kl_controller_on_by_default",
        "the adaptive KL controller steers beta by default, on healthy runs too",
        (("steadyrl/guards/kl_controller.py", "    enabled: bool = False", "    enabled: bool = True"),),
        ("tests/unit/test_config.py::test_quatro_section_builds_its_parts",),
    ),
    Mutant(
        "spike_zero_steps_in_ema",
        "no-signal (zero-norm) steps enter the spike guard's baseline, which then locks out healthy steps",
        (("steadyrl/guards/spike.py", "if norm <= ZERO_NORM:", "if False:"),),
        ("tests/unit/test_spike.py::test_zero_gradient_stretch_does_not_lock_out_healthy_steps",),
    ),
    Mutant(
        "spike_never_rebases",
        "a level shift in the gradient norm is skipped step after step instead of re-anchoring the baseline",
        (
            (
                "steadyrl/guards/spike.py",
                "        if not c.rebase_after or len(self._spike_norms) < c.rebase_after or baseline is None:",
                "        if True:",
            ),
        ),
        ("tests/unit/test_spike.py::test_a_level_shift_rebases_after_rebase_after_spikes_in_a_row",),
    ),
    Mutant(
        "dropped_rows_leave_the_normaliser",
        "filtered rows leave the loss normaliser under the default zero_advantage (the kept rows' LR shifts)",
        (
            (
                "steadyrl/trainers/rollout.py",
                'if self.filter.config.dropped_rows != "exclude":',
                "if False:",
            ),
        ),
        (f"{IT}/test_quatro.py::test_repetition_filter_drops_and_counts_exactly",),
    ),
    Mutant(
        "parrot_counts_padding_windows",
        "the tensor parrot filter counts n-gram windows past a completion's end as prompt copies",
        (
            (
                "steadyrl/guards/rollout_filters.py",
                "hits = ((ordered.gather(1, at) == codes) & grams).sum(dim=1)",
                "hits = (ordered.gather(1, at) == codes).sum(dim=1)",
            ),
        ),
        ("tests/unit/test_rollout_filters_vectorised.py",),
    ),
    Mutant(
        "mismatch_sample_split_evenly",
        "each rank sends an equal share of the mismatch quantile sample, whatever its tokens: a rank with few tokens"
        " weighs as much as one with many",
        (("steadyrl/guards/mismatch.py", "math.ceil(QUANTILE_SAMPLE * n / total)", "QUANTILE_SAMPLE // len(tokens)"),),
        (
            "tests/unit/test_mismatch.py::test_the_gathered_sample_is_bounded_and_drawn_in_proportion_to_each_ranks_tokens",
        ),
    ),
    Mutant(
        "mismatch_measured_on_one_rank",
        "each rank logs mismatch/* of its own rows: the batch's other ranks never enter the ESS or the gate",
        (("steadyrl/guards/mismatch.py", "row.view(1, -1) if processes == 1 or", "row.view(1, -1) if True or"),),
        ("tests/unit/test_mismatch.py::test_two_ranks_measure_the_whole_batch_without_sending_their_matrices",),
    ),
    Mutant(
        "mismatch_ess_counts_the_truncation_band",
        "mismatch/ess reads the raw log-ratio under truncated sampling: an in-sync run's ESS falls with length",
        (("steadyrl/guards/mismatch.py", "excess = per_row if band is None else", "excess = per_row if True else"),),
        ("tests/unit/test_mismatch.py::test_an_in_sync_truncated_batchs_ess_is_one_and_a_stale_one_still_falls",),
    ),
    Mutant(
        "truncated_sequence_mode_accepted",
        "a sequence-level vLLM correction with top_p < 1 / top_k on TRL 1.16 is only warned about, not refused",
        (("steadyrl/config/checks.py", 'if mode.startswith("sequence"):\n        raise', "if False:\n        raise"),),
        ("tests/unit/test_mismatch.py::test_a_sequence_mode_with_truncated_sampling_is_refused_on_trl_1_16",),
    ),
    Mutant(
        "doctor_silent_on_truncation_bias",
        "the doctor never names TRL's truncated-sampling bias of a vLLM run",
        (("steadyrl/evidence/doctor.py", "    if config.truncation is None:\n        return", "    return"),),
        ("tests/unit/test_mismatch.py::test_the_doctor_names_the_truncation_bias_of_a_sequence_mode_run",),
    ),
    Mutant(
        "zero2_model_write_failure_not_agreed",
        "under DeepSpeed a failed model write is kept but not agreed on before DeepSpeed's save: the main process's"
        " own DeepSpeed writes fail while the other rank waits in DeepSpeed's barrier",
        (
            (
                "steadyrl/trainers/grpo.py",
                "checkpoints.agree_before_collectives(self.accelerator, error)",
                "self.scratch.save_error = error",
            ),
        ),
        (
            f"{IT}/test_disk_full_checkpoint.py::test_a_full_disk_on_one_rank_under_zero2_stops_every_rank_without_a_hang"
            "[rank0_model_write]",
        ),
    ),
    Mutant(
        "deepspeed_save_failure_raised_inside",
        "a write that fails inside DeepSpeed's save_checkpoint raises there: the failing rank leaves while the others"
        " wait in DeepSpeed's closing barrier",
        (
            (
                "steadyrl/trainers/checkpoints.py",
                "            except SAVE_ERRORS as exc:\n                held.append(exc)\n                return None",
                "            except SAVE_ERRORS:\n                raise",
            ),
        ),
        (
            f"{IT}/test_disk_full_checkpoint.py::test_a_full_disk_on_one_rank_under_zero2_stops_every_rank_without_a_hang"
            "[rank1_inside_deepspeed_save]",
        ),
    ),
    Mutant(
        "gold_ppo_critic_not_restored",
        "a PPO gold rollback restores the policy and leaves the gamed run's critic",
        (
            (
                "steadyrl/trainers/best_policy.py",
                "model.critic.load_state_dict(load_file(str(folder / CRITIC_FILE)))",
                "pass",
            ),
        ),
        (f"{IT}/test_gold_watch.py::test_a_ppo_rollback_restores_the_policy_and_its_critic_exactly",),
    ),
    Mutant(
        "snapshot_published_without_agreement",
        "each rank publishes its own disk snapshot without the others' word: after one rank's write fails the ranks'"
        " rollback points are different steps",
        (
            (
                "steadyrl/guards/rollback.py",
                "written = (self.last_error is None) if agree is None else agree(self.last_error is None)",
                "written = self.last_error is None",
            ),
        ),
        ("tests/unit/test_opefo.py::test_a_disk_snapshot_one_rank_cannot_write_is_published_by_no_rank",),
    ),
    Mutant(
        "snapshot_failure_uncounted",
        "a disk snapshot that could not be written is warned about but not counted in opefo/snapshot_failures",
        (("steadyrl/trainers/recovery.py", "self.snapshot_failures += 1", "pass"),),
        (f"{IT}/test_opefo.py::test_a_disk_snapshot_that_cannot_be_written_keeps_the_last_one_and_training_goes_on",),
    ),
    Mutant(
        "floor_counts_tiny_entries",
        "the exp_avg_sq floor counts v <= tiny as underflow (the seed's rule): never-touched and tiny-but-healthy too",
        (
            (
                "steadyrl/guards/moment_floor.py",
                "_inconsistent(pv, pm, bound, eps).count_nonzero()",
                "(pv <= TINY).sum()",
            ),
        ),
        (
            "tests/unit/test_opefo.py::test_never_touched_entries_are_not_underflow_and_stay_zero",
            "tests/unit/test_opefo.py::test_tiny_but_consistent_entries_do_not_count_as_underflow",
        ),
    ),
    Mutant(
        "floor_at_the_groups_scale",
        "the exp_avg_sq floor uses one value per param group (its lowest tensor's p10), not each tensor's own",
        (
            (
                "steadyrl/guards/moment_floor.py",
                "value, step = reference\n",
                "value = min(self._reference(t, n, bound, eps, generator, home) or (1.0,) for t, n in"
                " _moments(optimizer, group))[0]\n                    step = reference[1]\n",
            ),
        ),
        ("tests/unit/test_opefo.py::test_a_half_zeroed_tensor_is_floored_at_its_own_scale_not_the_groups",),
    ),
    Mutant(
        "floor_percentile_only",
        "the exp_avg_sq floor raises an underflowed entry to the tensor's percentile only (not to (|m| / s)^2): where v"
        " is spread wide its next step is many times a healthy one",
        (("steadyrl/guards/moment_floor.py", "if step > 0:\n        estimate", "if step < 0:\n        estimate"),),
        (
            "tests/unit/test_opefo.py::test_an_underflowed_entrys_next_step_is_the_tensors_median_step_however_wide_v_is_spread",
        ),
    ),
    Mutant(
        "preemption_writes_no_checkpoint",
        "a SIGTERM stops the run without writing a checkpoint",
        (("steadyrl/callbacks/preemption.py", "control.should_save = True\n", "pass\n"),),
        (f"{IT}/test_preemption.py::test_sigterm_checkpoints_exits_75_and_resumes_exactly",),
    ),
    Mutant(
        "micro_batch_drop_keeps_the_gradient",
        "granularity micro_batch: a dropped micro-batch's gradient stays in the accumulated one",
        (("steadyrl/trainers/micro_batch_gate.py", "            p.grad = before  # back to", "            pass  # "),),
        (
            "tests/unit/test_micro_batch_gate.py::test_the_micro_batch_decision_drops_it_and_trains_on_the_mean_of_the_rest",
            f"{IT}/test_micro_batch_spike.py::test_one_spiking_micro_batch_is_diluted_per_step_and_dropped_per_micro_batch",
        ),
    ),
    Mutant(
        "micro_batch_not_all_reduced",
        "granularity micro_batch under DDP: the kept micro-batches are not averaged over ranks",
        (
            (
                "steadyrl/trainers/micro_batch_gate.py",
                "            buffer = self.ctx.reduce_sum(torch.cat([flat * float(seen), counts]))",
                "            buffer = torch.cat([flat * float(seen), counts])",
            ),
        ),
        (
            "tests/unit/test_micro_batch_gate.py::test_two_ranks_average_every_kept_micro_batch",
            f"{IT}/test_launch.py::test_micro_batch_spike_on_one_rank_is_dropped_and_ranks_stay_equal",
        ),
    ),
    Mutant(
        "opefo_repair_noop",
        "OPEFO reports an in-place repair of non-finite Adam moments but writes nothing",
        (
            (
                "steadyrl/guards/optimizer_state.py",
                "                    piece.masked_fill_(bad, value if key in SECOND_MOMENTS else 0.0)",
                "                    pass",
            ),
        ),
        (
            "tests/unit/test_runtimes.py::test_opefo_repairs_a_few_nonfinite_moments_in_place_without_rollback_or_lr_cut",
            f"{IT}/test_opefo.py::test_inf_in_exp_avg_sq_is_repaired_in_place_with_no_lost_step_and_no_lr_cut",
        ),
    ),
    Mutant(
        "entropy_gate_ignored",
        "the entropy floor turns on while the training reward still rises (the learning gate is cut off)",
        (
            (
                "steadyrl/guards/entropy_floor.py",
                "        if c.enabled and mean < self.floor and rising:  # sharpening that buys reward: leave it",
                "        if False:",
            ),
        ),
        ("tests/unit/test_quatro.py::test_floor_stays_off_while_the_reward_rises_and_acts_once_it_stalls",),
    ),
    Mutant(
        "gepo_bound_on_host",
        "GEPO's clamp bound is a CPU tensor (no device): every layer on died at step 0 on an H200 (7cd9895)",
        (
            (
                "steadyrl/guards/robust_advantage.py",
                "torch.tensor(0.0, dtype=out_dtype)).item()",
                "torch.tensor(0.0, dtype=out_dtype))",
            ),
        ),
        (f"{IT}/test_device_audit.py::test_no_guard_path_mixes_a_host_tensor_with_a_device_tensor",),
    ),
    Mutant(
        "replay_metrics_reduced_on_host",
        "replay's metric sums go into the cross-rank sum as a CPU tensor (NCCL refuses it on GPUs)",
        (
            (
                "steadyrl/trainers/loss.py",
                "        local_t = torch.tensor(local, dtype=torch.float64, device=self.ctx.device)",
                "        local_t = torch.tensor(local, dtype=torch.float64)",
            ),
        ),
        (f"{IT}/test_device_audit.py::test_no_guard_path_mixes_a_host_tensor_with_a_device_tensor",),
    ),
    Mutant(
        "pg_brake_not_applied",
        "the entropy floor's policy-gradient brake computes its factor but the loss trains on the full advantages",
        (
            (
                "steadyrl/trainers/loss.py",
                '            inputs["advantages"] = inputs["advantages"] * scale',
                "            pass",
            ),
        ),
        (f"{IT}/test_quatro.py::test_the_loss_trains_on_the_braked_advantages",),
    ),
    Mutant(
        "brake_moments_not_applied",
        "the entropy floor computes brake_moments' factor but the optimizer steps on the unscaled Adam moments",
        (
            (
                "steadyrl/trainers/step_end.py",
                "                    scale_moments(self._moments, factor)  # before the next update, whose loss the",
                "                    pass  # before the next update, whose loss the",
            ),
        ),
        (f"{IT}/test_quatro.py::test_the_optimizer_steps_on_the_moments_the_brake_scaled",),
    ),
    Mutant(
        "brake_moments_scale_the_critic",
        "under PPO brake_moments also scales the critic's Adam moments, whose value loss the brake does not scale",
        (
            (
                "steadyrl/guards/optimizer_state.py",
                "            if group.get(UNBRAKED_GROUP, False):",
                "            if False:",
            ),
        ),
        (
            f"{IT}/test_ppo.py::test_brake_moments_scale_the_policys_moments_and_leave_the_critics",
            f"{IT}/test_ppo_launch.py::test_brake_moments_under_zero2_scale_the_policys_partition_and_leave_the_critics",
        ),
    ),
    Mutant(
        "brake_moments_drift",
        "the floor returns the factor for the moments but forgets the scale they now follow (the next factor is wrong)",
        (
            (
                "steadyrl/guards/entropy_floor.py",
                "        factor, self.moment_scale = target / self.moment_scale, target",
                "        factor = target / self.moment_scale",
            ),
        ),
        ("tests/unit/test_quatro.py::test_brake_moments_follow_the_brake_by_hand",),
    ),
    Mutant(
        "pg_brake_ignores_the_gate",
        "a held-off step keeps the control: the brake keeps damping the policy gradient while the gate holds the floor",
        (
            (
                "steadyrl/guards/entropy_floor.py",
                "            self.active, self.control, self.integral = False, 0.0, 0.0",
                "            self.active, self.integral = False, 0.0",
            ),
        ),
        ("tests/unit/test_quatro.py::test_policy_gradient_brake_by_hand",),
    ),
    Mutant(
        "entropy_gate_not_fed",
        "the trainer never hands the training rewards to the entropy floor's learning gate",
        (
            (
                "steadyrl/trainers/rollout.py",
                "self.record_reward(self.gate_rewards(rewards_per_func, weights))",
                "None",
            ),
        ),
        (f"{IT}/test_quatro.py::test_the_trainer_feeds_the_floors_learning_gate_each_steps_training_reward",),
    ),
    Mutant(
        "entropy_gate_reward_ignored",
        "the learning gate reads the weighted training reward although gate_reward names another reward",
        (
            (
                "steadyrl/trainers/rollout.py",
                "        if self.gate_column is not None:\n            return rewards_per_func[:, self.gate_column]\n",
                "",
            ),
        ),
        (
            f"{IT}/test_quatro.py::test_the_gate_reads_the_named_reward_not_the_trained_one",
            "tests/unit/test_runtimes.py::test_quatro_gate_reads_the_named_reward_column",
        ),
    ),
    Mutant(
        "entropy_floor_does_not_follow",
        "follow_learning never lowers the floor while the gate's reward rises",
        (
            (
                "steadyrl/guards/entropy_floor.py",
                "            self.floor = c.floor_ratio * mean  # entropy spent on a rising reward is not given back",
                "            pass",
            ),
        ),
        ("tests/unit/test_quatro.py::test_follow_learning_lowers_the_floor_only_while_the_reward_rises",),
    ),
    Mutant(
        "repetition_skip_bound_loose",
        "the repetition filter skips its pass on a bound that disagrees with the share's own rounding",
        (
            (
                "steadyrl/guards/rollout_filters.py",
                "    return grams > 0 and 1.0 - 1.0 / grams > share",
                "    return grams > 0 and (grams - 1) / grams > share",
            ),
        ),
        (
            "tests/unit/test_rollout_filters_vectorised.py::test_repetition_pass_is_skipped_only_when_no_row_can_be_dropped",
        ),
    ),
    Mutant(
        "ppo_dropped_rows_whitened",
        "PPO whitens and trains unscorable and filtered rows as reward 0 (advantage about -0.7 instead of 0)",
        (
            (
                "steadyrl/trainers/ppo.py",
                "advantages = whiten(advantages, mask, stats=self._global_mean_var(advantages, mask))",
                "advantages = whiten(advantages, token_mask, stats=self._global_mean_var(advantages, token_mask))",
            ),
            (
                "steadyrl/trainers/ppo.py",
                "        advantages = advantages * mask  # rows",
                "        advantages = advantages  # rows",
            ),
        ),
        (f"{IT}/test_ppo.py::test_unscorable_and_filtered_rows_train_nothing",),
    ),
    Mutant(
        "ppo_value_weight_ignored",
        "PPO's value loss weights unscorable and filtered rows like trained ones",
        (("steadyrl/trainers/ppo.py", 'mask = mask * inputs["value_weight"][:, None]', "mask = mask"),),
        (f"{IT}/test_ppo.py::test_unscorable_and_filtered_rows_train_nothing",),
    ),
    Mutant(
        "resize_keeps_rank_state",
        "a resume on another number of processes loads each rank's rollout buffer (one rank skips generation: hang)",
        (
            (
                "steadyrl/trainers/checkpoints.py",
                "    if saved is not None and saved != num_processes:",
                "    if False:",
            ),
        ),
        (
            f"{IT}/test_launch.py::"
            "test_resume_on_another_number_of_processes_drops_per_rank_state_and_rolls_back_to_a_best_kept_by_one",
        ),
    ),
    Mutant(
        "beta0_refused",
        "the shipped guards refuse TRL's default beta 0 instead of leaving the KL controller inactive",
        (("steadyrl/trainers/step_end.py", "if config.kl is not None and setup.beta == 0.0:", "if False:"),),
        ("tests/unit/test_runtimes.py::test_trls_default_beta_0_leaves_the_kl_controller_inactive",),
    ),
    Mutant(
        "user_entropy_coef_replaced",
        "the entropy floor's bonus replaces a user's trainer.entropy_coef instead of adding to it",
        (
            (
                "steadyrl/trainers/step_end.py",
                "entropy_coef=self.base_entropy_coef + self.entropy.bonus",
                "entropy_coef=self.entropy.bonus",
            ),
        ),
        ("tests/unit/test_runtimes.py::test_a_users_entropy_coef_is_kept_and_the_floors_bonus_adds_to_it",),
    ),
    Mutant(
        "ignored_keys_accepted",
        "a key the algorithm never reads (guards on SFT, eval.on_start without eval.every) is accepted silently",
        (("steadyrl/config/schema.py", "        check_ignored_keys(cfg, tree, origins)", "        pass"),),
        ("tests/unit/test_ignored_keys.py",),
    ),
    Mutant(
        "ignored_keys_default_off_parks",
        "a setting under a guard layer that is off by default (guards.gepo.monitor.*, GEPO never on) is accepted",
        (("steadyrl/config/ignored.py", 'if _written(tree, f"{dotted}.enabled") or (', "if True or ("),),
        ("tests/unit/test_ignored_keys.py::test_gepo_monitor_needs_gepo_on_unless_the_config_switches_gepo_off",),
    ),
    Mutant(
        "revision_not_on_tokenizer",
        "model.revision reaches the weights but not the tokenizer and config steadyrl loads",
        (
            (
                "steadyrl/trainers/build.py",
                "AutoTokenizer.from_pretrained(model_path, **model_files_kwargs(cfg))",
                "AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)",
            ),
        ),
        ("tests/unit/test_model_revision.py::test_grpo_tokenizer_config_and_weights_load_the_same_revision",),
    ),
    Mutant(
        "revision_not_on_reward_tokenizer",
        "the reward stage loads the tokenizer of the default revision under weights of model.revision",
        (
            (
                "steadyrl/trainers/reward_model.py",
                "_load_tokenizer(model_path, **hub_kwargs(args.model_init_kwargs or {}, args.trust_remote_code))",
                "_load_tokenizer(model_path)",
            ),
        ),
        ("tests/unit/test_model_revision.py::test_reward_stage_tokenizer_loads_the_weights_revision",),
    ),
    Mutant(
        "revision_not_on_critic_config",
        "the PPO critic reads the config of the default revision of the policy it starts from",
        (
            (
                "steadyrl/ppo/value.py",
                "config = AutoConfig.from_pretrained(path, **hub)",
                "config = AutoConfig.from_pretrained(path)",
            ),
        ),
        ("tests/unit/test_model_revision.py::test_ppo_critic_from_the_policy_loads_its_revision",),
    ),
    Mutant(
        "reward_timeout_not_enforced",
        "a reward call on the main thread runs past its timeout: the watchdog never interrupts it",
        (
            (
                "steadyrl/rewards/guarded.py",
                "signal.pthread_kill(threading.main_thread().ident, DEADLINE_SIGNAL)",
                "pass",
            ),
        ),
        (
            "tests/unit/test_reward_timeout.py::test_a_reward_that_never_answers_is_stopped_within_its_timeout",
            "tests/unit/test_reward_timeout.py::test_a_stopped_call_leaves_nothing_running",
        ),
    ),
    Mutant(
        "reward_timeout_off_main_not_enforced",
        "a reward call off the main thread runs past its timeout: the watchdog never raises in it",
        (("steadyrl/rewards/guarded.py", "_async_raise(self.caller.ident, self.token)", "pass"),),
        ("tests/unit/test_reward_timeout.py::test_a_timeout_off_the_main_thread_stops_the_call_too",),
    ),
    Mutant(
        "config_ranges_unchecked",
        "no declared range of a config field is checked: guards.quatro.kl.up=0.5 or a mode 'watch' load silently",
        (
            (
                "steadyrl/ranges.py",
                "    if problems:\n        raise RangeError(type(obj).__name__, problems)",
                "    if False:\n        raise RangeError(type(obj).__name__, problems)",
            ),
        ),
        (
            "tests/unit/test_ranges.py::test_every_declared_range_is_enforced_by_its_class",
            "tests/unit/test_ranges.py::test_a_yaml_value_out_of_range_names_the_dotted_key_and_the_file",
        ),
    ),
    Mutant(
        "checkpoint_staging_left_behind",
        "a checkpoint save that failed (a full disk) leaves its staged folder, and the disk space, behind",
        (("steadyrl/trainers/checkpoints.py", "shutil.rmtree(staged, ignore_errors=True)", "pass"),),
        ("tests/unit/test_disk_full.py::test_a_full_disk_at_each_checkpoint_write_site",),
    ),
    Mutant(
        "checkpoint_write_error_uncaught",
        "a full disk while a checkpoint is written ends the run with a raw traceback and a staged folder",
        (
            (
                "steadyrl/trainers/checkpoints.py",
                "    except SAVE_ERRORS as exc:\n        error = exc\n    # the barrier",
                "    except ZeroDivisionError as exc:\n        error = exc\n    # the barrier",
            ),
        ),
        ("tests/unit/test_disk_full.py::test_a_full_disk_at_each_checkpoint_write_site",),
    ),
    Mutant(
        "checkpoint_other_rank_failure_ignored",
        "the main process publishes a checkpoint although another rank failed to write its part",
        (("steadyrl/trainers/checkpoints.py", "    return list(gather_object([text]))", "    return [text]"),),
        ("tests/unit/test_disk_full.py::test_another_ranks_failure_stops_this_one_and_nothing_is_published",),
    ),
    Mutant(
        "checkpoint_crash_leftovers_kept",
        "a staged folder left by a crashed save of another step is never removed",
        (
            (
                "steadyrl/trainers/checkpoints.py",
                "in _checkpoint_folders(staging_root)",
                "in []",
            ),
        ),
        ("tests/unit/test_disk_full.py::test_a_staged_folder_left_by_a_crash_is_removed_at_the_next_save",),
    ),
    Mutant(
        "metrics_row_error_stops_the_run",
        "a metrics row that cannot be written (a full disk) raises out of the logging callback",
        (
            (
                "steadyrl/callbacks/metrics_log.py",
                "        except OSError as exc:\n            self.lost_rows += 1",
                "        except ZeroDivisionError as exc:\n            self.lost_rows += 1",
            ),
        ),
        ("tests/unit/test_disk_full.py::test_a_metrics_row_on_a_full_disk_is_counted_and_warned_about",),
    ),
    Mutant(
        "mismatch_gate_never_skips",
        "the ESS gate proceeds whatever the rollouts' effective sample size",
        (("steadyrl/guards/mismatch.py", "if self.ess is None or not self.ess < self.ess_min:", "if True:"),),
        ("tests/unit/test_mismatch.py::test_gate_skips_below_ess_min_and_stops_when_it_never_recovers",),
    ),
    Mutant(
        "resume_keeps_a_buffer_of_another_layout",
        "a resume with another steps_per_generation restores the saved rollout buffer anyway: TRL indexes past it",
        (("steadyrl/trainers/trl_state.py", "        if found != expected:", "        if False:"),),
        ("tests/integration/test_resume.py::test_resume_with_another_batch_layout_drops_the_saved_rollouts",),
    ),
    Mutant(
        "mismatch_skips_fed_back",
        "error feedback keeps the gradient of a step the mismatch gate skipped and feeds the off-policy batch back",
        (
            (
                "steadyrl/trainers/step_gate.py",
                "if self.feedback is not None and feeds_back(self.guards, decisions):",
                "if self.feedback is not None:",
            ),
        ),
        ("tests/unit/test_step_gate.py::test_a_step_the_mismatch_gate_skips_is_not_fed_back_a_spike_skip_is",),
    ),
    Mutant(
        "error_feedback_on_by_default",
        "error feedback on by default: a spike-skipped step's direction is fed back at the current gradients' size",
        (
            (
                "steadyrl/config/guard_sections.py",
                "    enabled: bool = False\n    weights: list[float] = field(",
                "    enabled: bool = True\n    weights: list[float] = field(",
            ),
        ),
        ("tests/unit/test_config.py::test_opefo_section_validates_its_parts",),
    ),
    Mutant(
        "mismatch_ess_unshifted",
        "the ESS takes exp of the summed log-ratios as they are: one long mismatched sequence overflows it to NaN",
        (
            (
                "steadyrl/guards/mismatch.py",
                "shifted = (ess_sums - heads[:, 1].max().item()).exp()",
                "shifted = ess_sums.exp()",
            ),
        ),
        ("tests/unit/test_mismatch.py::test_ess_survives_huge_log_ratios_and_reaches_one_over_n",),
    ),
    Mutant(
        "mismatch_sequence_modes_judged_per_token",
        "mismatch/corrected_share counts tokens under TRL's sequence_* modes, which mask or truncate whole sequences",
        (
            (
                "steadyrl/guards/mismatch.py",
                'judged = sums.exp() if mode.startswith("sequence") else rho',
                "judged = rho",
            ),
        ),
        ("tests/unit/test_mismatch.py::test_sequence_modes_judge_whole_sequences_and_clip_min_counts",),
    ),
    Mutant(
        "doctor_blind_to_a_falling_ess",
        "the doctor's rollout-ESS rule never fires",
        (
            (
                "steadyrl/evidence/doctor.py",
                "    steps, values = history.finite(M.MISMATCH_ESS)\n    if len(values) < config.min_points:",
                "    steps, values = history.finite(M.MISMATCH_ESS)\n    if True:",
            ),
        ),
        ("tests/unit/test_doctor.py::test_a_falling_rollout_ess_is_named_with_the_keys_to_change",),
    ),
    Mutant(
        "monitor_blind_to_a_falling_ess",
        "the monitor never warns when the vLLM rollouts' effective sample size falls",
        (("steadyrl/callbacks/monitor.py", "else rollout_mismatch(history)[:1]:", "else []:"),),
        ("tests/unit/test_monitor.py::test_monitor_warns_once_when_the_vllm_rollouts_ess_falls",),
    ),
    Mutant(
        "vllm_server_check_trusts_any_answer",
        "the server check takes any HTTP answer (a 500, a loading server's 503) for a ready server",
        (("steadyrl/trainers/vllm_support.py", "if answer.status_code == 200:", "if answer.status_code:"),),
        ("tests/unit/test_vllm_server.py::test_a_server_that_keeps_failing_names_its_answer",),
    ),
    Mutant(
        "parrot_judged_over_any_ngrams",
        "the parrot filter judges a short answer's few n-grams: a right answer restating the prompt's subject is"
        " dropped",
        (
            (
                "steadyrl/guards/rollout_filters.py",
                "judged = completions.lengths - (PARROT_N - 1) >= PARROT_MIN_NGRAMS",
                "judged = completions.lengths >= 0",
            ),
        ),
        ("tests/unit/test_quatro.py::test_a_parrot_is_judged_only_over_enough_ngrams",),
    ),
    Mutant(
        "report_write_failure_raised",
        "a report (eval_results.json, interventions.json) that cannot be written raises after training: the result"
        " is lost",
        (
            (
                "steadyrl/storage.py",
                "    except OSError as exc:\n        tmp.unlink",
                "    except ValueError as exc:\n        tmp.unlink",
            ),
        ),
        (
            "tests/unit/test_storage.py::"
            "test_a_report_that_cannot_be_written_is_a_warning_with_its_content_and_the_old_file_stays_whole",
        ),
    ),
    Mutant(
        "snapshot_weights_on_every_rank",
        "every rank's OPEFO snapshot holds the trainable weights (8 copies at 7B on 8 ranks)",
        (
            (
                "steadyrl/trainers/recovery.py",
                '        if self._first_rank_holds is not False:\n            payload["params"]',
                '        if True:\n            payload["params"]',
            ),
        ),
        (f"{IT}/test_launch.py::test_nan_in_one_ranks_optimizer_state_rolls_back_every_rank[zero2]",),
    ),
    Mutant(
        "rollback_weights_not_broadcast",
        "an OPEFO rollback restores the weights on the first rank only (the others hold none in their snapshot)",
        (("steadyrl/trainers/recovery.py", "dist.broadcast(p.data, src=0)", "pass"),),
        (f"{IT}/test_launch.py::test_nan_in_one_ranks_optimizer_state_rolls_back_every_rank[ddp]",),
    ),
)


def scratch_copy(dest: Path) -> None:
    """The working tree as it is (tracked files and untracked ones git does not ignore) under ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if not src.is_file():  # deleted in the working tree
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)


def apply(root: Path, mutant: Mutant) -> dict[Path, str]:
    """Patch the scratch copy; returns the original texts to restore. Raises when a patch does not apply once."""
    originals: dict[Path, str] = {}
    for rel, old, new in mutant.patches:
        path = root / rel
        text = path.read_text()
        originals.setdefault(path, text)
        if text.count(old) != 1:
            raise ValueError(f"mutant {mutant.name}: {rel} holds the patched text {text.count(old)} times, not once")
        path.write_text(text.replace(old, new, 1))
    return originals


def run_tests(root: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - start, "timeout"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = lines[-1] if lines else ""
    first_error = next((line[1:].strip() for line in lines if line.startswith("E ")), None)
    if first_error:  # what caught the mutant: the first assertion or error line of the failing test
        summary += f" | {first_error[:200]}"
    return proc.returncode, time.monotonic() - start, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of all tests")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    names = {m.name for m in MUTANTS}
    unknown = set(args.only or []) - names
    if unknown:
        parser.error(f"unknown mutant(s) {sorted(unknown)}; valid: {sorted(names)}")
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="steadyrl-mutants-") as tmp:
        root = Path(tmp)
        scratch_copy(root)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
            rc, seconds, tail = run_tests(root, tests, args.timeout * 2)
            print(f"baseline (no mutant): {len(tests)} test target(s), rc={rc}, {seconds:.0f} s: {tail}", flush=True)
            if rc != 0:
                print("the baseline must pass before mutants mean anything", file=sys.stderr)
                return 1
        for mutant in mutants:
            try:
                originals = apply(root, mutant)
            except ValueError as exc:
                print(exc, file=sys.stderr)
                rows.append({"mutant": mutant.name, "what": mutant.what, "tests": list(mutant.tests),
                             "status": "stale", "seconds": 0.0, "summary": str(exc)})  # fmt: skip
                ok = False
                continue
            try:
                rc, seconds, tail = run_tests(root, mutant.tests, args.timeout)
            finally:
                for path, text in originals.items():
                    path.write_text(text)
            status = {0: "survived", 1: "killed"}.get(rc, "error")
            ok &= status == "killed"
            rows.append({"mutant": mutant.name, "what": mutant.what, "tests": list(mutant.tests), "status": status,
                         "seconds": round(seconds, 1), "summary": tail})  # fmt: skip
            print(f"{mutant.name}: {status} ({seconds:.0f} s) {tail}", flush=True)
    width = max(len(r["mutant"]) for r in rows) if rows else 6
    print(f"\n{'mutant':<{width}}  killed  seconds  tests")
    for r in rows:
        killed = {"killed": "yes", "survived": "NO", "error": "error", "stale": "stale"}[r["status"]]
        tests = ", ".join(t.split("/")[-1] for t in r["tests"])
        print(f"{r['mutant']:<{width}}  {killed:<6}  {r['seconds']:>7.1f}  {tests}")
    if args.out is not None and not args.only:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": "python scripts/mutation_check.py", "commit": commit, "dirty_tree": dirty, "mutants": rows}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
