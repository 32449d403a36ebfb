"""GRADE reward scaler: rolling whitening, quantile tail clipping, per-prompt counterfactual centring
(docs/DESIGN.md, "GRADE: reward scaler").

``GradeScaler``: raw rewards of a whole generation batch (N,) -> scaled rewards (N,), before any advantage. In order:

a) whitening, ``(r - mean) / (std + EPS)`` over the last ``window_size`` raw finite rewards *before* this batch;
   until the window holds ``warmup`` values rewards pass through unchanged (``whiten=False``: no whitening, no warmup);
b) quantile tail clip: bounds are the ``tau`` / ``1 - tau`` quantiles of the last ``quantile_window`` raw rewards
   (raw units, refreshed every ``quantile_every`` steps, from ``clip_start`` rewards on), whitened with this batch's
   statistics; beyond a bound ``x <- bound + tail_slope * (x - bound)``;
c) centring, ``r <- r - centring_beta * baseline(prompt)``, the running mean of the prompt's earlier scaled rewards
   in an LRU of ``MAX_PROMPTS`` prompts; a first-seen prompt is not shifted; ``centring_beta: 0`` turns it off.

NaN/±inf rewards are unscorable: they enter no window or baseline and come out NaN. Statistics are float64; the
output has the input's dtype.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any

import torch

from steadyrl.guards.base import check_version
from steadyrl.metrics import (
    GRADE_CLIP_FRAC_HIGH,
    GRADE_CLIP_FRAC_LOW,
    GRADE_RAW_MEAN,
    GRADE_RAW_STD,
    GRADE_SCALED_MEAN,
    GRADE_SCALED_STD,
    GRADE_WINDOW,
)
from steadyrl.ranges import Checked, bounded

EPS = 1e-6  # whitening: (r - mean) / (std + EPS)
MAX_PROMPTS = 500  # prompts whose centring baseline is kept (least recently seen dropped first)


@dataclass
class GradeConfig(Checked):
    window_size: int = bounded(2048, ge=2)
    warmup: int = bounded(200, ge=2)  # <= window_size
    clip_start: int = 500  # clip: in [0, window_size]
    tau: float = bounded(0.03, gt=0, lt=0.5)
    quantile_window: int = bounded(2000, ge=1)
    quantile_every: int = bounded(50, ge=1)
    tail_slope: float = bounded(0.1, ge=0, le=1)
    centring_beta: float = bounded(0.7, ge=0, le=1)  # 0: no centring
    whiten: bool = True
    clip: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = []
        if self.warmup > self.window_size:
            problems.append(f"warmup must be <= window_size={self.window_size}, got {self.warmup}")
        if self.clip and not 0 <= self.clip_start <= self.window_size:
            problems.append(f"clip_start must be in [0, window_size={self.window_size}], got {self.clip_start}")
        if problems:
            raise ValueError("invalid GradeConfig: " + "; ".join(problems))


def soft_tail_clip(values: torch.Tensor, low: float, high: float, slope: float) -> torch.Tensor:
    """Quantile tail clip (stage b): beyond a bound, x -> bound + slope * (x - bound). values: (N,) -> (N,).

    NaN stays NaN. slope = 0 is a hard clamp, slope = 1 the identity.
    """
    out = torch.where(values < low, low + slope * (values - low), values)
    return torch.where(values > high, high + slope * (values - high), out)


def prompt_key(prompt: Any) -> str:
    """Stable string key of a prompt (a string or a list of message dicts): its JSON with sorted keys."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)


