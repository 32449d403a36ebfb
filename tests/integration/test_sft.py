"""SFT warm start through the config: loss on the completion only, trains, saves, evaluates."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from steadyrl.config import load_config
from steadyrl.trainers.build import run

pytestmark = pytest.mark.slow


def test_sft_masks_prompt_tokens_and_trains(tiny_model_dir, tmp_path):
    cfg_path = tmp_path / "sft.yaml"
    cfg_path.write_text(
        yaml.safe_dump(
            {
                "algorithm": "sft",
                "model": {"path": str(tiny_model_dir)},
                "data": {
                    "path": "builtin:arithmetic",
                    "eval_split": "eval",
                    "builtin": {"max_operand": 20, "eval_size": 16, "zero_pad_fraction": 0.5},
                },
                "rewards": [{"fn": "exact_match"}, {"fn": "numeric_match"}],
                "eval": {"max_new_tokens": 4},
                "trainer": {
                    "output_dir": str(tmp_path / "run"),
                    "max_steps": 3,
                    "per_device_train_batch_size": 8,
                    "learning_rate": 1e-3,
                    "bf16": False,
                    "report_to": [],
                    "save_strategy": "no",
                    "disable_tqdm": True,
                    "activation_checkpointing": False,
                },
            }
        )
    )
    cfg = load_config(cfg_path)
    from steadyrl.trainers.build import build_trainer

    trainer = build_trainer(cfg)
    batch = next(iter(trainer.get_train_dataloader()))
    tok = trainer.processing_class
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"], strict=True):
        text = tok.decode(ids[mask.bool()])
        prompt = text.partition("=")[0]
        n_prompt = len(prompt) + 1  # byte tokenizer: one token per character, "=" included
        real = labels[mask.bool()]
        assert torch.all(real[:n_prompt] == -100), text  # prompt tokens carry no loss (docs/DESIGN.md "SFT")
        assert real[n_prompt:].tolist() == ids[mask.bool()][n_prompt:].tolist()  # answer + EOS do
        assert real[-1].item() == tok.eos_token_id

    result = run(cfg)
    assert result is not None and result["metric"] == "exact_match"
    assert set(result["rewards"]) == {"exact_match", "numeric_match"}
    assert result["rewards"]["numeric_match"] >= result["rewards"]["exact_match"]
    saved = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    assert saved["accuracy"] == result["accuracy"]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
