"""The rollout-trainer mismatch (vLLM rollouts): how far the log-probabilities vLLM sampled with are from those the
trainer computes for the same tokens, from the tensors TRL's ``_generate_and_score_completions`` already returns
(``old_per_token_logps``, ``sampling_per_token_logps``, the completion mask), and a step guard that skips an update
whose effective sample size collapsed (``guards.gepo.mismatch.ess_min``; off by default).

Per token ``r = log pi_train - log pi_vllm`` (tokens vLLM gave no log-prob for are left out), ``rho = exp(r)``; per
sequence ``S = sum_t r``. The ``mismatch/*`` metrics of one generation batch, gathered over every rank:

- ``corrected_share``: the share TRL's correction changed: tokens (``token_*`` modes) or sequences (``sequence_*``)
  whose ratio lies outside [clip_min, clip_max], masked to 0 or truncated to the bound;
- ``ess``: normalised effective sample size of the sequence weights ``w = exp(S)``: (sum w)^2 / (N sum w^2), in
  [1/N, 1]; 1 when vLLM and the trainer agree;
- ``ratio_q01`` / ``ratio_q99``: the 1st and 99th percentile of the token ratio ``rho`` (of a seeded uniform sample of
  ``QUANTILE_SAMPLE`` tokens past that many: ``torch.quantile`` refuses more than 2^24 elements, ~16.8 M tokens a
  batch at 7B scale; the sample's quantile is within about 1e-4 in rank of the batch's);
- ``log_ppl_diff``: the trainer's log-perplexity minus vLLM's, per sequence, averaged: ``-mean_seq(mean_tok r)``;
- ``kl``: KL(pi_vllm || pi_train) per token, estimated from vLLM's samples with k3 = rho - 1 - r (>= 0);
- ``chi2``: the chi-square distance per token, ``mean((rho - 1)^2)``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.guards.base import StepDecision
from steadyrl.ranges import Checked, bounded

logger = logging.getLogger(__name__)

PREFIX = "mismatch/"
QUANTILE_SAMPLE = 1 << 20  # tokens the ratio quantiles are read from at most (module docstring)
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")  # TRL 1.16's


@dataclass
class MismatchConfig(Checked):
    """``guards.gepo.mismatch``: log ``mismatch/*`` on vLLM rollouts (with TRL's importance-sampling correction on)
    and, with ``ess_min`` set, skip every optimizer step trained on a generation batch whose ``mismatch/ess`` is
    below it (null: never skip)."""

    enabled: bool = True
    ess_min: float | None = bounded(None, gt=0, lt=1)
    max_consecutive_skips: int = bounded(10, ge=1)  # then stop: vLLM keeps generating from other weights


def log_ratio_rows(output: dict[str, Any]) -> torch.Tensor | None:
    """(rows, T) ``log pi_train - log pi_vllm`` of one rank's generation batch, NaN outside the completion (or tool)
    mask and where vLLM gave no log-prob; None when TRL returned no sampling log-probs (no vLLM, or no correction)."""
    old, sampling = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
    if old is None or sampling is None:
        return None
    mask = output["completion_mask"].bool()
    if output.get("tool_mask") is not None:
        mask = mask & output["tool_mask"].bool()
    diff = (old.detach().float() - sampling.detach().float()).masked_fill(~mask, math.nan)
    return diff


def gather_rows(x: torch.Tensor, gather: Any, processes: int) -> torch.Tensor:
    """Every rank's (rows, T) float matrix stacked in rank order, each padded with NaN to the widest T (two
    collectives; none on one process). ``gather``: the trainer's all-gather of a flat tensor."""
    if processes == 1:
        return x.cpu()
    width = int(gather(torch.tensor([x.shape[1]], device=x.device)).max())
    padded = torch.nn.functional.pad(x, (0, width - x.shape[1]), value=math.nan)
    return gather(padded.reshape(-1)).view(-1, width).cpu()


def _sample(x: torch.Tensor, limit: int = QUANTILE_SAMPLE) -> torch.Tensor:
    """``x`` (1-d), or ``limit`` of its elements drawn uniformly with replacement by a fixed seed (the same draw on
    every rank: they measure the same gathered batch)."""
    if x.numel() <= limit:
        return x
    generator = torch.Generator().manual_seed(0)
    return x[torch.randint(x.numel(), (limit,), generator=generator)]


def measure(log_ratio: torch.Tensor, mode: str, clip_min: float | None, clip_max: float | None) -> dict[str, float]:
    """``mismatch/*`` (module docstring) of a (rows, T) log-ratio matrix, NaN = not a scored token. ``mode``,
    ``clip_min``, ``clip_max``: TRL's ``vllm_importance_sampling_*`` settings. Empty dict when no token is scored."""
    valid = torch.isfinite(log_ratio)
    r = log_ratio[valid].double()
    if r.numel() == 0:
        return {}
    rho = r.exp()
    per_row = torch.where(valid, log_ratio.double(), 0.0)
    rows = valid.any(dim=1)
    sums = per_row.sum(dim=1)[rows]  # S per sequence with at least one scored token
    means = sums / valid.sum(dim=1)[rows]
    lo = clip_min if clip_min is not None else 0.0
    hi = clip_max if clip_max is not None else math.inf
    judged = sums.exp() if mode.startswith("sequence") else rho
    shifted = (sums - sums.max()).exp()  # ESS is scale-free: shift S by its max so exp never overflows
    quantiles = torch.quantile(_sample(rho), torch.tensor([0.01, 0.99], dtype=rho.dtype)).tolist()
    return {
        PREFIX + "corrected_share": float(((judged < lo) | (judged > hi)).double().mean()),
        PREFIX + "ess": float(shifted.sum() ** 2 / (len(shifted) * (shifted**2).sum())),
        PREFIX + "ratio_q01": float(quantiles[0]),
        PREFIX + "ratio_q99": float(quantiles[1]),
        PREFIX + "log_ppl_diff": float(-means.mean()),
        PREFIX + "kl": float((rho - 1 - r).mean()),
        PREFIX + "chi2": float(((rho - 1) ** 2).mean()),
    }


class MismatchGate:
    """A StepGuard: skips every optimizer step while the generation batch it trains on had ``mismatch/ess`` below
    ``ess_min`` (``note`` sets it when the batch is generated; the value is identical on every rank). The
    ``max_consecutive``-th such step in a row raises ``MismatchError`` (as the spike guard counts): the sync is
    broken, skipping only hides it. A step it skips is not fed back by OPEFO's error feedback: its gradient is
    off-policy in direction, not only in size."""

    feeds_back = False

    def __init__(self, ess_min: float, max_consecutive: int = 10) -> None:
        self.ess_min, self.max_consecutive = ess_min, max_consecutive
        self.ess: float | None = None  # the current generation batch's
        self.skipped = self.consecutive = 0

    def note(self, ess: float | None) -> None:
        self.ess = ess

    def decide(self, grad_norm: torch.Tensor, step: int) -> StepDecision:
        if self.ess is None or not self.ess < self.ess_min:
            self.consecutive = 0
            return StepDecision.proceed()
        self.skipped += 1
        self.consecutive += 1
        if self.consecutive >= self.max_consecutive:
            raise MismatchError(
                f"step {step + 1}: {self.consecutive} optimizer steps in a row trained on rollouts whose effective "
                f"sample size is below guards.gepo.mismatch.ess_min={self.ess_min:g} (last: {self.ess:.3g}): vLLM "
                "keeps generating from other weights than the trained ones. Check the weight sync (vLLM version, "
                "server reachable on TRL's group_port), or set trainer.use_vllm=false; resume from the last checkpoint"
            )
        logger.warning(
            "step %d: rollout-trainer mismatch: ESS %.3g < guards.gepo.mismatch.ess_min %g, the step is skipped",
            step + 1, self.ess, self.ess_min,
        )  # fmt: skip
        return StepDecision(True, "mismatch")

    def on_skip(self, gradients: list[torch.Tensor | None], decision: StepDecision, step: int) -> None:
        """Nothing kept here."""

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "ess": self.ess, "skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ess, self.skipped, self.consecutive = state["ess"], int(state["skipped"]), int(state["consecutive"])


class MismatchError(RuntimeError):
    """The mismatch gate skipped too many steps in a row."""
