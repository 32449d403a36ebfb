"""The gold watch's station (``guards.quatro.gold``; the rule: steadyrl/guards/gold_watch.py): eval points in, what
should happen out. It owns the rule's state, the action counts and the tightening the rollbacks left (the watch's
factors of the learning rate and of beta); it writes nothing into TRL. The runtime (``GoldWatch``,
steadyrl/callbacks/gold_watch.py) keeps and restores the policy on disk, and ``trl_state`` writes the factors.

Per eval: ``keep`` (a new reference, its policy to be kept), ``rollback`` (a confirmed fall: restore the kept policy,
then the learning rate x ``lr_factor`` and beta x ``beta_factor`` for the rest of the run, compounding per rollback),
``stop`` (``action: stop``, or past ``max_rollbacks``: restore the kept policy and end the run), ``warn`` (a
confirmed fall with nothing to restore: observe mode, ``save_best: false``) or ``none``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from steadyrl.guards.gold_watch import CONFIRMED, EvalPoint, GoldConfig, GoldDetector
from steadyrl.metrics import (
    EVAL_ACCURACY,
    QUATRO_GOLD_BEST,
    QUATRO_GOLD_ROLLBACKS,
    QUATRO_GOLD_STREAK,
    QUATRO_WOULD_GOLD_ROLLBACKS,
)

logger = logging.getLogger("steadyrl.quatro")

DECISIONS = ("none", "keep", "rollback", "stop", "warn")


@dataclass(frozen=True)
class GoldDecision:
    """What one eval asks for; ``evidence``: the fall, in words (confirmed verdicts only)."""

    action: str
    verdict: str
    evidence: str = ""


class GoldStation:
    """The watch's decisions for one run; ``observe``: count and warn, never act; ``kept()``: a policy of this run is
    on disk to restore."""

    def __init__(self, config: GoldConfig, observe: bool = False, metric: str = EVAL_ACCURACY) -> None:
        self.config, self.observe, self.metric = config, observe, metric
        self.detector = GoldDetector.from_config(config)
        self.rollbacks = 0  # confirmed falls acted on (observing: that it would have acted on), a stop included
        self.tightenings = 0  # rollbacks that tightened the learning rate and beta (not a stop)
        self.stopped = False
        self.last_gold: float | None = None  # the gold metric of the latest eval

    # ------------------------------------------------------------------ what the run carries
    @property
    def lr_factor(self) -> float:
        """The watch's factor of the learning rate, for the rest of the run: ``lr_factor`` per tightening."""
        return self.config.lr_factor**self.tightenings

    @property
    def beta_factor(self) -> float:
        """The watch's factor of beta: ``beta_factor`` per tightening."""
        return self.config.beta_factor**self.tightenings

    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "rollbacks": self.rollbacks, "tightenings": self.tightenings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])
        self.rollbacks = int(state["rollbacks"])
        # before the station, the tightening lived in the checkpointed LR schedule (base_lrs) and beta factors
        self.tightenings = int(state.get("tightenings", 0))

    # ------------------------------------------------------------------ one eval
    def judge(self, point: EvalPoint, kept: bool) -> GoldDecision:
        """The rule's verdict on one eval and what to do about it; ``kept``: a best policy of this run is on disk."""
        verdict = self.detector.update(*point)
        self.last_gold = point.gold
        if verdict == "best":
            save = self.config.save_best and not self.observe
            return GoldDecision("keep" if save else "none", verdict)
        if verdict not in CONFIRMED:
            return GoldDecision("none", verdict)
        evidence = self.evidence(point, verdict)
        self.rollbacks += 1
        if self.observe or not kept:
            return GoldDecision("warn", verdict, evidence)
        self.detector.restart()
        if self.config.action == "stop" or self.rollbacks > self.config.max_rollbacks:
            self.stopped = True
            return GoldDecision("stop", verdict, evidence)
        self.tightenings += 1
        return GoldDecision("rollback", verdict, evidence)

    def evidence(self, point: EvalPoint, verdict: str) -> str:
        d, c = self.detector, self.config
        how = "held" if verdict == "diverged" else "fell with it"
        moved, side = ("fell", "below") if c.mode == "max" else ("rose", "above")
        return (
            f"the eval metric ({self.metric}) {moved} from {d.best_gold:.4g} at step {d.best_step} to "
            f"{point.gold:.4g} at step {point.step} ({d.streak} evals in a row more than {d.margin(point.gold_se):.3g} "
            f"{side} it: the largest of guards.quatro.gold.drop={c.drop}, relative_drop={c.relative_drop} of it and "
            f"z={c.z} standard errors of the difference) while the training reward {how} ({point.reward:.4g} against "
            f"{d.reward_at_best:.4g} at step {d.best_step})"
        )

    def metrics(self) -> dict[str, float]:
        """The watch's row after an eval: best, streak and the cumulative rollbacks (``would`` ones observing)."""
        row = {QUATRO_GOLD_BEST: self.detector.best_gold} if self.detector.best_gold is not None else {}
        row[QUATRO_GOLD_STREAK] = float(self.detector.streak)
        row[QUATRO_WOULD_GOLD_ROLLBACKS if self.observe else QUATRO_GOLD_ROLLBACKS] = float(self.rollbacks)
        return row

    def end_on_best(self, kept: bool) -> str | None:
        """At the end of a run it acted on, a last eval on the worse side of the best: why the run ends on the best
        policy (None: it ends as it is)."""
        d = self.detector
        if self.observe or not self.rollbacks or self.stopped or d.best_gold is None or self.last_gold is None:
            return None
        if d.sign * self.last_gold >= d.sign * d.best_gold or not kept:
            return None
        side = "below" if self.config.mode == "max" else "above"
        return (
            f"the run ends with the eval metric ({self.metric}) at {self.last_gold:.4g}, {side} its best "
            f"{d.best_gold:.4g} at step {d.best_step}, after {self.rollbacks} gold-watch rollback(s)"
        )


def trl_eval_metric(config: GoldConfig, reward_names: list[str], reward_weights: list[float]) -> tuple[str | None, str]:
    """The key of TRL's own eval (``eval_strategy``) the watch reads, and why when there is none: ``metric`` when set,
    else ``eval_rewards/<name>/mean`` of the one reward function the policy is trained on with weight 0 (scored, never
    optimised: a gold metric; the trained reward is what a gamed policy holds up)."""
    if config.metric:
        return config.metric, ""
    watched = [n for n, w in zip(reward_names, reward_weights, strict=True) if w == 0]
    if len(watched) == 1:
        return f"eval_rewards/{watched[0]}/mean", ""
    found = f"{len(watched)} ({', '.join(watched)})" if watched else "none"
    return None, (
        "the gold watch reads a metric the policy is not trained on: pass one reward function with weight 0 "
        f"(args.reward_weights; found {found}) or name the logged key in guards quatro.gold.metric "
        "(e.g. eval_rewards/<name>/mean)"
    )


def trl_eval_se(row: dict[str, Any], key: str, prompts: int) -> float | None:
    """The standard error of TRL's ``eval_rewards/<name>/mean``: its logged ``.../std`` over ``prompts`` eval prompts
    (completions of one prompt are not independent: counting prompts, not completions, over-states the noise)."""
    if not key.endswith("/mean") or prompts < 1:
        return None
    std = row.get(key[: -len("/mean")] + "/std")
    return float(std) / prompts**0.5 if std is not None else None
