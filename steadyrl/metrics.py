"""Every metric name and event kind steadyrl logs or reads, in one place (``tests/unit/test_metrics.py`` checks that
the readers use only these), so a renamed metric breaks an import, not silently the doctor.

Names are namespaced by layer; TRL's own metrics keep TRL's names. Names with a variable part (a reason, a param
group, a reward function) are made by the small functions below and matched by their prefix. Observe mode's names
come from one rule, ``would``: what a layer would have done, under its act-mode name with ``would_`` after the layer.
"""

from __future__ import annotations


def would(name: str) -> str:
    """Observe mode's name for ``name``: ``gepo/skipped_steps`` -> ``gepo/would_skipped_steps``."""
    layer, _, rest = name.partition("/")
    return f"{layer}/would_{rest}"


# ----------------------------------------------------------------------------------- TRL / transformers
LOSS = "loss"
GRAD_NORM = "grad_norm"
REWARD = "reward"  # mean weighted reward of the generation batch
REWARD_STD = "reward_std"
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"  # TRL: share of groups whose rewards are all equal
REWARDS_PREFIX = "rewards/"  # rewards/<function>/mean, rewards/<function>/std
ENTROPY = "entropy"
KL = "kl"  # logged only when beta != 0
COMPLETIONS_MEAN_LENGTH = "completions/mean_length"
COMPLETIONS_MIN_LENGTH = "completions/min_length"
COMPLETIONS_MAX_LENGTH = "completions/max_length"
COMPLETIONS_CLIPPED_RATIO = "completions/clipped_ratio"
SAMPLING_LOGP_GAP = "sampling/sampling_logp_difference/mean"  # vLLM vs policy log-prob of the sampled tokens
SAMPLING_LOGP_GAP_MAX = "sampling/sampling_logp_difference/max"
# vLLM rollouts, the rollout-trainer mismatch of each generation batch (steadyrl.guards.mismatch defines them)
MISMATCH_ESS = "mismatch/ess"
MISMATCH_CORRECTED_SHARE = "mismatch/corrected_share"
MISMATCH_KL = "mismatch/kl"
TRAIN_RUNTIME = "train_runtime"  # only in the Trainer's final summary row


def reward_errors(name: str) -> str:
    """Failed attempts of reward function ``name`` per call (``on_error: retry | skip``; recovered retries count)."""
    return f"{REWARDS_PREFIX}{name}/errors"


def reward_skipped(name: str) -> str:
    """1 for a call of reward function ``name`` whose completions were scored unscorable (``on_error: skip``)."""
    return f"{REWARDS_PREFIX}{name}/skipped"


# ----------------------------------------------------------------------------------- GEPO
GEPO_NONFINITE_REWARDS = "gepo/nonfinite_rewards"
GEPO_NONFINITE_LOGPROBS = "gepo/nonfinite_logprobs"
GEPO_NONFINITE_RATIOS = "gepo/nonfinite_ratios"
GEPO_NONFINITE_LOSS = "gepo/nonfinite_loss"
GEPO_ADV_STD = "gepo/adv_std"
GEPO_ADV_MAX_ABS = "gepo/adv_max_abs"
GEPO_ROBUST_GROUPS = "gepo/robust_groups"  # per step: groups with a far outlier, on median/MAD instead of mean/std
GEPO_SKIPPED_STEPS = "gepo/skipped_steps"  # cumulative
GEPO_ZERO_GRAD_STEPS = "gepo/zero_grad_steps"  # cumulative: no-signal steps kept out of the spike baseline
GEPO_SPIKE_REBASES = "gepo/spike_rebases"  # cumulative: spike streaks taken as a level shift
GEPO_SPIKE_MEDIAN = "gepo/spike_median"  # the spike guard's baseline: median grad norm of its window
GEPO_SPIKE_Z = "gepo/spike_z"  # the last step's robust z-score of log grad norm against that window
GEPO_SKIPPED_PREFIX = "gepo/skipped_"  # gepo/skipped_<reason>, cumulative per reason (spike, nonfinite)
# guards.gepo.spike.granularity: micro_batch (steadyrl/trainers/micro_batch_gate.py)
GEPO_DROPPED_MICRO_BATCHES = "gepo/dropped_micro_batches"  # cumulative, every rank: micro-batches left out of a step
GEPO_MICRO_SPIKE_MEDIAN = "gepo/micro_spike_median"  # the micro-batch guard's own-gradient-norm baseline (rank 0's)


