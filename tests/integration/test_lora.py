"""LoRA through the config's peft section: only adapter weights change, the reference is the base model."""

from __future__ import annotations

import pytest
import torch
import yaml

from steadyrl.config import load_config
from steadyrl.trainers.build import build_trainer

pytestmark = pytest.mark.slow


def test_lora_trains_only_the_adapter(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        _write_config(tmp_path, tiny_model_dir),
        ["peft.r=4", "peft.lora_alpha=8", "peft.lora_dropout=0.0", "trainer.beta=0.04"],
    )
    trainer = build_trainer(cfg)
    model = trainer.model
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert trainer.ref_model is None  # reference log-probs come from the base model, adapter disabled

    # Reference = base model: with the adapter disabled the wrapped model returns the base model's logits.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.tensor([[ord(c) + 3 for c in "12+3="]])
    trainer.train()
    with model.disable_adapter():
        assert torch.allclose(model(ids).logits, base(ids).logits, atol=1e-6)
    assert not torch.allclose(model(ids).logits, base(ids).logits, atol=1e-6), "the adapter must have learned"

    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed), sorted(changed)[:5]

    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_config.json").is_file()
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "final" / "model.safetensors").exists()


def _write_config(tmp_path, model_dir):
    cfg = {
        "model": {"path": str(model_dir)},
        "data": {"path": "builtin:arithmetic", "builtin": {"max_operand": 9, "eval_size": 10}},
        "rewards": [{"fn": "tests.integration.helpers:byte_mean"}],
        "trainer": {
            "output_dir": str(tmp_path / "run"),
            "max_steps": 3,
            "per_device_train_batch_size": 8,
            "num_generations": 4,
            "max_completion_length": 4,
            "learning_rate": 0.01,
            "bf16": False,
            "report_to": [],
            "save_strategy": "no",
            "disable_tqdm": True,
        },
    }
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path
