"""GoldWatch: the reward-hacking and regression watch at run time (``guards.quatro.gold``; the rule and its noise model:
steadyrl/guards/gold_watch.py).

After each periodic eval row (``PeriodicEval`` logs it at the start of the next step; this callback comes after it):

- a new reference (the eval with the highest lower bound gold - z*se, the "best"): the policy is kept in
  ``OUTPUT_DIR/best-gold/`` -- the weights once (the model or LoRA adapter as ``save_model`` writes it), the optimizer
  state once, or per rank where ZeRO partitions it, and ``gold.json`` -- through the checkpoints' staged, disk-checked
  path, so a crash or a full disk mid-write leaves the previous best whole (steadyrl/trainers/best_policy.py).
- a confirmed fall of the gold metric beyond its noise -- a divergence (the training reward held: gaming) or, with
  ``regression``, a regression (the reward fell with it: a run failing by itself, e.g. a learning rate too high) --:
  ``rollback`` restores the kept trainable tensors and optimizer state (the LR schedule and the other guards' state
  run on), drops TRL's buffered rollouts and the replay rows, has ``trl_state`` scale the learning rate by
  ``lr_factor`` and ``trainer.beta`` by ``beta_factor`` (when beta > 0) for the rest of the run, and training goes
  on; past ``max_rollbacks``, or with ``action: stop``, it restores the best policy at the end of the step under way
  (the eval row comes at a step's start, and a begun step cannot be skipped) and ends the run, which then saves and
  evaluates that policy. With QUATRO in observe mode it only logs what it would do. What to do is the station's
  (steadyrl/trainers/gold.py); this callback reads the rows and does it.

Metrics: ``quatro/gold_best``, ``quatro/gold_streak``, ``quatro/gold_rollbacks`` (cumulative; the ledger's
``gold_rollback``), ``quatro/gold_lr_factor`` on every step after a rollback (the ledger's ``gold_tightened``),
``quatro/would_gold_rollbacks`` in observe mode. The watch's state is guard state (checkpointed);
after a resume it rolls back to the files in ``best-gold/``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from steadyrl.callbacks.periodic_eval import _bare_model, trainer_log_fn
from steadyrl.guards.gold_watch import EvalPoint, GoldConfig, GoldDetector, RewardsSince, eval_point
from steadyrl.metrics import EVAL_ACCURACY, EVENT_GOLD_ROLLBACK, REWARD
from steadyrl.trainers.best_policy import META, restore_best, write_best
from steadyrl.trainers.gold import GoldDecision, GoldStation, trl_eval_se
from steadyrl.trainers.recovery import optimizer_chain
from steadyrl.trainers.trl_state import drop_buffered_rollouts, set_gold_factors

logger = logging.getLogger("steadyrl.quatro")

BEST_DIR = "best-gold"


class GoldWatch(TrainerCallback):
    """The gold watch of one trainer (its decisions: ``GoldStation``); ``observe``: count and warn, never act."""

    def __init__(
        self, config: GoldConfig, trainer: Any, observe: bool = False, metric: str = "", eval_prompts: int = 0
    ) -> None:
        """``metric``: the logged eval key to read (default ``config.metric``, else steadyrl's ``eval/accuracy``);
        ``eval_prompts``: TRL's eval prompts, for the standard error of its ``eval_rewards/<name>/mean``."""
        self.config, self.trainer = config, trainer
        self.observe = observe
        self.metric = metric or config.metric or EVAL_ACCURACY
        self.eval_prompts = eval_prompts
        self.station = GoldStation(config, observe, self.metric)
        self._stop_pending = False  # restore the best policy and stop at the end of the step under way
        self._ending = False
        self._seen = 0  # log_history rows already read
        self._rewards = RewardsSince()  # the training rewards the next eval is judged with

    @property
    def detector(self) -> GoldDetector:
        return self.station.detector

    @property
    def rollbacks(self) -> int:
        return self.station.rollbacks

    # ------------------------------------------------------------------ guard state
    def state_dict(self) -> dict[str, Any]:
        return self.station.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.station.load_state_dict(state)
        if not self.observe:  # the tightening of the rollbacks before the resume goes on
            set_gold_factors(self.trainer, self.station.lr_factor, self.station.beta_factor, now=False)

    # ------------------------------------------------------------------ callback
    @property
    def best_dir(self) -> Path:
        return Path(self.trainer.args.output_dir) / BEST_DIR

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # rows from before a resume were judged by the run that logged them; their rewards since the last eval are the
        # level of the eval a resumed run runs again first (without them, that eval had none and reset a pending streak)
        for row in state.log_history:
            self._rewards.add(row.get(REWARD))
            if row.get(self.metric) is not None:
                self._rewards.take()
        self._seen = len(state.log_history)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._read(state, control)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._stop_pending:  # the step that began with the verdict could not be skipped: its update goes too
            self._stop_pending = False
            self._restore()
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """After the final periodic eval and before the run summary (``add_guard_callback``): a pending stop, or a
        run it acted on that ends below its best, ends on the best policy."""
        self._ending = True
        self._read(state, control)
        if self._stop_pending:
            self._stop_pending = False
            self._restore()
            return
        cause = self.station.end_on_best(self._kept())
        if cause is not None:
            d = self.detector
            self.trainer.emit_event(EVENT_GOLD_ROLLBACK, step=state.global_step, cause=cause, snapshot_step=d.best_step)
            if self.trainer.ledger is not None:  # the run summary, written after this callback, says so
                self.trainer.ledger.ended_on = {
                    "guard": "gold",
                    "policy_step": d.best_step,
                    "gold": d.best_gold,
                    "last_gold": self.station.last_gold,
                }
            logger.warning(
                "step %d: %s: the best policy is restored, and it is what the run saves and evaluates (kept in %s)",
                state.global_step,
                cause,
                self.best_dir,
            )
            self._restore()

    def _read(self, state: Any, control: Any) -> None:
        rows = state.log_history[self._seen :]
        self._seen = len(state.log_history)
        for row in rows:
            self._rewards.add(row.get(REWARD))
            if row.get(self.metric) is not None:
                se = trl_eval_se(row, self.metric, self.eval_prompts) if self.metric != EVAL_ACCURACY else None
                row = {**row, self.metric + "_se": se} if se is not None else row
                step = int(row.get("step", state.global_step))
                self._judge(eval_point(row, self._rewards.take(), step, self.metric))

    def _judge(self, point: EvalPoint) -> None:
        decision = self.station.judge(point, self._kept())
        if decision.action == "keep":
            self._keep(point.step, point.gold, point.reward)
        elif decision.action != "none":
            self._act(point.step, decision)
        row = self.station.metrics()
        if self._ending:  # no training row follows: a row of its own (before the run summary)
            trainer_log_fn(self.trainer)(row)
        else:
            self.trainer.ctx.log_metrics(row)

    def _act(self, step: int, decision: GoldDecision) -> None:
        what = "reward hacking" if decision.verdict == "diverged" else "the run regressed"
        s, d, c = self.station, self.detector, self.config
        if decision.action == "warn":
            why = "observe mode: nothing restored" if self.observe else "no best policy was kept (save_best: false)"
            logger.warning("step %d: %s suspected: %s; %s", step, what, decision.evidence, why)
            return
        self.trainer.emit_event(
            EVENT_GOLD_ROLLBACK, cause=decision.evidence, snapshot_step=d.best_step, verdict=decision.verdict
        )
        if decision.action == "stop":
            self._stop_pending = True
            logger.warning(
                "step %d: %s: %s. Stopping the run with the best policy restored (step %d, %s %.4g; kept "
                "in %s): what it saves and evaluates is that policy. Fix the reward (or, for a regression, lower "
                "trainer.learning_rate), or turn the watch off (guards.quatro.gold.enabled=false) to train on",
                step, what, decision.evidence, d.best_step, self.metric, d.best_gold, self.best_dir,
            )  # fmt: skip
            return
        self._restore()
        drop_buffered_rollouts(self.trainer)  # sampled from the policy just left
        set_gold_factors(self.trainer, s.lr_factor, s.beta_factor, now=True)
        beta = self.trainer.beta_base > 0 and c.beta_factor != 1
        logger.warning(
            "step %d: %s: %s. Rolled back to the best policy (step %d; rollback %d of %d); learning rate "
            "x%g%s from now on (x%g and x%g of the run's settings in all)",
            step, what, decision.evidence, d.best_step, s.rollbacks, c.max_rollbacks, c.lr_factor,
            f", beta x{c.beta_factor}" if beta else "", s.lr_factor, s.beta_factor if beta else 1.0,
        )  # fmt: skip

    # ------------------------------------------------------------------ the kept policy (trainers/best_policy.py)
    def _parts(self) -> tuple[torch.nn.Module, list[tuple[str, torch.nn.Parameter]], Any, Any]:
        model = _bare_model(self.trainer.model)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        chain = optimizer_chain(self.trainer.optimizer)
        zero = next((o for o in chain if hasattr(o, "single_partition_of_fp32_groups")), None)
        return model, trainable, chain[-1], zero

    def _kept(self) -> bool:
        """A best policy of this run is on disk (with ``save_best: false`` a ``best-gold/`` left in the output_dir by
        an earlier run is never restored)."""
        return self.config.save_best and (self.best_dir / META).is_file()

    def _keep(self, step: int, gold: float, reward: float) -> None:
        _, _, base, zero = self._parts()
        write_best(
            self.trainer,
            self.best_dir,
            base,
            zero,
            {"step": step, "metric": self.metric, "gold": gold, "reward": reward},
        )

    def _restore(self) -> None:
        model, trainable, base, zero = self._parts()
        restore_best(self.trainer, self.best_dir, model, trainable, base, zero)  # as OPEFO's: the schedule runs on