def gepo_skipped(reason: str) -> str:
    """Cumulative count of optimizer steps skipped for ``reason`` (``spike``, ``nonfinite``)."""
    return f"{GEPO_SKIPPED_PREFIX}{reason}"


# observe mode (guards.gepo.mode: observe): what GEPO would have done; nothing of it is applied
GEPO_WOULD_SKIP = would(GEPO_SKIPPED_STEPS)  # cumulative optimizer steps the step guards would have skipped
GEPO_WOULD_SKIP_PREFIX = would(GEPO_SKIPPED_PREFIX)  # gepo/would_skipped_<reason>, cumulative per reason
GEPO_WOULD_DROP_MICRO_BATCHES = would(GEPO_DROPPED_MICRO_BATCHES)  # cumulative, every rank
GEPO_WOULD_STOP = would("gepo/stop")  # cumulative: would-skips past max_consecutive_skips (act mode stops the run)
GEPO_WOULD_CLAMP_LOGPROBS = would("gepo/clamp_logprobs")  # per-token log-probs below logprob_min, per step
GEPO_WOULD_CLIP_ROWS = would("gepo/clip_rows")  # rows whose median/MAD z-score the tanh clip shrinks by > 10 %
GEPO_WOULD_ROBUST_GROUPS = would(GEPO_ROBUST_GROUPS)
GEPO_WOULD_ADV_DIFF_MEAN = would("gepo/adv_diff_mean")  # mean |GEPO advantage - trained advantage| over rows


def gepo_would_skip(reason: str) -> str:
    """Cumulative count of optimizer steps an observing step guard would have skipped for ``reason``."""
    return would(gepo_skipped(reason))


# ----------------------------------------------------------------------------------- GRADE
GRADE_RAW_MEAN = "grade/raw_mean"
GRADE_RAW_STD = "grade/raw_std"
GRADE_SCALED_MEAN = "grade/scaled_mean"
GRADE_SCALED_STD = "grade/scaled_std"
GRADE_CLIP_FRAC_LOW = "grade/clip_frac_low"
GRADE_CLIP_FRAC_HIGH = "grade/clip_frac_high"
GRADE_WINDOW = "grade/window"
GRADE_KL_FACTOR = "grade/kl_factor"
GRADE_BETA = "grade/beta"
GRADE_KL_FACTOR_WOULD = would(GRADE_KL_FACTOR)  # observe mode: the KL compensation factor it would set

# ----------------------------------------------------------------------------------- QUATRO
QUATRO_KL_COEF = "quatro/kl_coef"
QUATRO_KL_FACTOR = "quatro/kl_factor"
QUATRO_KL_MEAN = "quatro/kl_mean"
QUATRO_KL_TARGET = "quatro/kl_target"
QUATRO_KL_NAN = "quatro/kl_nan"
QUATRO_KL_AT_MAX = "quatro/kl_at_max"  # cumulative: updates that wanted beta above its upper bound
QUATRO_KL_AT_MIN = "quatro/kl_at_min"  # cumulative: updates that wanted beta below its lower bound
QUATRO_KL_BOUND_RUN = "quatro/kl_bound_run"  # current streak of such updates
QUATRO_BETA = "quatro/beta"  # the effective coefficient, every factor included
QUATRO_ENTROPY = "quatro/entropy"
QUATRO_ENTROPY_FLOOR = "quatro/entropy_floor"
QUATRO_ENTROPY_BONUS = "quatro/entropy_bonus"
QUATRO_ENTROPY_CONTROL = "quatro/entropy_control"  # the floor's control u in [0, 1] (brake and bonus)
QUATRO_PG_SCALE = "quatro/pg_scale"  # factor on the policy-gradient advantages from the floor's brake (1: none)
QUATRO_MOMENT_SCALE = "quatro/moment_scale"  # the brake factor Adam's moments follow (entropy.brake_moments)
QUATRO_FLOOR_ACTIVE = "quatro/floor_active"
QUATRO_FLOOR_HELD_OFF = "quatro/floor_held_off"  # 1: entropy under the floor, but the reward still rises
QUATRO_FILTERED_PREFIX = "quatro/filtered/"  # quatro/filtered/<reason>, rows dropped per filter
QUATRO_FILTERED_SHARE = "quatro/filtered_share"
QUATRO_ZERO_VARIANCE_GROUPS = "quatro/zero_variance_groups"
QUATRO_ROWS = "quatro/rows"  # rows of the generation batch the filters saw
QUATRO_REPLAY_FRAC = "quatro/replay_frac"
QUATRO_REPLAY_AGE_MEAN = "quatro/replay_age_mean"
QUATRO_REPLAY_RATIO_MEAN = "quatro/replay_ratio_mean"
QUATRO_GOLD_BEST = "quatro/gold_best"  # the gold watch's best eval metric so far
QUATRO_GOLD_STREAK = "quatro/gold_streak"  # evals in a row significantly below the gold watch's reference
QUATRO_GOLD_ROLLBACKS = "quatro/gold_rollbacks"  # cumulative: rollbacks to the best policy (a stop included)
QUATRO_GOLD_LR_FACTOR = "quatro/gold_lr_factor"  # the gold watch's factor of the learning rate, while below 1
# observe mode (guards.quatro.mode: observe): what QUATRO would set; TRL's own values stay
QUATRO_KL_COEF_WOULD = would(QUATRO_KL_COEF)  # the controller's beta (TRL's beta is unchanged)
QUATRO_ENTROPY_BONUS_WOULD = would(QUATRO_ENTROPY_BONUS)  # the entropy_coef it would set
QUATRO_PG_SCALE_WOULD = would(QUATRO_PG_SCALE)  # the factor the floor's brake would put on the advantages
QUATRO_MOMENT_SCALE_WOULD = would(QUATRO_MOMENT_SCALE)  # the factor brake_moments would have the moments follow
QUATRO_CLIP_SCALE_WOULD = would("quatro/clip_scale")  # the epsilon factor it would set
QUATRO_FLOOR_ACTIVE_WOULD = would(QUATRO_FLOOR_ACTIVE)
QUATRO_WOULD_FILTER_PREFIX = would(QUATRO_FILTERED_PREFIX)  # quatro/would_filtered/<reason>: rows it would drop
QUATRO_WOULD_FILTER_SHARE = would(QUATRO_FILTERED_SHARE)
QUATRO_WOULD_GOLD_ROLLBACKS = would(QUATRO_GOLD_ROLLBACKS)  # cumulative: divergences it would have acted on


