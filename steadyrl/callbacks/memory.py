"""PeakMemory: peak memory per rank, written to ``<output_dir>/peak_memory_rank{N}.json``.

A file, not a metric: a metric added in ``on_log`` would miss ``log_history`` and most reporters. Records the peak
resident set size (Linux ``ru_maxrss``), and with CUDA the peak allocated / reserved accelerator memory.
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback


class PeakMemory(TrainerCallback):
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rank = int(os.environ.get("RANK", "0"))
        figures: dict[str, Any] = {
            "rank": rank,
            "global_step": state.global_step,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
        }
        if torch.cuda.is_available():
            figures["device"] = torch.cuda.get_device_name()
            figures["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            figures["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / f"peak_memory_rank{rank}.json").write_text(json.dumps(figures, indent=2))
        what = f"{figures['peak_allocated_gib']:.2f} GiB allocated" if "peak_allocated_gib" in figures else ""
        print(f"peak memory rank {rank}: {what or 'no accelerator'}, peak RSS {figures['peak_rss_gib']:.2f} GiB")
