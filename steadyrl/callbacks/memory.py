"""PeakMemory: peak accelerator memory per rank, written to ``<output_dir>/peak_memory_rank{N}.json``.

It writes a file rather than adding a metric to the logs: the Trainer appends a copy of each log dict to
``log_history`` before callbacks see it, so a metric added in ``on_log`` would miss the history and most
reporters. On a machine without CUDA it records nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback


class PeakMemory(TrainerCallback):
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not torch.cuda.is_available():
            return
        rank = int(os.environ.get("RANK", "0"))
        figures = {
            "rank": rank,
            "device": torch.cuda.get_device_name(),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "global_step": state.global_step,
        }
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / f"peak_memory_rank{rank}.json").write_text(json.dumps(figures, indent=2))
        print(f"peak memory rank {rank}: {figures['peak_allocated_gib']:.2f} GiB allocated", flush=True)