def quatro_filtered(reason: str) -> str:
    """Rows of the generation batch the ``reason`` filter dropped (``zscore``, ``length``, ``repetition``, ...)."""
    return f"{QUATRO_FILTERED_PREFIX}{reason}"


def quatro_would_filter(reason: str) -> str:
    """Rows of the generation batch the ``reason`` filter would drop (observe mode: every row trains)."""
    return would(quatro_filtered(reason))


# ----------------------------------------------------------------------------------- OPEFO
OPEFO_TINY_FRAC_PREFIX = "opefo/tiny_frac/"
OPEFO_FLOOR_VALUE_PREFIX = "opefo/floor_value/"
OPEFO_FLOOR_RAISED_FRAC_PREFIX = "opefo/floor_raised_frac/"
OPEFO_FLOOR_TRIGGERED = "opefo/floor_triggered"
OPEFO_EF_PENDING = "opefo/ef_pending"
OPEFO_EF_WEIGHT = "opefo/ef_weight"
OPEFO_EF_INJECTED_NORM = "opefo/ef_injected_norm"
OPEFO_ROLLBACKS = "opefo/rollbacks"  # cumulative
OPEFO_SNAPSHOT_FAILURES = "opefo/snapshot_failures"  # cumulative: disk snapshots a rank could not write (kept the last)
OPEFO_REPAIRS = "opefo/repairs"  # cumulative: checks whose non-finite moment entries were reset in place
OPEFO_REPAIRED_ENTRIES = "opefo/repaired_entries"  # cumulative, over all ranks
OPEFO_RECOVERY_ACTIVE = "opefo/recovery_active"
OPEFO_LR_FACTOR = "opefo/lr_factor"
# observe mode (guards.opefo.mode: observe): what OPEFO would have done, cumulative; nothing of it is applied
OPEFO_WOULD_ROLLBACK = would(OPEFO_ROLLBACKS)  # checks that found non-finite weights or moments
OPEFO_WOULD_REPAIR = would(OPEFO_REPAIRS)  # of those, the ones act mode would repair in place instead
OPEFO_WOULD_FLOOR_ENTRIES = would("opefo/floor_entries")  # exp_avg_sq entries the floor would raise
OPEFO_WOULD_FEED_BACK = would("opefo/feed_back")  # skipped steps whose gradient error feedback would keep


def opefo_tiny_frac(group: int) -> str:
    """Share of param group ``group``'s exp_avg_sq entries below the floor's threshold."""
    return f"{OPEFO_TINY_FRAC_PREFIX}{group}"


def opefo_floor_value(group: int) -> str:
    return f"{OPEFO_FLOOR_VALUE_PREFIX}{group}"


