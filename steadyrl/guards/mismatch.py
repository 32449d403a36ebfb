"""The rollout-trainer mismatch (vLLM rollouts): how far the log-probabilities vLLM sampled with are from those the
trainer computes for the same tokens, from the tensors TRL's ``_generate_and_score_completions`` already returns
(``old_per_token_logps``, ``sampling_per_token_logps``, the completion mask), and a step guard that skips an update
whose effective sample size collapsed (``guards.gepo.mismatch.ess_min``; off by default).

Per token ``r = log pi_train - log pi_vllm`` (tokens vLLM gave no log-prob for are left out), ``rho = exp(r)``; per
sequence ``S = sum_t r``. The ``mismatch/*`` metrics of one generation batch, over every rank (each rank sends
sums and its share of the quantile sample, never its matrix: two gathers, at most ``processes x (10 +
QUANTILE_SAMPLE)`` values, about ``QUANTILE_SAMPLE`` when the ranks hold similar token counts):

- ``corrected_share``: the share TRL's correction changed: tokens (``token_*`` modes) or sequences (``sequence_*``)
  whose ratio lies outside [clip_min, clip_max], masked to 0 or truncated to the bound;
- ``ess``: normalised effective sample size of the sequence weights ``w = exp(S)``: (sum w)^2 / (N sum w^2), in
  [1/N, 1]; 1 when vLLM and the trainer agree. Under truncated sampling with TRL <= 1.16 (``truncation_band``)
  each token's r is first moved to the nearest point outside ``[band, 0]``, the log-ratio that truncation alone
  puts there (an in-sync run's ESS would fall with completion length; a stale sync's ratios leave the band);
- ``ratio_q01`` / ``ratio_q99``: the 1st and 99th percentile of the token ratio ``rho`` (of a seeded uniform sample of
  ``QUANTILE_SAMPLE`` tokens past that many, each rank drawing its share in proportion to its tokens:
  ``torch.quantile`` refuses more than 2^24 elements, ~16.8 M tokens a batch at 7B scale; the sample's quantile is
  within about 1e-4 in rank of the batch's);
- ``log_ppl_diff``: the trainer's log-perplexity minus vLLM's, per sequence, averaged: ``-mean_seq(mean_tok r)``;
- ``kl``: KL(pi_vllm || pi_train) per token, estimated from vLLM's samples with k3 = rho - 1 - r (>= 0);
- ``chi2``: the chi-square distance per token, ``mean((rho - 1)^2)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
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


def truncation_band(trainer: dict[str, Any], trl_version: str | None) -> float | None:
    """The lowest per-token log-ratio ``log pi_train - log pi_vllm`` that the sampling settings alone explain on an
    in-sync run, or None when they explain none (0 would be the same: no band).

    TRL <= 1.16 asks vLLM for ``processed_logprobs`` (renormalised over the tokens top_p / top_k / min_p keep) while
    the trainer's are over the whole vocabulary: each sampled token's log-ratio is ``log`` of the kept mass at its
    position (huggingface/trl#6789), in ``[log top_p, 0]`` with top_p alone, ``(-inf, 0]`` with top_k or min_p.
    ``trainer``: the trainer settings (TRL's defaults where absent); ``trl_version``: the TRL that ran or runs."""
    from packaging.version import Version

    if trl_version is None or Version(trl_version).release[:2] > (1, 16):
        return None
    top_p, top_k, min_p = float(trainer.get("top_p", 1.0)), int(trainer.get("top_k") or 0), trainer.get("min_p")
    if top_k > 0 or float(min_p or 0.0) > 0.0:
        return -math.inf
    return math.log(top_p) if 0.0 < top_p < 1.0 else None


def truncation_settings(trainer: dict[str, Any]) -> str:
    """The sampling settings that truncate, in words (``top_p=0.95, top_k=20``); "" when none does."""
    return ", ".join(f"{k}={trainer[k]}" for k in ("top_p", "top_k", "min_p") if trainer.get(k) not in (None, 0, 1.0))


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


def _sample(x: torch.Tensor, size: int, seed: int) -> torch.Tensor:
    """``x`` (1-d) when ``size`` covers it, else ``size`` of its elements drawn uniformly with replacement."""
    if x.numel() <= size:
        return x
    generator = torch.Generator().manual_seed(seed)
    return x[torch.randint(x.numel(), (size,), generator=generator).to(x.device)]


def measure(
    log_ratio: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    processes: int = 1,
    rank: int = 0,
    band: float | None = None,
) -> dict[str, float]:
    """``mismatch/*`` (module docstring) of the generation batch whose (rows, T) log-ratio matrix on this rank is
    ``log_ratio`` (NaN = not a scored token), the same on every rank. ``mode``, ``clip_min``, ``clip_max``: TRL's
    ``vllm_importance_sampling_*`` settings; ``band``: ``truncation_band`` (the ESS reads only what lies outside
    it). ``gather``: the trainer's all-gather of a flat tensor (two calls, every rank; none on one process). Empty
    dict when no token is scored on any rank."""
    valid = torch.isfinite(log_ratio)
    r = log_ratio[valid].double()
    per_row = torch.where(valid, log_ratio.double(), 0.0)
    rows = valid.any(dim=1)
    sums = per_row.sum(dim=1)[rows]  # S per sequence with at least one scored token
    excess = per_row if band is None else per_row - per_row.clamp(min=band, max=0.0)
    ess_sums = excess.sum(dim=1)[rows]  # S with the part truncation explains taken out
    head = torch.tensor([float(r.numel()), ess_sums.max().item() if sums.numel() else -math.inf], dtype=torch.float64)
    heads = head.view(1, 2) if processes == 1 or gather is None else gather(head.to(log_ratio.device)).cpu().view(-1, 2)
    tokens = heads[:, 0].tolist()
    total = sum(tokens)
    if total == 0:
        return {}
    # each rank's share of the quantile sample, in proportion to its tokens (all of them when the batch fits)
    shares = [int(n) if total <= QUANTILE_SAMPLE else math.ceil(QUANTILE_SAMPLE * n / total) for n in tokens]
    lo = clip_min if clip_min is not None else 0.0
    hi = clip_max if clip_max is not None else math.inf
    rho = r.exp()
    judged = sums.exp() if mode.startswith("sequence") else rho
    shifted = (ess_sums - heads[:, 1].max().item()).exp()  # ESS is scale-free: shift S by the batch's max, exp <= 1
    means = sums / valid.sum(dim=1)[rows]
    local = torch.tensor(
        [
            float(((judged < lo) | (judged > hi)).sum()),
            float(judged.numel()),
            float(shifted.sum()),
            float((shifted**2).sum()),
            float(means.sum()),
            float(means.numel()),
            float((rho - 1 - r).sum()),
            float(((rho - 1) ** 2).sum()),
        ],
        dtype=torch.float64,
    )
    sample = _sample(rho, shares[rank], seed=rank).cpu()
    width = max(shares)
    row = torch.cat([local, torch.nn.functional.pad(sample, (0, width - sample.numel()), value=math.nan)])
    table = row.view(1, -1) if processes == 1 or gather is None else gather(row.to(log_ratio.device)).cpu()
    table = table.view(-1, len(local) + width)
    out, judged_n, w, w2, mean_sum, seqs, k3, chi2 = table[:, : len(local)].sum(dim=0).tolist()
    pooled = table[:, len(local) :].reshape(-1)
    pooled = pooled[~torch.isnan(pooled)]
    quantiles = torch.quantile(pooled, torch.tensor([0.01, 0.99], dtype=pooled.dtype)).tolist()
    return {
        PREFIX + "corrected_share": out / judged_n,
        PREFIX + "ess": w**2 / (seqs * w2),
        PREFIX + "ratio_q01": float(quantiles[0]),
        PREFIX + "ratio_q99": float(quantiles[1]),
        PREFIX + "log_ppl_diff": -mean_sum / seqs,
        PREFIX + "kl": k3 / total,
        PREFIX + "chi2": chi2 / total,
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
