"""Rollout replay (QUATRO, ``guards.quatro.replay``): keep the rows with a learning signal of the last ``capacity`` (8)
scored micro-batches and replace ``replay_ratio`` (0.3) of each fresh micro-batch with rows drawn from them, padded
to a common width (docs/DESIGN.md, "QUATRO: rollout replay").

The buffer is per rank (seed it with ``seed + rank``, save it per rank). Replayed rows keep their sampling log-probs,
so TRL's loss ratio-corrects them; text batches only (``REPLAY_ROW_KEYS``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from steadyrl.metrics import QUATRO_REPLAY_AGE_MEAN, QUATRO_REPLAY_FRAC
from steadyrl.ranges import Checked, bounded

MIN_ABS_ADVANTAGE = 1e-6  # rows with a smaller |advantage| carry no learning signal and are not stored


# Per-row keys a replayed batch may hold, with (side, pad value); None = the tokenizer's pad id. "prompt" keys are
# left-padded; "completion" keys right-padded when token-aligned (2-D with the completion width, so a (B, 1) ratio
# in a batch of 1-token completions counts as aligned), other shapes are per row.
REPLAY_ROW_KEYS: dict[str, tuple[str, float | None]] = {
    "prompt_ids": ("prompt", None),
    "prompt_mask": ("prompt", 0),
    "completion_ids": ("completion", None),
    "completion_mask": ("completion", 0),
    "advantages": ("completion", 0.0),
    "old_per_token_logps": ("completion", 0.0),
    "ref_per_token_logps": ("completion", 0.0),
    "sampling_per_token_logps": ("completion", 0.0),
    "importance_sampling_ratio": ("completion", 1.0),
    "tool_mask": ("completion", 1),
    "old_values": ("completion", 0.0),  # PPO: the critic's values at sampling time (B, T)
    "returns": ("completion", 0.0),  # PPO: GAE returns (B, T)
    "value_weight": ("completion", 1.0),  # PPO: (B,) per row, 0 = the row trains no value (unscorable, filtered)
}
REPLAY_REQUIRED_KEYS = tuple(REPLAY_ROW_KEYS)[:6]  # ids, masks, advantages, old_per_token_logps
REPLAY_PASS_THROUGH_KEYS = ("num_items_in_batch",)  # batch-level values, taken from the fresh batch unchanged
LOGPROB_KEYS = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")  # finite on stored rows


@dataclass
class ReplayConfig(Checked):
    enabled: bool = True
    capacity: int = bounded(8, ge=1)  # micro-batches remembered, FIFO (docs/DESIGN.md "QUATRO: rollout replay")
    replay_ratio: float = bounded(0.3, ge=0, lt=1)  # share of each micro-batch replaced by replayed rows

    def rows_per_batch(self, batch_size: int) -> int:
        """Rows replayed in a micro-batch of ``batch_size`` once the buffer is warm: round_half_up(ratio x B)."""
        return math.floor(self.replay_ratio * batch_size + 0.5)


@dataclass
class ReplayInfo:
    replay_frac: float  # replayed rows / batch rows
    replay_age_mean: float  # mean of (step - the step a replayed row was sampled at); 0.0 when nothing replayed
    indices: list[int]  # rows of the returned batch that were replayed, ascending
    ages: list[int]  # age of each of those rows, same order

    def metrics(self) -> dict[str, float]:
        return {QUATRO_REPLAY_FRAC: self.replay_frac, QUATRO_REPLAY_AGE_MEAN: self.replay_age_mean}


def _row_signal(batch: dict[str, Any], i: int) -> float:
    """|advantage| of row i: the scalar, or for per-token advantages (PPO's GAE, (B, T)) the mean |advantage| over
    its loss tokens (completion mask, times the tool mask when there is one); 0.0 without loss tokens."""
    adv = batch["advantages"][i]
    if adv.ndim == 0:
        return abs(float(adv))
    mask = batch["completion_mask"][i].to(adv.dtype)
    if batch.get("tool_mask") is not None:
        mask = mask * batch["tool_mask"][i].to(adv.dtype)
    tokens = float(mask.sum())
    return float((adv.abs() * mask).sum()) / tokens if tokens > 0 else 0.0


class ReplayBuffer:
    """Rollout replay: ``add(micro_batch, step)`` after scoring, ``mix(micro_batch, step)`` before training.

    Stored: the rows of a scored micro-batch with |advantage| > ``MIN_ABS_ADVANTAGE``, at least one unmasked
    completion token and finite ``LOGPROB_KEYS`` on those tokens; each row's ``REPLAY_ROW_KEYS`` tensors trimmed to
    its own length, on the CPU, with the step it was sampled at. FIFO by micro-batch: the last ``capacity`` calls of
    ``add``, a call with no stored row included.

    ``mix`` replaces k = round_half_up(``replay_ratio`` x B) rows (at most the rows stored) of the fresh micro-batch,
    the k with the smallest |advantage| (ties: lower index first), with rows drawn uniformly without replacement by a
    seeded ``torch.Generator``, in draw order. Prompt tensors are left-padded and completion tensors right-padded to
    a common width as TRL pads them (``REPLAY_ROW_KEYS``). Call ``mix`` before ``add``-ing the same fresh batch.
    """

    def __init__(self, config: ReplayConfig | None = None, seed: int = 0, pad_token_id: int = 0) -> None:
        self.config = config or ReplayConfig()
        self.seed = seed
        self.pad_token_id = pad_token_id
        self._entries: deque[tuple[int, list[dict[str, torch.Tensor]]]] = deque(maxlen=self.config.capacity)
        self._generator = torch.Generator().manual_seed(seed)
        self.added_rows = 0
        self.replayed_rows = 0

    def clear(self) -> None:
        """Forget every stored row (the policy that sampled them was rolled back); the draw generator runs on."""
        self._entries.clear()

    def __len__(self) -> int:
        """Rows stored."""
        return sum(len(rows) for _, rows in self._entries)

    def _check_keys(self, batch: dict[str, Any]) -> list[str]:
        """The per-row keys of ``batch`` (in REPLAY_ROW_KEYS order); raises on a missing or unknown key."""
        missing = [k for k in REPLAY_REQUIRED_KEYS if batch.get(k) is None]
        if missing:
            hint = (
                " (the sampling policy's log-probs: the trainer must compute them for every batch when replay is on, "
                "TRL skips them when it thinks the data is on-policy)"
                if "old_per_token_logps" in missing
                else ""
            )
            raise ValueError(f"replay needs the batch keys {missing}{hint}")
        unknown = [k for k in batch if k not in REPLAY_ROW_KEYS and k not in REPLAY_PASS_THROUGH_KEYS]
        if unknown:
            raise ValueError(
                f"replay does not know how to pad the batch keys {unknown} (it supports text batches with "
                f"{sorted(REPLAY_ROW_KEYS)}); set guards.quatro.replay.enabled=false"
            )
        return [k for k in REPLAY_ROW_KEYS if k in batch and batch[k] is not None]

    @staticmethod
    def _token_aligned(batch: dict[str, Any], key: str) -> bool:
        side = REPLAY_ROW_KEYS[key][0]
        width = batch["prompt_ids" if side == "prompt" else "completion_ids"].shape[1]
        value = batch[key]
        return side == "prompt" or (value.ndim == 2 and value.shape[1] == width)

    def add(self, batch: dict[str, Any], step: int) -> int:
        """Store the signal rows of one scored micro-batch sampled at optimizer step ``step``; returns how many."""
        if not self.config.enabled:
            return 0
        keys = self._check_keys(batch)
        rows: list[dict[str, torch.Tensor]] = []
        prompt_mask, completion_mask = batch["prompt_mask"], batch["completion_mask"]
        aligned = {k: self._token_aligned(batch, k) for k in keys}
        for i in range(batch["completion_ids"].shape[0]):
            tokens = torch.nonzero(completion_mask[i]).flatten()
            if tokens.numel() == 0 or not _row_signal(batch, i) > MIN_ABS_ADVANTAGE:
                continue
            end = int(tokens[-1]) + 1
            live = completion_mask[i, :end].bool()
            if not all(bool(torch.isfinite(batch[k][i, :end][live]).all()) for k in LOGPROB_KEYS if k in keys):
                continue
            prompt_tokens = torch.nonzero(prompt_mask[i]).flatten()
            start = int(prompt_tokens[0]) if prompt_tokens.numel() else prompt_mask.shape[1]
            row = {}
            for k in keys:
                value = batch[k][i].detach()
                if aligned[k]:
                    value = value[start:] if REPLAY_ROW_KEYS[k][0] == "prompt" else value[:end]
                row[k] = value.to("cpu", copy=True)
            rows.append(row)
        self._entries.append((int(step), rows))
        self.added_rows += len(rows)
        return len(rows)

    def mix(self, batch: dict[str, Any], step: int) -> tuple[dict[str, Any], ReplayInfo]:
        """A new batch with k fresh rows replaced by replayed ones (see the class docstring); ``batch`` is unchanged."""
        if not self.config.enabled:
            return dict(batch), ReplayInfo(0.0, 0.0, [], [])
        keys = self._check_keys(batch)
        size = batch["completion_ids"].shape[0]
        stored = [(row_step, row) for row_step, rows in self._entries for row in rows]
        k = min(self.config.rows_per_batch(size), len(stored))
        if k == 0:
            return dict(batch), ReplayInfo(0.0, 0.0, [], [])
        drawn = [stored[j] for j in torch.randperm(len(stored), generator=self._generator)[:k].tolist()]
        for _, row in drawn:
            if set(row) != set(keys):
                raise ValueError(
                    f"a stored row has the keys {sorted(row)} but the fresh batch has {sorted(keys)}; replay needs "
                    "the same keys in every batch"
                )
        signal = [_row_signal(batch, i) for i in range(size)]
        positions = sorted(sorted(range(size), key=lambda i: signal[i])[:k])

        out = dict(batch)
        for key in keys:
            fresh = batch[key]
            side, pad_value = REPLAY_ROW_KEYS[key]
            pad = self.pad_token_id if pad_value is None else pad_value
            aligned = self._token_aligned(batch, key)
            rows = [row[key].to(device=fresh.device, dtype=fresh.dtype) for _, row in drawn]
            if aligned:
                width = max([fresh.shape[1], *(r.shape[0] for r in rows)])
                fresh = _pad_to(fresh, width, side, pad)
                rows = [_pad_to(r.unsqueeze(0), width, side, pad)[0] for r in rows]
            if any(r.shape != fresh.shape[1:] for r in rows):
                raise ValueError(
                    f"replay: stored rows of {key!r} have shapes {sorted({tuple(r.shape) for r in rows})}, the fresh "
                    f"batch's rows {tuple(fresh.shape[1:])}"
                )
            merged = fresh.clone()
            merged[positions] = torch.stack(rows)
            out[key] = merged
        ages = [int(step) - row_step for row_step, _ in drawn]
        self.replayed_rows += k
        return out, ReplayInfo(k / size, sum(ages) / k, positions, ages)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "entries": [
                {"step": s, "rows": [{k: v.cpu() for k, v in row.items()} for row in rows]} for s, rows in self._entries
            ],
            "generator": self._generator.get_state(),
            "seed": self.seed,
            "added_rows": self.added_rows,
            "replayed_rows": self.replayed_rows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._entries = deque(
            (
                (int(e["step"]), [{k: v.to("cpu", copy=True) for k, v in row.items()} for row in e["rows"]])
                for e in state["entries"]
            ),
            maxlen=self.config.capacity,
        )
        self._generator = torch.Generator()
        self._generator.set_state(state["generator"].cpu())  # a checkpoint may be loaded with map_location=cuda
        self.seed = int(state["seed"])
        self.added_rows = int(state["added_rows"])
        self.replayed_rows = int(state["replayed_rows"])


def _pad_to(t: torch.Tensor, width: int, side: str, value: float) -> torch.Tensor:
    """Pad dim 1 of (B, W, ...) to ``width`` on the left ("prompt") or right ("completion")."""
    extra = width - t.shape[1]
    if extra <= 0:
        return t
    filler = torch.full((t.shape[0], extra, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([filler, t] if side == "prompt" else [t, filler], dim=1)


def replay_importance_ratio_sum(
    per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of exp(current - stored log-probs) over the unmasked tokens of the ``rows`` (B,) bool selection, and
    their count. per_token_logps, old_per_token_logps, mask: (B, T) -> two float64 scalars (summable over ranks)."""
    selected = mask.to(torch.bool) & rows.to(device=mask.device, dtype=torch.bool).unsqueeze(1)
    ratio = torch.exp(per_token_logps.detach().double() - old_per_token_logps.detach().double())
    return ratio[selected].sum(), selected.sum().double()
