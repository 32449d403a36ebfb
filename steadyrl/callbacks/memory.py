"""PeakMemory: logs peak accelerator memory (``memory/peak_gib``) at each log step; a no-op on CPU."""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback


class PeakMemory(TrainerCallback):
    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs is not None and torch.cuda.is_available():
            logs["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
