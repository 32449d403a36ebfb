"""Reward-hacking and regression watch (QUATRO, ``guards.quatro.gold``): the periodic eval's gold metric against the
training reward (docs/DESIGN.md, "QUATRO: gold watch").

A run games its reward when the training reward holds while the metric it should serve falls; it regresses by itself
(a learning rate too high) when both fall. At each periodic eval (``eval.every``) the watch compares the gold metric
(``eval.metric``, logged as ``eval/accuracy`` with its standard error ``eval/accuracy_se``) with a reference, and the
training reward (TRL's ``reward``: the mean of the rows logged since the previous eval, or the last rows logged when
none was, with the standard error of that mean) with its level at the reference.

Noise model: each eval is the mean of n per-sample scores, ``gold = true level + e`` with ``e ~ N(0, se^2)``
independent between evals (a sampled eval, or a fresh subset; a greedy eval on fixed rows moves less, so its ``se``
over-states its noise and the rule is conservative there). Unknown ``se``: the binomial bound ``sqrt(g(1-g)/n)`` (the
largest variance any metric in [0, 1] with mean g can have) where n is known, else 0 (``drop`` alone)::

    reference = the eval with the highest lower bound gold - z*se     # not the luckiest single eval
    falling   = reference.gold - gold > max(drop, relative_drop * |reference.gold|, z * sqrt(reference.se^2 + se^2))
    held      = reference.reward - reward <= max(reward_slack, z * sqrt(reference.reward_se^2 + reward_se^2))
    confirmed = ``confirm`` evals in a row falling: "diverged" when the reward held (gaming), "regressed" when it fell
                with the gold metric (acted on only with ``regression``; without it only a held reward counts)

``z`` = 4 with ``confirm`` = 2 keeps a plateaued run's false alarms under 1 % over 50 evals for any eval size
(``scripts/gold_simulate.py``; docs/results/gold_false_alarms.json). An eval before training (``eval.on_start``) has
no reward level: when it is the reference, the reward's first level after it is the bar. With ``mode: min`` (a metric
where lower is better: an error rate, a judge's harm score) the rule reads ``-gold``: the reference is the lowest upper
bound and a fall is a rise.

``GoldDetector`` is that rule alone, a pure state machine over ``EvalPoint``s; ``replay`` runs it over a logged
history, so the false-alarm rate of a setting can be measured on finished runs. The runtime (``GoldWatch`` in
steadyrl/callbacks/gold_watch.py) keeps the policy of every new reference and acts on a confirmed fall.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from steadyrl.metrics import EVAL_ACCURACY, EVAL_ACCURACY_SE, EVAL_NUM_SAMPLES, REWARD
from steadyrl.ranges import Checked, bounded

ACTIONS = ("rollback", "stop")
MODES = ("max", "min")  # higher is better | lower is better
VERDICTS = ("best", "ok", "falling", "diverged", "regressed", "skip")
CONFIRMED = ("diverged", "regressed")  # the verdicts the runtime acts on


@dataclass
class GoldConfig(Checked):
    enabled: bool = True  # acts only where a periodic eval runs (eval.every > 0)
    drop: float = bounded(0.05, gt=0, finite=True)  # a fall is at least this below the reference (the metric's units)
    relative_drop: float = bounded(0.0, ge=0, lt=1)  # ... and at least this fraction of the reference's |value|
    mode: str = bounded("max", choices=MODES)  # max: higher is better; min: lower is better (a fall is then a rise)
    z: float = bounded(4.0, ge=0, finite=True)  # ... and more than z standard errors of the difference (eval noise)
    confirm: int = bounded(2, ge=1)  # evals in a row, falling
    reward_slack: float = bounded(0.0, ge=0, finite=True)  # how far the training reward may fall and still "hold"
    regression: bool = True  # also act when the training reward fell with the gold metric (a run failing by itself)
    action: str = bounded("rollback", choices=ACTIONS)  # rollback and tighten, or restore the best and stop
    lr_factor: float = bounded(0.5, gt=0, le=1)  # after a rollback: the learning rate's scale, for good
    beta_factor: float = bounded(2.0, ge=1, finite=True)  # after a rollback: trainer.beta x this (when beta > 0)
    max_rollbacks: int = bounded(2, ge=0)  # one more divergence stops the run, keeping the best policy
    save_best: bool = True  # also write the best policy to OUTPUT_DIR/best-gold (model or adapter, atomically)
    # the logged eval key read as the gold metric; "" = steadyrl's periodic eval (eval/accuracy) or, from Python with
    # TRL's own eval (eval_strategy), eval_rewards/<name>/mean of the one reward function trained with weight 0
    metric: str = ""


class EvalPoint(NamedTuple):
    """One eval as the watch reads it: the gold metric and the mean training reward since the previous eval, each
    with its standard error (NaN: unknown)."""

    step: int
    gold: float
    reward: float
    gold_se: float = math.nan
    reward_se: float = math.nan
    first_reward: float = math.nan  # the interval's first logged reward: the rollouts of the policy just evaluated


def binomial_se(mean: float, n: float) -> float:
    """``sqrt(mean (1 - mean) / n)``: the largest standard error of a mean of n scores in [0, 1] (NaN outside)."""
    if not (n >= 1 and 0.0 <= mean <= 1.0):
        return math.nan
    return math.sqrt(mean * (1.0 - mean) / n)


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of the finite ``values``: (NaN, NaN) for none, se NaN for one."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    mean = sum(finite) / len(finite)
    if len(finite) < 2:
        return mean, math.nan
    var = sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)
    return mean, math.sqrt(var / len(finite))


def _se(value: float) -> float:
    return value if math.isfinite(value) and value > 0 else 0.0


@dataclass
class GoldDetector:
    """The rule of the module docstring; ``update`` once per eval, in step order."""

    drop: float = 0.05
    confirm: int = 2
    reward_slack: float = 0.0
    z: float = 4.0
    regression: bool = True
    relative_drop: float = 0.0
    mode: str = "max"
    best_gold: float | None = None  # the reference eval (highest gold - z*se)
    best_step: int | None = None
    reward_at_best: float | None = None
    best_se: float = 0.0
    reward_se_at_best: float = 0.0
    streak: int = 0  # evals in a row falling (with ``regression`` off: falling while the reward held)
    evals: int = 0

    @classmethod
    def from_config(cls, config: GoldConfig) -> GoldDetector:
        c = config
        return cls(c.drop, c.confirm, c.reward_slack, c.z, c.regression, c.relative_drop, c.mode)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"gold watch mode {self.mode!r} is not one of {MODES}")

    @property
    def sign(self) -> float:
        """+1 where higher is better (``max``), -1 where lower is (``min``): the rule reads ``sign * gold``."""
        return 1.0 if self.mode == "max" else -1.0

    @property
    def best_bound(self) -> float:
        """The reference's worse-side bound in ``sign * gold``, sign*gold - z*se (-inf before the first eval)."""
        return -math.inf if self.best_gold is None else self.sign * self.best_gold - self.z * self.best_se

    def margin(self, gold_se: float) -> float:
        """How far on the worse side of the reference an eval with standard error ``gold_se`` must be to count as
        falling: the largest of ``drop``, ``relative_drop`` x |reference| and z standard errors of the difference."""
        relative = self.relative_drop * abs(self.best_gold) if self.best_gold is not None else 0.0
        return max(self.drop, relative, self.z * math.hypot(self.best_se, _se(gold_se)))

    def held(self, reward: float, reward_se: float = math.nan) -> bool:
        """The training reward did not fall significantly below its level at the reference (NaN: unknown, not held)."""
        if not (math.isfinite(reward) and self.reward_at_best is not None and math.isfinite(self.reward_at_best)):
            return False
        allowed = max(self.reward_slack, self.z * math.hypot(self.reward_se_at_best, _se(reward_se)))
        return self.reward_at_best - reward <= allowed

    def update(
        self,
        step: int,
        gold: float,
        reward: float,
        gold_se: float = math.nan,
        reward_se: float = math.nan,
        first_reward: float = math.nan,
    ) -> str:
        """One eval: ``best`` (a new reference: its lower bound above the old one's), ``ok``, ``falling`` (counted,
        not yet confirmed), ``diverged`` / ``regressed`` (confirmed, reward held / fell) or ``skip`` (a non-finite gold
        metric: not counted)."""
        if not math.isfinite(gold):
            return "skip"
        self.evals += 1
        if self.sign * gold - self.z * _se(gold_se) > self.best_bound:
            self.best_gold, self.best_step, self.reward_at_best, self.streak = gold, step, reward, 0
            self.best_se, self.reward_se_at_best = _se(gold_se), _se(reward_se)
            return "best"
        assert self.reward_at_best is not None
        if not math.isfinite(self.reward_at_best) and math.isfinite(reward):
            # the best came before any training reward: the bar is the first reward logged after it (the rollouts of
            # that very policy), else the interval's mean (a run that collapses within one interval would set it low)
            if math.isfinite(first_reward):
                self.reward_at_best, self.reward_se_at_best = first_reward, 0.0
            else:
                self.reward_at_best, self.reward_se_at_best = reward, _se(reward_se)
        falling = self.sign * (self.best_gold - gold) > self.margin(gold_se)
        held = self.held(reward, reward_se)
        self.streak = self.streak + 1 if falling and (held or self.regression) else 0
        if not self.streak:
            return "ok"
        if self.streak < self.confirm:
            return "falling"
        return "diverged" if held else "regressed"

    def restart(self) -> None:
        """After a rollback to the best policy: the streak starts again; the best stays."""
        self.streak = 0

    def state_dict(self) -> dict[str, Any]:
        keys = ("best_gold", "best_step", "reward_at_best", "best_se", "reward_se_at_best", "streak", "evals")
        return {"version": 2, **{k: getattr(self, k) for k in keys}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        version = state.get("version")
        if version not in (1, 2):
            raise ValueError(f"gold watch state version {version!r} is not 1 or 2")
        self.best_gold, self.best_step = state["best_gold"], state["best_step"]
        self.reward_at_best, self.streak, self.evals = state["reward_at_best"], state["streak"], state["evals"]
        # version 1 (before the noise model) kept no standard errors: its reference counts as exact
        self.best_se, self.reward_se_at_best = state.get("best_se", 0.0), state.get("reward_se_at_best", 0.0)


def eval_point(row: Mapping[str, Any], rewards: Sequence[float], step: int, gold_key: str = EVAL_ACCURACY) -> EvalPoint:
    """The ``EvalPoint`` of an eval row, ``rewards`` the training rewards logged since the previous eval row."""
    reward, reward_se = mean_se(rewards)
    gold = float(row[gold_key])
    first = next((r for r in rewards if math.isfinite(r)), math.nan)
    return EvalPoint(step, gold, reward, gold_se(row, gold, gold_key), reward_se, first)


class RewardsSince:
    """The training rewards an eval is judged with: those logged since the previous eval, or, when none was (TRL
    logs every ``logging_steps``, 10 by default, and the Trainer logs a step's row after the eval of that step), the
    last ones logged before it. Without that, every other eval at ``eval.every`` 5 had no reward level."""

    def __init__(self) -> None:
        self.since: list[float] = []
        self.last: list[float] = []

    def add(self, reward: Any) -> None:
        if reward is not None and math.isfinite(float(reward)):
            self.since.append(float(reward))

    def take(self) -> list[float]:
        """The rewards for the eval being read; starts the next interval."""
        if self.since:
            self.last, self.since = self.since, []
        return self.last


def eval_points(
    rows: Iterable[Mapping[str, Any]], gold_key: str = EVAL_ACCURACY, reward_key: str = REWARD
) -> list[EvalPoint]:
    """An ``EvalPoint`` per eval row of a logged history, in order: ``reward`` is the mean of the ``reward_key`` values
    ``RewardsSince`` gives it (NaN when none was logged yet), ``reward_se`` its standard error, ``first_reward`` the
    first of them; ``gold_se`` is the row's ``<gold_key>_se``, else the binomial bound from ``eval/num_samples``, else
    NaN."""
    points, rewards = [], RewardsSince()
    for row in rows:
        rewards.add(row.get(reward_key))
        if gold_key in row and row[gold_key] is not None:
            points.append(eval_point(row, rewards.take(), int(row.get("step", 0)), gold_key))
    return points


def gold_se(row: Mapping[str, Any], gold: float, gold_key: str = EVAL_ACCURACY) -> float:
    """The standard error of an eval row's gold metric: its logged ``<gold_key>_se`` (``eval/accuracy_se``), else the
    binomial bound over ``eval/num_samples`` samples, else NaN."""
    se_key = EVAL_ACCURACY_SE if gold_key == EVAL_ACCURACY else gold_key + "_se"
    if row.get(se_key) is not None and math.isfinite(float(row[se_key])):
        return float(row[se_key])
    return binomial_se(gold, float(row.get(EVAL_NUM_SAMPLES) or 0))


def replay(
    rows: Iterable[Mapping[str, Any]], config: GoldConfig | None = None, gold_key: str = EVAL_ACCURACY
) -> list[tuple[int, str]]:
    """The detector's verdict at every eval of a logged history (no action: a replay cannot roll back)."""
    detector = GoldDetector.from_config(config or GoldConfig())
    return [(p.step, detector.update(*p)) for p in eval_points(rows, gold_key)]