def opefo_floor_raised_frac(group: int) -> str:
    return f"{OPEFO_FLOOR_RAISED_FRAC_PREFIX}{group}"


# ----------------------------------------------------------------------------------- PPO
PPO_RETURNS_MEAN = "ppo/returns_mean"
PPO_VALUES_MEAN = "ppo/values_mean"
PPO_EXPLAINED_VARIANCE = "ppo/explained_variance"
PPO_BETA = "ppo/beta"
PPO_KL = "ppo/kl"
PPO_VALUE_LOSS = "ppo/value_loss"
PPO_CLIPFRAC_VALUE = "ppo/clipfrac_value"
# L2 norms of the policy's and the critic's gradients as the backward passes left them (before any guard or clip)
PPO_POLICY_GRAD_NORM = "ppo/policy_grad_norm"
PPO_CRITIC_GRAD_NORM = "ppo/critic_grad_norm"

# ----------------------------------------------------------------------------------- steadyrl, periodic eval
GUARD_SECONDS = "steadyrl/guard_seconds"
# the interventions ledger (steadyrl/evidence/interventions.py): 1 on a step where the kind acted, else 0
LEDGER_PREFIX = "steadyrl/interventions/"
LEDGER_WOULD_PREFIX = would(LEDGER_PREFIX)  # observe mode: what it would have done


def ledger(kind: str) -> str:
    """1 on an optimizer step where intervention ``kind`` (``skipped_step``, ``beta_moved``, ...) acted, else 0."""
    return f"{LEDGER_PREFIX}{kind}"


def ledger_would(kind: str) -> str:
    """Observe mode: 1 on a step where ``kind`` would have acted."""
    return f"{LEDGER_WOULD_PREFIX}{kind}"


# parts of the guard seconds (RuntimeContext.timer(part), OUTPUT_DIR/guard_cost.json "seconds_by_part"): the layer,
# then the mechanism whose code ran; "grade", "pipeline", "checks" and "ppo" have no mechanism part
GUARD_PART_GEPO_ADVANTAGES = "gepo/advantages"
GUARD_PART_GEPO_SPIKE = "gepo/spike"
GUARD_PART_GEPO_MISMATCH = "gepo/mismatch"
GUARD_PART_OPEFO_STATE = "opefo/state"
GUARD_PART_OPEFO_FEEDBACK = "opefo/feedback"
GUARD_PART_QUATRO_REPLAY = "quatro/replay"
GUARD_PART_QUATRO_MEASURE = "quatro/measure"
GUARD_PART_QUATRO_FILTERS = "quatro/filters"
GUARD_PART_QUATRO_CONTROLLERS = "quatro/controllers"
EVAL_PREFIX = "eval/"
EVAL_REWARD = "eval/reward"
EVAL_ACCURACY = "eval/accuracy"
EVAL_ACCURACY_SE = "eval/accuracy_se"  # its standard error: the per-sample scores' std / sqrt(n)
EVAL_MEAN_LENGTH = "eval/mean_length"
EVAL_NUM_SAMPLES = "eval/num_samples"
EVAL_REWARD_PREFIX = "eval/reward/"  # eval/reward/<function>


def eval_reward(name: str) -> str:
    """Mean greedy-decoding score of reward function ``name`` on the eval split."""
    return f"{EVAL_REWARD_PREFIX}{name}"


# ----------------------------------------------------------------------------------- events (MetricsLog.event)
EVENT_SKIP = "skip"
EVENT_MICRO_BATCH_DROP = "micro_batch_drop"
EVENT_ROLLBACK = "rollback"
EVENT_STATE_REPAIR = "state_repair"
EVENT_GOLD_ROLLBACK = "gold_rollback"  # the gold watch went back to its best policy (fields: cause, verdict)
EVENT_ENTROPY_FLOOR_WARNING = "entropy_floor_warning"
EVENT_FILTER_WARNING = "filter_warning"

_declared = {key: value for key, value in dict(globals()).items() if key.isupper() and isinstance(value, str)}
NAMES = frozenset(v for k, v in _declared.items() if not k.endswith("_PREFIX") and not k.startswith("EVENT_"))
PREFIXES = tuple(v for k, v in _declared.items() if k.endswith("_PREFIX"))
EVENTS = frozenset(v for k, v in _declared.items() if k.startswith("EVENT_"))


def is_declared(name: str) -> bool:
    """A metric name declared above: a fixed name, or one made with a declared prefix."""
    return name in NAMES or any(name.startswith(prefix) and name != prefix for prefix in PREFIXES)
