"""Reward-hacking watch (QUATRO, ``guards.quatro.gold``): the periodic eval's gold metric against the training reward
(docs/DESIGN.md, "QUATRO: gold watch").

A run games its reward when the training reward holds or rises while the metric it should serve falls. At each
periodic eval (``eval.every``) the watch compares the gold metric (``eval.metric``, logged as ``eval/accuracy``) with
its best so far, and the training reward (TRL's ``reward``, the mean of the rows logged since the previous eval) with
its level at that best::

    falling  = gold < best_gold - drop
    rewarded = reward >= reward_at_best - reward_slack      # the reward did not fall with it: gaming, not collapse
    diverged = ``confirm`` evals in a row both falling and rewarded

An eval before training (``eval.on_start``) has no reward level: when it is the best, the reward's first level
after it is the reference.

``GoldDetector`` is that rule alone, a pure state machine over (step, gold, reward); ``replay`` runs it over a logged
history, so the false-alarm rate of a setting can be measured on finished runs. The runtime (``GoldWatch`` in
steadyrl/callbacks/gold_watch.py) keeps the policy of every new best and acts on a divergence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from steadyrl.metrics import EVAL_ACCURACY, REWARD
from steadyrl.ranges import Checked, bounded

ACTIONS = ("rollback", "stop")
VERDICTS = ("best", "ok", "falling", "diverged", "skip")


@dataclass
class GoldConfig(Checked):
    enabled: bool = True  # acts only where a periodic eval runs (eval.every > 0)
    drop: float = bounded(0.05, gt=0, finite=True)  # below the best gold by more than this (the metric's units)
    confirm: int = bounded(2, ge=1)  # evals in a row, falling while rewarded
    reward_slack: float = bounded(0.0, ge=0, finite=True)  # how far the training reward may fall and still count
    action: str = bounded("rollback", choices=ACTIONS)  # rollback and tighten, or restore the best and stop
    lr_factor: float = bounded(0.5, gt=0, le=1)  # after a rollback: the learning rate's scale, for good
    beta_factor: float = bounded(2.0, ge=1, finite=True)  # after a rollback: trainer.beta x this (when beta > 0)
    max_rollbacks: int = bounded(2, ge=0)  # one more divergence stops the run, keeping the best policy
    save_best: bool = True  # also write the best policy to OUTPUT_DIR/best-gold (model or adapter, atomically)


@dataclass
class GoldDetector:
    """The divergence rule of the module docstring; ``update`` once per eval, in step order."""

    drop: float = 0.05
    confirm: int = 2
    reward_slack: float = 0.0
    best_gold: float | None = None
    best_step: int | None = None
    reward_at_best: float | None = None
    streak: int = 0  # evals in a row falling while rewarded
    evals: int = 0

    @classmethod
    def from_config(cls, config: GoldConfig) -> GoldDetector:
        return cls(config.drop, config.confirm, config.reward_slack)

    def update(self, step: int, gold: float, reward: float) -> str:
        """One eval: ``best`` (a new best, strictly above the old), ``ok``, ``falling`` (counted, not yet confirmed),
        ``diverged`` (confirmed) or ``skip`` (a non-finite gold metric: not counted)."""
        if not math.isfinite(gold):
            return "skip"
        self.evals += 1
        if self.best_gold is None or gold > self.best_gold:
            self.best_gold, self.best_step, self.reward_at_best, self.streak = gold, step, reward, 0
            return "best"
        assert self.reward_at_best is not None
        if not math.isfinite(self.reward_at_best) and math.isfinite(reward):
            self.reward_at_best = reward  # the best came before any training reward: its first level is the bar
        falling = gold < self.best_gold - self.drop
        rewarded = math.isfinite(reward) and math.isfinite(self.reward_at_best)
        rewarded = rewarded and reward >= self.reward_at_best - self.reward_slack
        self.streak = self.streak + 1 if falling and rewarded else 0
        if not self.streak:
            return "ok"
        return "diverged" if self.streak >= self.confirm else "falling"

    def restart(self) -> None:
        """After a rollback to the best policy: the streak starts again; the best stays."""
        self.streak = 0

    def state_dict(self) -> dict[str, Any]:
        keys = ("best_gold", "best_step", "reward_at_best", "streak", "evals")
        return {"version": 1, **{k: getattr(self, k) for k in keys}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"gold watch state version {state.get('version')!r} is not 1")
        self.best_gold, self.best_step = state["best_gold"], state["best_step"]
        self.reward_at_best, self.streak, self.evals = state["reward_at_best"], state["streak"], state["evals"]


def eval_points(
    rows: Iterable[Mapping[str, Any]], gold_key: str = EVAL_ACCURACY, reward_key: str = REWARD
) -> list[tuple[int, float, float]]:
    """(step, gold, reward) per eval row of a logged history, in order: ``reward`` is the mean of the ``reward_key``
    values logged after the previous eval row up to this one (NaN when none)."""
    points, since = [], []
    for row in rows:
        if reward_key in row and row[reward_key] is not None:
            since.append(float(row[reward_key]))
        if gold_key in row and row[gold_key] is not None:
            reward = sum(since) / len(since) if since else math.nan
            points.append((int(row.get("step", 0)), float(row[gold_key]), reward))
            since = []
    return points


def replay(
    rows: Iterable[Mapping[str, Any]], config: GoldConfig | None = None, gold_key: str = EVAL_ACCURACY
) -> list[tuple[int, str]]:
    """The detector's verdict at every eval of a logged history (no action: a replay cannot roll back)."""
    detector = GoldDetector.from_config(config or GoldConfig())
    return [(step, detector.update(step, gold, reward)) for step, gold, reward in eval_points(rows, gold_key)]
