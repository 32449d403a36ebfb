"""What ``OUTPUT_DIR/best-gold/`` holds at 135M (issue 57): SmolLM2-135M-Instruct, one process, the gold watch keeping
the policy of the eval before training, with the shipped LoRA adapter and with every weight trainable. Per variant:
the bytes of each file, against one copy of the trainable weights (as ``save_model`` writes them) plus the optimizer
state (``torch.save`` of its ``state_dict``, what a rollback needs), and the bytes the layout before issue 57 wrote
(those files plus every rank's copy of the trainable tensors: here one rank).

    python scripts/bench_best_gold.py --results docs/results/best_gold_size.json

Formula (docs/DESIGN.md, "QUATRO: gold watch"): weights once (P x bytes per weight, the model's dtype) + the
optimizer state once (DDP; Adam: 2 x 4 P bytes) or once over all ranks (ZeRO: each rank its part of the moments and of
the fp32 master copy, 12 P in all); before, every rank added its own copy of the trainable tensors (and under ZeRO its
part of the state): 7B full fine-tuning in bf16 on 8 ZeRO-2 ranks, 14 GB + 84 GB = 98 GB against about 210 GB.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

CONFIG = REPO / "configs" / "small" / "grpo-lora.yaml"
VARIANTS = {"lora": [], "full": ["peft=null", "trainer.learning_rate=1.0e-5"]}


def _bytes_of(obj: Any) -> int:
    buffer = io.BytesIO()
    import torch

    torch.save(obj, buffer)
    return buffer.getbuffer().nbytes


def measure(variant: str, out: Path) -> dict[str, Any]:
    """One run with the gold watch (it keeps the policy of the eval before training), one step, then the trained
    policy kept by the watch's writer; the sizes of that copy."""
    from steadyrl.callbacks.gold_watch import GoldWatch
    from steadyrl.config import load_config
    from steadyrl.trainers.best_policy import write_best
    from steadyrl.trainers.build import build_trainer
    from steadyrl.trainers.recovery import optimizer_chain

    overrides = [
        f"trainer.output_dir={out}", "trainer.max_steps=1", 'trainer.save_strategy="no"',
        "trainer.per_device_train_batch_size=4", "trainer.num_generations=4", "trainer.max_completion_length=8",
        "eval.every=1", "eval.on_start=true", "eval.max_samples=4", "eval.max_new_tokens=8",
        *VARIANTS[variant],
    ]  # fmt: skip
    trainer = build_trainer(load_config(CONFIG, overrides))
    trainer.train()
    (watch,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, GoldWatch)]
    assert (watch.best_dir / "gold.json").is_file(), "the watch kept no policy"
    # the watch kept the policy of the eval before training (no optimizer state yet): keep the trained one, by the
    # same writer, to measure a best with its Adam state
    chain = optimizer_chain(trainer.optimizer)
    zero = next((o for o in chain if hasattr(o, "single_partition_of_fp32_groups")), None)
    best = out / "best-gold-after-one-step"
    write_best(trainer, best, chain[-1], zero, {"step": 1, "metric": "eval/accuracy", "gold": 0.0, "reward": 0.0})
    files = {f.name: f.stat().st_size for f in sorted(best.iterdir()) if f.is_file()}
    model = trainer.accelerator.unwrap_model(trainer.model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = sum(p.numel() * p.element_size() for p in trainable)
    optimizer = optimizer_chain(trainer.optimizer)[-1].state_dict()
    state = _bytes_of({"optimizer": optimizer})
    saved_weights = sum(v for k, v in files.items() if k.endswith(".safetensors"))
    before_rank_copy = _bytes_of({n: p.detach() for n, p in model.named_parameters() if p.requires_grad})
    total = sum(files.values())
    return {
        "trainable_parameters": sum(p.numel() for p in trainable),
        "trainable_bytes": weights,
        "weights_file_bytes": saved_weights,
        "optimizer_state_bytes": state,
        "best_gold_bytes": total,
        "files": files,
        "one_copy_plus_state_bytes": weights + state,
        "overhead_over_one_copy_plus_state": total / (weights + state) - 1.0,
        "layout_before_bytes": total + before_rank_copy,
        "before_over_now": (total + before_rank_copy) / total,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    cells = []
    for variant in args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            found = measure(variant, Path(tmp) / variant)
        print(variant, {k: v for k, v in found.items() if k != "files"}, found["files"], flush=True)
        cells.append(X.cell("best-gold-size", variant, [0], [{**found, "accuracy": None}], list(found)))
    if args.results:
        doc = X.results_doc(
            "best_gold_size", cells, command=X.script_command("bench_best_gold.py"), sha=X.commit(),
            model="smollm2-135m-instruct", steps=1, processes=1,
        )  # fmt: skip
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
