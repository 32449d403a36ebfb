"""GoldWatch: the reward-hacking and regression watch at run time (``guards.quatro.gold``; the rule and its noise model:
steadyrl/guards/gold_watch.py).

After each periodic eval row (``PeriodicEval`` logs it at the start of the next step; this callback comes after it):

- a new reference (the eval with the highest lower bound gold - z*se, the "best"): the policy is kept in
  ``OUTPUT_DIR/best-gold/`` -- the model (or LoRA adapter) as ``save_model`` writes it, ``gold_state_rank<r>.pt`` with
  the trainable tensors and the optimizer state of each rank, and ``gold.json`` (step, gold metric, training reward).
  It is written to ``best-gold.tmp`` and swapped in, so a crash mid-write leaves the previous best whole.
- a confirmed fall of the gold metric beyond its noise -- a divergence (the training reward held: gaming) or, with
  ``regression``, a regression (the reward fell with it: a run failing by itself, e.g. a learning rate too high) --:
  ``rollback`` restores the kept trainable tensors and optimizer state (the LR schedule and the other guards' state
  run on), scales the learning rate by ``lr_factor`` and ``trainer.beta`` by ``beta_factor`` (when beta > 0), and
  training goes on; past ``max_rollbacks``, or with ``action: stop``, it restores the best policy at the end of the
  step under way (the eval row comes at a step's start, and a begun step cannot be skipped) and ends the run, which
  then saves and evaluates that policy. With QUATRO in observe mode it only logs what it would do.

Metrics: ``quatro/gold_best``, ``quatro/gold_streak``, ``quatro/gold_rollbacks`` (cumulative; the ledger's
``gold_rollback``), ``quatro/would_gold_rollbacks`` in observe mode. The watch's state is guard state (checkpointed);
after a resume it rolls back to the files in ``best-gold/``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from steadyrl.callbacks.periodic_eval import _bare_model, trainer_log_fn
from steadyrl.guards.gold_watch import CONFIRMED, EvalPoint, GoldConfig, GoldDetector, RewardsSince, eval_point
from steadyrl.guards.rollback import cpu_copy
from steadyrl.metrics import (
    EVAL_ACCURACY,
    EVENT_GOLD_ROLLBACK,
    QUATRO_GOLD_BEST,
    QUATRO_GOLD_ROLLBACKS,
    QUATRO_GOLD_STREAK,
    QUATRO_WOULD_GOLD_ROLLBACKS,
    REWARD,
)
from steadyrl.trainers.recovery import optimizer_chain, restore_payload
from steadyrl.trainers.trl_state import set_beta_factor

logger = logging.getLogger("steadyrl.quatro")

BEST_DIR = "best-gold"


class GoldWatch(TrainerCallback):
    """The gold watch of one trainer; ``observe``: count and warn, never act."""

    def __init__(self, config: GoldConfig, trainer: Any, observe: bool = False) -> None:
        self.config, self.trainer = config, trainer
        self.observe = observe
        self.detector = GoldDetector.from_config(config)
        self.rollbacks = 0  # acted (or, observing, would have)
        self.stopped = False
        self._stop_pending = False  # restore the best policy and stop at the end of the step under way
        self._ending = False
        self._seen = 0  # log_history rows already read
        self._last_gold: float | None = None  # the gold metric of the latest eval
        self._rewards = RewardsSince()  # the training rewards the next eval is judged with

    # ------------------------------------------------------------------ guard state
    def state_dict(self) -> dict[str, Any]:
        return {"detector": self.detector.state_dict(), "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])
        self.rollbacks = int(state["rollbacks"])

    # ------------------------------------------------------------------ callback
    @property
    def best_dir(self) -> Path:
        return Path(self.trainer.args.output_dir) / BEST_DIR

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # rows from before a resume were judged by the run that logged them; their rewards since the last eval are the
        # level of the eval a resumed run runs again first (without them, that eval had none and reset a pending streak)
        for row in state.log_history:
            self._rewards.add(row.get(REWARD))
            if row.get(EVAL_ACCURACY) is not None:
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
        self._ending = True
        self._read(state, control)
        if self._stop_pending:
            self._stop_pending = False
            self._restore()
        elif self._end_on_best(state.global_step):
            self._restore()

    def _end_on_best(self, step: int) -> bool:
        """After an action in this run, a last eval below the best: end on the best policy (logged and counted)."""
        d = self.detector
        if self.observe or not self.rollbacks or self.stopped or d.best_gold is None or self._last_gold is None:
            return False
        if self._last_gold >= d.best_gold or not self._kept():
            return False
        cause = (
            f"the run ends with the eval metric ({EVAL_ACCURACY}) at {self._last_gold:.4g}, below its best "
            f"{d.best_gold:.4g} at step {d.best_step}, after {self.rollbacks} gold-watch rollback(s)"
        )
        self.trainer.emit_event(EVENT_GOLD_ROLLBACK, step=step, cause=cause, snapshot_step=d.best_step)
        logger.warning("step %d: %s: the best policy is restored, and it is what the run saves and evaluates (kept in "
                       "%s)", step, cause, self.best_dir)  # fmt: skip
        return True

    def _read(self, state: Any, control: Any) -> None:
        rows = state.log_history[self._seen :]
        self._seen = len(state.log_history)
        for row in rows:
            self._rewards.add(row.get(REWARD))
            if row.get(EVAL_ACCURACY) is not None:
                self._judge(eval_point(row, self._rewards.take(), int(row.get("step", state.global_step))), control)

    def _judge(self, point: EvalPoint, control: Any) -> None:
        step, gold, reward, se = point.step, point.gold, point.reward, point.gold_se
        verdict = self.detector.update(*point)
        self._last_gold = gold
        log = self.trainer.ctx.log_metric
        if verdict == "best" and self.config.save_best and not self.observe:
            self._keep(step, gold, reward)
        if verdict in CONFIRMED:
            self._diverged(step, gold, reward, se, verdict, control)
        row = {QUATRO_GOLD_BEST: self.detector.best_gold} if self.detector.best_gold is not None else {}
        row[QUATRO_GOLD_STREAK] = float(self.detector.streak)
        row[QUATRO_WOULD_GOLD_ROLLBACKS if self.observe else QUATRO_GOLD_ROLLBACKS] = float(self.rollbacks)
        if self._ending:  # no training row follows: a row of its own (the ledger's table was written already)
            trainer_log_fn(self.trainer)(row)
        else:
            for name, value in row.items():
                log(name, value)

    def _evidence(self, step: int, gold: float, reward: float, se: float, verdict: str) -> str:
        d, c = self.detector, self.config
        how = "held" if verdict == "diverged" else "fell with it"
        return (
            f"the eval metric ({EVAL_ACCURACY}) fell from {d.best_gold:.4g} at step {d.best_step} to {gold:.4g} at "
            f"step {step} ({d.streak} evals in a row more than {d.margin(se):.3g} below it: the larger of "
            f"guards.quatro.gold.drop={c.drop} and z={c.z} standard errors of the difference) while the training "
            f"reward {how} ({reward:.4g} against {d.reward_at_best:.4g} at step {d.best_step})"
        )

    def _diverged(self, step: int, gold: float, reward: float, se: float, verdict: str, control: Any) -> None:
        evidence = self._evidence(step, gold, reward, se, verdict)
        what = "reward hacking" if verdict == "diverged" else "the run regressed"
        self.rollbacks += 1
        if self.observe:
            logger.warning("step %d: %s suspected: %s; observe mode: nothing restored", step, what, evidence)
            return
        if not self._kept():
            logger.warning("step %d: %s suspected: %s; no best policy was kept (save_best: false)", step, what,
                           evidence)  # fmt: skip
            return
        self.detector.restart()
        self.trainer.emit_event(
            EVENT_GOLD_ROLLBACK, cause=evidence, snapshot_step=self.detector.best_step, verdict=verdict
        )
        if self.config.action == "stop" or self.rollbacks > self.config.max_rollbacks:
            self.stopped = self._stop_pending = True
            logger.warning(
                "step %d: %s: %s. Stopping the run with the best policy restored (step %d, %s %.4g; kept "
                "in %s): what it saves and evaluates is that policy. Fix the reward (or, for a regression, lower "
                "trainer.learning_rate), or turn the watch off (guards.quatro.gold.enabled=false) to train on",
                step, what, evidence, self.detector.best_step, EVAL_ACCURACY, self.detector.best_gold, self.best_dir,
            )  # fmt: skip
            return
        self._restore()
        self._tighten()
        logger.warning(
            "step %d: %s: %s. Rolled back to the best policy (step %d; rollback %d of %d); learning rate "
            "x%g%s from now on",
            step, what, evidence, self.detector.best_step, self.rollbacks, self.config.max_rollbacks,
            self.config.lr_factor,
            f", beta x{self.config.beta_factor}" if self.trainer.beta_base > 0 and self.config.beta_factor != 1 else "",
        )  # fmt: skip

    # ------------------------------------------------------------------ the kept policy
    def _parts(self) -> tuple[list[tuple[str, torch.nn.Parameter]], Any, Any]:
        model = _bare_model(self.trainer.model)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        chain = optimizer_chain(self.trainer.optimizer)
        zero = next((o for o in chain if hasattr(o, "single_partition_of_fp32_groups")), None)
        return trainable, chain[-1], zero

    def _kept(self) -> bool:
        """A best policy of this run is on disk (with ``save_best: false`` a ``best-gold/`` left in the output_dir by
        an earlier run is never restored)."""
        return self.config.save_best and (self.best_dir / "gold.json").is_file()

    def _keep(self, step: int, gold: float, reward: float) -> None:
        trainable, base, zero = self._parts()
        acc = self.trainer.accelerator
        tmp = Path(str(self.best_dir) + ".tmp")
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        acc.wait_for_everyone()
        # every rank calls it (DeepSpeed gathers), the main process writes; internal: never pushed to the Hub
        self.trainer.save_model(str(tmp), _internal_call=True)
        payload: dict[str, Any] = {
            "params": {n: p.detach() for n, p in trainable},
            "optimizer": base.state_dict(),
        }
        if zero is not None:
            payload["fp32_partitions"] = [t.detach() for t in zero.single_partition_of_fp32_groups]
        tmp.mkdir(parents=True, exist_ok=True)
        part = tmp / f"gold_state_rank{acc.process_index}.pt"
        torch.save(cpu_copy(payload), str(part) + ".part")
        os.replace(str(part) + ".part", part)
        acc.wait_for_everyone()
        if acc.is_main_process:
            meta = {"step": step, "metric": EVAL_ACCURACY, "gold": gold, "reward": reward, "ranks": acc.num_processes}
            (tmp / "gold.json").write_text(json.dumps(meta, indent=1) + "\n")
            old = Path(str(self.best_dir) + ".old")
            shutil.rmtree(old, ignore_errors=True)
            if self.best_dir.exists():
                os.replace(self.best_dir, old)
            os.replace(tmp, self.best_dir)
            shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    def _restore(self) -> None:
        trainable, base, zero = self._parts()
        acc = self.trainer.accelerator
        payload = torch.load(self.best_dir / f"gold_state_rank{acc.process_index}.pt", weights_only=False)
        restore_payload(payload, trainable, base, zero)  # as OPEFO's rollback: the schedule runs on

    def _tighten(self) -> None:
        c, trainer = self.config, self.trainer
        scheduler = trainer.lr_scheduler
        if scheduler is not None and hasattr(scheduler, "base_lrs"):  # the schedule goes on from lower bases
            scheduler.base_lrs = [lr * c.lr_factor for lr in scheduler.base_lrs]
        for group in optimizer_chain(trainer.optimizer)[-1].param_groups:
            group["lr"] *= c.lr_factor
        if trainer.beta_base > 0 and c.beta_factor != 1:
            set_beta_factor(trainer, "gold", c.beta_factor**self.rollbacks)