class GradeScaler:
    """GRADE ``RewardProcessor``: ``scaler(rewards (N,), prompts (N,), num_generations) -> (N,)``; ``step()`` once
    per optimizer step. ``metrics()`` and ``kl_compensation()`` describe the last call."""

    def __init__(self, config: GradeConfig | None = None) -> None:
        self.config = config or GradeConfig()
        self._raw: deque[float] = deque(maxlen=self.config.window_size)
        self._quantile: deque[float] = deque(maxlen=self.config.quantile_window)  # raw finite rewards
        self._bounds: tuple[float, float] | None = None  # raw units
        self._steps = 0
        self._steps_since_refresh = 0
        self._baselines: OrderedDict[str, list[float]] = OrderedDict()  # key -> [sum, count]
        self._last: dict[str, float] = {}
        self._last_whitened = False

    def __call__(self, rewards: torch.Tensor, prompts: list[Any], num_generations: int) -> torch.Tensor:
        """rewards: (N,), NaN = unscorable; prompts: N entries, one per row -> scaled rewards (N,), NaN kept."""
        cfg = self.config
        if rewards.ndim != 1:
            raise ValueError(f"rewards must have shape (N,), got {tuple(rewards.shape)}")
        if len(prompts) != rewards.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts for {rewards.shape[0]} rewards; need one per row")
        if num_generations < 1 or rewards.shape[0] % num_generations:
            raise ValueError(f"num_generations={num_generations} does not divide the batch of {rewards.shape[0]}")
        out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
        raw = rewards.detach().to(device="cpu", dtype=torch.float64)
        finite = torch.isfinite(raw)
        raw = torch.where(finite, raw, torch.full_like(raw, float("nan")))
        raw_finite = raw[finite].tolist()

        # a) whitening with the window as it was before this batch; before warmup nothing else happens either
        x = raw
        stats: tuple[float, float] | None = None  # (mean, std) of this batch's whitening
        active = not cfg.whiten or len(self._raw) >= cfg.warmup  # no whitening: on the final scale from the start
        if cfg.whiten and active:
            window = torch.tensor(list(self._raw), dtype=torch.float64)
            stats = window.mean().item(), window.std().item()
            x = (raw - stats[0]) / (stats[1] + EPS)

        # b) quantile tail clipping: raw bounds from the quantile window before this batch, whitened as x was
        clipped_low = clipped_high = 0
        if cfg.clip and active and len(self._raw) >= cfg.clip_start:
            bounds = self._current_bounds()
            if bounds is not None:
                low, high = bounds
                if stats is not None:
                    low, high = ((torch.tensor(bounds, dtype=torch.float64) - stats[0]) / (stats[1] + EPS)).tolist()
                clipped_low = int((x < low).sum().item())
                clipped_high = int((x > high).sum().item())
                x = soft_tail_clip(x, low, high, cfg.tail_slope)

        # c) counterfactual centring against earlier batches' baselines, then update them
        scaled = x
        if cfg.centring_beta > 0 and active:
            keys = [prompt_key(p) for p in prompts]
            shift = torch.zeros_like(x)
            for i, key in enumerate(keys):
                entry = self._baselines.get(key)
                if entry is not None:
                    shift[i] = entry[0] / entry[1]
            x = x - cfg.centring_beta * shift
            for key, value in zip(keys, scaled.tolist(), strict=True):
                entry = self._baselines.get(key)
                if entry is not None:
                    self._baselines.move_to_end(key)
                if math.isnan(value):
                    continue
                if entry is None:
                    entry = self._baselines[key] = [0.0, 0]
                entry[0] += value
                entry[1] += 1
            while len(self._baselines) > MAX_PROMPTS:
                self._baselines.popitem(last=False)

        # windows take the batch only now (no leakage into its own statistics)
        self._raw.extend(raw_finite)
        self._quantile.extend(raw_finite)
        n = int(finite.sum().item())
        raw_f, out_f = raw[finite], x[finite]
        self._last = {
            GRADE_RAW_MEAN: raw_f.mean().item() if n else float("nan"),
            GRADE_RAW_STD: raw_f.std().item() if n > 1 else float("nan"),
            GRADE_SCALED_MEAN: out_f.mean().item() if n else float("nan"),
            GRADE_SCALED_STD: out_f.std().item() if n > 1 else float("nan"),
            GRADE_CLIP_FRAC_LOW: clipped_low / n if n else 0.0,
            GRADE_CLIP_FRAC_HIGH: clipped_high / n if n else 0.0,
            GRADE_WINDOW: float(len(self._raw)),
        }
        self._last_whitened = active and cfg.whiten
        return x.to(out_dtype).to(rewards.device)

    def step(self) -> None:
        """Advance the optimizer-step counter (quantile refresh)."""
        self._steps += 1
        self._steps_since_refresh += 1

    def _current_bounds(self) -> tuple[float, float] | None:
        if self._bounds is None or self._steps_since_refresh >= self.config.quantile_every:
            if not self._quantile:
                return self._bounds
            window = torch.tensor(list(self._quantile), dtype=torch.float64)
            q = torch.tensor([self.config.tau, 1.0 - self.config.tau], dtype=torch.float64)
            self._bounds = tuple(torch.quantile(window, q, interpolation="linear").tolist())
            self._steps_since_refresh = 0
        return self._bounds

    def metrics(self) -> dict[str, float]:
        """Figures of the last call (empty before the first call)."""
        return dict(self._last)

    def kl_compensation(self, lo: float = 0.5, hi: float = 2.0) -> float:
        """raw_std / scaled_std of the last call clamped to [lo, hi]; 1.0 when that call did not whiten (before
        warmup, or ``whiten=False``) or the ratio is undefined."""
        if not self._last_whitened:
            return 1.0
        ratio = self._last[GRADE_RAW_STD] / self._last[GRADE_SCALED_STD] if self._last[GRADE_SCALED_STD] else 1.0
        if not math.isfinite(ratio):
            return 1.0
        return min(max(ratio, lo), hi)

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 2,
            "config": asdict(self.config),
            "raw_window": list(self._raw),
            "quantile_window": list(self._quantile),
            "bounds": list(self._bounds) if self._bounds is not None else None,
            "steps": self._steps,
            "steps_since_refresh": self._steps_since_refresh,
            "baselines": [[key, total, count] for key, (total, count) in self._baselines.items()],
            "last_metrics": dict(self._last),
            "last_whitened": self._last_whitened,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version(state, 2, "the GRADE reward scaler")
        self._raw = deque((float(v) for v in state["raw_window"]), maxlen=self.config.window_size)
        self._quantile = deque((float(v) for v in state["quantile_window"]), maxlen=self.config.quantile_window)
        bounds = state["bounds"]
        self._bounds = (float(bounds[0]), float(bounds[1])) if bounds is not None else None
        self._steps = int(state["steps"])
        self._steps_since_refresh = int(state["steps_since_refresh"])
        self._baselines = OrderedDict((str(k), [float(t), int(c)]) for k, t, c in state["baselines"])
        while len(self._baselines) > MAX_PROMPTS:
            self._baselines.popitem(last=False)
        self._last = {str(k): float(v) for k, v in state["last_metrics"].items()}
        self._last_whitened = bool(state["last_whitened"])
