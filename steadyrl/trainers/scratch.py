"""The values one TRL hook hands to a later one inside one TRL call (e.g. ``_calculate_rewards`` to its caller
``_generate_and_score_completions``): who writes each, who reads it, who clears it (the outer hook, also when TRL
raises, so a value never leaks into a later call).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class HookScratch:
    scores: tuple[torch.Tensor, list[Any]] | None = None
    """(gathered reward matrix (N, num_funcs), gathered prompts (N,)). Written by ``_calculate_rewards`` when
    steadyrl rewrites advantages; read and cleared by ``_generate_and_score_completions`` (its caller)."""

    completion_lengths: torch.Tensor | None = None
    """(rows,) this rank's unpadded completion lengths. Written by ``_calculate_rewards`` when QUATRO's filters are
    on; read and cleared by ``_generate_and_score_completions``."""

    loss_inputs: dict[str, Any] | None = None
    """The micro-batch of the loss being computed. Written by ``_compute_loss`` before it calls TRL's loss; read and
    cleared by the first ``_get_per_token_logps_and_entropies`` inside it (the policy forward of that loss, whose
    ratios it checks); cleared again by ``_compute_loss`` when TRL's loss returns or raises."""

    loss_logps: torch.Tensor | None = None
    """The detached policy log-probs of that forward. Written by ``_get_per_token_logps_and_entropies``; read and
    cleared by ``_compute_loss`` (QUATRO's replay ratio metric)."""

    staging_dir: Path | None = None
    """The staging root of a checkpoint being written. Written by ``_save_checkpoint`` around TRL's save; read by
    ``_get_output_dir`` (so every file TRL writes lands in staging); cleared by ``_save_checkpoint``."""

    save_error: BaseException | None = None
    """A model write that failed inside a checkpoint under DeepSpeed. Written by ``save_model``; read and cleared by
    ``_save_optimizer_and_scheduler``, which has every rank agree on it before DeepSpeed's own save collectives."""

    vetoed_step: bool = False
    """The step gate vetoed the optimizer step being taken. Written by ``_clip_grad_norm``; read and cleared by
    ``_GuardClock.on_optimizer_step``, which marks the step skipped again (a GradScaler's step rewrites the flag)."""
