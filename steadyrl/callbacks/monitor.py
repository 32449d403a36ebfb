"""SignalMonitor: every ``monitor.every`` optimizer steps, a one-line health summary and the warnings of
``steadyrl.evidence.early_warnings`` over the Trainer's log history, in the log (main process only); and, once per
rule, the doctor's rollout reward-hacking rules (``doctor.rollout_hacking``: completion length drifting or
truncation rising while the reward rises), which need no eval metric; and, once, the doctor's rule on the vLLM
rollouts' effective sample size (``doctor.rollout_mismatch``)."""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from steadyrl import metrics as M
from steadyrl.evidence.doctor import rollout_hacking, rollout_mismatch
from steadyrl.evidence.early_warnings import MonitorConfig, early_warnings, logp_gap_allowance
from steadyrl.evidence.history import history_of

logger = logging.getLogger("steadyrl.monitor")

SUMMARY_KEYS = (M.GRAD_NORM, M.REWARD, M.REWARD_STD, M.GEPO_ADV_STD, M.GEPO_ADV_MAX_ABS, M.ENTROPY, M.KL)
SUMMARY_KEYS += (M.GEPO_SKIPPED_STEPS, M.GEPO_NONFINITE_REWARDS)


class SignalMonitor(TrainerCallback):
    def __init__(self, config: MonitorConfig | None = None) -> None:
        self.config = config or MonitorConfig()
        self.warnings: list[tuple[int, str]] = []
        self._last_step = -1
        self._latest: dict[str, Any] = {}  # the last logged value of each SUMMARY_KEYS metric
        self._rows_read = 0  # log_history rows already folded into _latest
        self._history: list[dict[str, Any]] | None = None  # the list those rows came from
        self._hacking_warned: set[str] = set()  # rollout reward-hacking rules already reported (once each)
        self._mismatch_warned = False  # the vLLM rollouts' ESS rule, reported once

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if not state.is_world_process_zero or step % self.config.every or step == self._last_step:
            return  # (the Trainer logs twice at the last step: the step's metrics, then the run summary)
        self._last_step = step
        if state.log_history is not self._history or len(state.log_history) < self._rows_read:
            self._latest, self._rows_read = {}, 0  # a new history (another train() call, a resume): read it all
            self._history = state.log_history
        for row in state.log_history[self._rows_read :]:  # only the rows logged since the last summary
            self._latest.update((k, v) for k, v in row.items() if k in SUMMARY_KEYS)
        self._rows_read = len(state.log_history)
        latest = self._latest
        summary = ", ".join(f"{k}={latest[k]:.4g}" for k in SUMMARY_KEYS if isinstance(latest.get(k), (int, float)))
        logger.info("step %d: %s", state.global_step, summary)
        sampling = (getattr(args, k, d) for k, d in (("top_p", 1.0), ("top_k", 0), ("min_p", 0.0)))
        allowance = logp_gap_allowance(*sampling, getattr(args, "repetition_penalty", 1.0))
        for warning in early_warnings(state.log_history, self.config, allowance):
            self._warn(step, warning)
        history = history_of(state.log_history)
        for name, summary in rollout_hacking(history):
            if name in self._hacking_warned:
                continue
            self._hacking_warned.add(name)
            self._warn(step, (
                f"reward hacking suspected: {summary} (steadyrl doctor says which fix; the gold watch, "
                "guards.quatro.gold, keeps the best policy when eval.every and an eval metric are set)"
            ))  # fmt: skip
        for summary in [] if self._mismatch_warned else rollout_mismatch(history)[:1]:
            self._mismatch_warned = True
            self._warn(step, f"vLLM rollouts off-policy: {summary} (steadyrl doctor names the keys to change)")

    def _warn(self, step: int, warning: str) -> None:
        self.warnings.append((step, warning))
        logger.warning("step %d: EARLY WARNING: %s", step, warning)
