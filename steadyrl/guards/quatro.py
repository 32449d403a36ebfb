"""QUATRO loop layer (docs/DESIGN.md, the "QUATRO" sections): the pure, trainer-independent parts.

QUATRO breaks the "bad policy -> bad rollouts -> worse policy" loop. Four pieces, the original design's numbers as
defaults:

1. ``AdaptiveKL``: every ``update_every`` optimizer steps the mean per-token KL to the reference is compared with
   ``target`` (0.02): above -> beta x 1.2, below -> beta x 0.8, equal -> unchanged, clamped to
   [``beta_min``, ``beta_max``]. ``factor = beta / beta0`` is one multiplicative factor of the trainer's KL
   coefficient; GRADE's KL compensation is another, so the effective coefficient is
   ``trainer.beta x factor x grade_compensation`` (``steadyrl.trainers.trl_state.set_beta_factor``). The clamp
   bounds the controller's own beta only, so the effective value can leave [beta_min, beta_max] by GRADE's factor
   (<= 2).
2. ``EntropyFloor``: baseline = mean token entropy of the first ``baseline_steps`` (10) optimizer steps,
   floor = ``floor_ratio`` (0.8) x baseline, compared with the mean of a rolling ``window`` (5 steps). Below the
   floor the floor turns active; it releases when the window mean is above floor x ``hysteresis``. While active
   ``clip_scale()`` is ``clip_factor`` (0.5; the trainer multiplies PPO's epsilon by it), else 1. The entropy bonus
   coefficient is an integral controller: from the first activation, ``bonus += gain x (floor - mean) / floor``
   each step, kept in ``[0, coef_max]``. If the window mean still fell over ``window`` active steps, ``observe``
   returns a warning.
3. ``RolloutFilter``: drops rollouts before advantages (reward z-score, length, parrot, repetition, near-duplicate,
   zero-variance group), see ``FILTER_REASONS``; ``masked_group_advantages`` computes advantages without them.
4. ``ReplayBuffer``: keeps the rows with a learning signal of the last ``capacity`` (8) scored micro-batches, and
   replaces ``replay_ratio`` (0.3) of each fresh micro-batch with rows drawn from it, padded to a common width.

TRL's entropy term, which the trainer reuses instead of adding a second one (TRL 1.16, ``GRPOTrainer._compute_loss``):
with ``H`` the per-token Shannon entropy in nats of ``softmax(logits / temperature)`` (gradient flows through it) and
``m`` the completion mask (times the high-entropy mask when ``top_entropy_quantile < 1``),
``entropy_loss = sum(H * m) / max(sum(m), 1) / gradient_accumulation_steps`` (a per-micro-batch token mean, the same
for every ``loss_type``) and ``loss = loss - self.entropy_coef * entropy_loss``: a positive coefficient is a bonus
that raises entropy. The term is only added when ``self._entropy_bonus_enabled``, which TRL fixes at init
(``args.entropy_coef != 0 or args.use_adaptive_entropy``); with ``use_adaptive_entropy`` TRL's own controller
rewrites ``entropy_coef`` every step. ``EntropyFloor.bonus`` is a coefficient in exactly these units.

Nothing here knows about processes. The caller passes values that are identical on all ranks (KL and entropy
reduced over ranks, rewards and token ids gathered over ranks for the filters), so every rank decides the same.
The replay buffer is per rank (each rank replays its own micro-batches; seed it with ``seed + rank`` and save it per
rank).

What this simplifies or leaves out:

- KL and entropy controllers count ``observe`` calls (optimizer steps); a NaN observation is ignored and counted
  (KL: the step still counts towards ``update_every``; entropy: the step is skipped entirely). A KL window with no
  finite value leaves beta unchanged.
- Filters work on token ids (tokenizer-agnostic); n-gram sizes are therefore in tokens: with a byte-level tokenizer,
  raise ``n`` (ordinary English text already repeats many byte trigrams). N-grams are Python tuples in sets: one
  call takes about 0.4 s for 512 completions of 1024 tokens on one CPU core (0.9 s with near-duplicates on).
- The z-score filter uses the batch's unbiased std; with N scorable rewards no |z| can exceed (N - 1) / sqrt(N), so
  3.5 can only fire from N >= 15. It is skipped when the batch's finite rewards take fewer than ``min_distinct``
  (3) values: with pass/fail rewards a rare success is the signal, not an outlier (seed: |z| > 3.5 without this).
- Replay needs the sampling policy's log-probs of every row (``old_per_token_logps``); it supports text batches
  (the keys in ``REPLAY_ROW_KEYS``), not multimodal ones, and passes ``num_items_in_batch`` through unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from steadyrl.guards.entropy_floor import EntropyConfig, EntropyFloor
from steadyrl.guards.kl_controller import AdaptiveKL, KLConfig
from steadyrl.guards.replay import (
    LOGPROB_KEYS,
    REPLAY_PASS_THROUGH_KEYS,
    REPLAY_REQUIRED_KEYS,
    REPLAY_ROW_KEYS,
    ReplayBuffer,
    ReplayConfig,
    ReplayInfo,
    replay_importance_ratio_mean,
    replay_importance_ratio_sum,
)
from steadyrl.guards.rollout_filters import (
    FILTER_REASONS,
    FilterConfig,
    FilterResult,
    LengthConfig,
    NearDuplicateConfig,
    ParrotConfig,
    RepetitionConfig,
    RolloutFilter,
    ZeroVarianceConfig,
    ZScoreConfig,
    jaccard,
    masked_group_advantages,
    ngrams,
    parrot_share,
    repeat_share,
)

NAN = math.nan  # kept for old imports


@dataclass
class QuatroConfig:
    """The parts of QUATRO a trainer runs; None turns a part off (``guards.quatro`` -> ``QuatroSection.to_config``)."""

    kl: KLConfig | None = None
    entropy: EntropyConfig | None = None
    filters: FilterConfig | None = None
    replay: ReplayConfig | None = None


__all__ = [
    "FILTER_REASONS",
    "LOGPROB_KEYS",
    "REPLAY_PASS_THROUGH_KEYS",
    "REPLAY_REQUIRED_KEYS",
    "REPLAY_ROW_KEYS",
    "AdaptiveKL",
    "EntropyConfig",
    "EntropyFloor",
    "FilterConfig",
    "FilterResult",
    "KLConfig",
    "LengthConfig",
    "NearDuplicateConfig",
    "ParrotConfig",
    "QuatroConfig",
    "RepetitionConfig",
    "ReplayBuffer",
    "ReplayConfig",
    "ReplayInfo",
    "RolloutFilter",
    "ZScoreConfig",
    "ZeroVarianceConfig",
    "jaccard",
    "masked_group_advantages",
    "ngrams",
    "parrot_share",
    "repeat_share",
    "replay_importance_ratio_mean",
    "replay_importance_ratio_sum",
]
