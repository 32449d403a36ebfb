"""The storage plan (steadyrl/storage.py) of every ``configs/models/*.yaml`` at its documented launch (the first line:
``--num_processes N``, ZeRO-2): checkpoint, kept checkpoints, OPEFO snapshots, ``best-gold/``, steady and peak bytes.

The run itself reads the model's ``config.json``; here, with no download, the architectures are the Qwen2.5 model
cards' published ``config.json`` values typed in ``ARCHITECTURES`` (built on the meta device: no weights). PPO rows
count the policy only: the critic (``ppo.critic_model``, the policy's size by default) adds its own weights and
optimizer state to each checkpoint.

    python scripts/storage_plans.py --results docs/results/storage_plans.json
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import experiments as X  # noqa: E402

# Qwen2.5 *-Instruct config.json (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings), bf16
ARCHITECTURES = {
    "Qwen/Qwen2.5-0.5B-Instruct": (896, 24, 14, 2, 4864, 151936, True),
    "Qwen/Qwen2.5-1.5B-Instruct": (1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-7B-Instruct": (3584, 28, 28, 4, 18944, 152064, False),
    "Qwen/Qwen2.5-14B-Instruct": (5120, 48, 40, 8, 13824, 152064, False),
}
HF_DEFAULTS = {"save_strategy": "steps", "save_steps": 500, "save_total_limit": None, "max_steps": -1}


def model_size(path: str, lora: dict | None):  # -> storage.ModelSize
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from steadyrl.storage import ModelSize

    hidden, layers, heads, kv, inter, vocab, tied = ARCHITECTURES[path]
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab,
                         tie_word_embeddings=tied)  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    if lora is None:
        return ModelSize(total, total, 2, False)
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        peft_model = get_peft_model(model, LoraConfig(**lora, task_type="CAUSAL_LM"))
    return ModelSize(total, sum(p.numel() for p in peft_model.parameters() if p.requires_grad), 2, True)


def plan_of(path: Path) -> dict:
    from steadyrl import storage
    from steadyrl.config import RunConfig
    from steadyrl.config.loader import load_config_tree

    launch = path.read_text().splitlines()[0]
    ranks = int(re.search(r"--num_processes (\d+)", launch).group(1))
    zero = "zero2" in launch
    cfg = RunConfig.from_tree(*load_config_tree(path))  # parsed and validated; its GPU checks need the GPU machine
    t = {**HF_DEFAULTS, **cfg.trainer}
    lora = None if cfg.peft is None else {k: v for k, v in vars(cfg.peft).items() if not k.startswith("_")}
    size = model_size(cfg.model.path, lora)
    args = SimpleNamespace(**{k: t[k] for k in HF_DEFAULTS}, output_dir="/nonexistent", model_init_kwargs=None)
    saves = args.max_steps // args.save_steps if args.save_strategy == "steps" and args.max_steps > 0 else 0
    g, q = cfg.guards, cfg.guards.quatro
    eval_on = cfg.eval.enabled and cfg.eval.every > 0
    planned = storage.plan(
        size, ranks, zero, args.save_total_limit, saves,
        g.opefo.enabled and g.opefo.error_feedback.enabled,
        g.opefo.enabled and g.opefo.rollback.enabled and g.opefo.rollback.storage == "disk",
        q.enabled and q.gold.enabled and q.gold.save_best and eval_on, args.output_dir,
    )  # fmt: skip
    return {
        "config": str(path.relative_to(REPO)), "model": cfg.model.path, "algorithm": cfg.algorithm, "ranks": ranks,
        "zero": zero, "parameters": size.parameters, "trainable": size.trainable, "lora": size.lora,
        "checkpoint_bytes": planned.checkpoint, "checkpoints_kept": planned.checkpoints_kept,
        "snapshot_bytes": planned.snapshots, "best_gold_bytes": planned.best_gold, "steady_bytes": planned.steady,
        "peak_bytes": planned.peak, "plan": str(planned).split("; free")[0],
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=None)
    args = ap.parse_args()
    from steadyrl.storage import human

    rows = [plan_of(p) for p in sorted((REPO / "configs" / "models").glob("*.yaml"))]
    for r in rows:
        print(f"{r['config']}: {r['ranks']} ranks, {r['trainable'] / 1e9:.2f}B trainable; {r['plan']}; "
              f"steady {human(r['steady_bytes'])}")  # fmt: skip
    if args.results:
        cells = [X.cell(Path(r["config"]).stem, "all", [0], [{**r, "accuracy": None}], list(r)) for r in rows]
        doc = X.results_doc("storage_plans", cells, command=X.script_command("storage_plans.py"), sha=X.commit(),
                            model="qwen2.5 (configs/models)", steps=None, packages=False)  # fmt: skip
        X.write_results(args.results, doc)


if __name__ == "__main__":
    main()
