"""TRL's own GRPO test suite as a drop-in check: plain TRL, SteadyGRPOTrainer with its guards off, shipped guards.

``SteadyGRPOTrainer`` with no guard arguments claims to be plain ``trl.GRPOTrainer``; with ``guards="all"`` it claims
to train whatever ``trl.GRPOTrainer`` trains. This script holds both claims against TRL's own GRPO tests
(``tests/test_grpo_trainer.py``): it runs that file three times, each in its own pytest process, and compares the
outcomes test by test:

- ``plain``: unchanged;
- ``guards-off``: ``trl.GRPOTrainer`` replaced by ``SteadyGRPOTrainer`` everywhere the test module sees it;
- ``all``: replaced by a ``SteadyGRPOTrainer`` subclass that passes ``guards="all"`` (every guard layer at its
  shipped defaults).

Nothing is fetched: ``--trl-tests`` is a TRL ``tests`` folder already on disk (or a TRL checkout holding one), e.g.::

    mkdir -p /tmp/trl-src && git --git-dir=/path/to/trl.git archive HEAD tests | tar -x -C /tmp/trl-src
    flock /tmp/steadyrl-cpu.lock env OMP_NUM_THREADS=1 python scripts/trl_grpo_suite.py --trl-tests /tmp/trl-src
    python scripts/trl_grpo_suite.py --trl-tests /tmp/trl-src -k "entropy" --modes plain all   # a subset, no results

The tests load tiny hub models and data sets (``trl-internal-testing/tiny-Qwen2ForCausalLM-2.5``,
``trl-internal-testing/zen``, ...). The script builds local stand-ins of the same architectures from random weights
(byte-level tokenizers with the real models' special tokens, chat templates from the installed ``trl`` package),
puts them into temporary Hugging Face caches read with ``HF_HUB_OFFLINE=1``, and points ``datasets.load_dataset`` at
local copies of the data sets. Two caches (``LAYOUTS``): a fast one with ~300-token vocabularies, and one with the
Qwen vocabularies' real size and special-token ids for the tests that script token ids or rely on a 151k vocabulary.
The tests folder is copied into a scratch directory; this file is loaded into each pytest process as a plugin
(``-p trl_grpo_suite``), where it patches what the mode asks before the test module is imported. A test that names a
hub model without a stand-in is skipped as not runnable offline, as are the tests TRL itself skips here (vLLM, GPU,
liger-kernel, jmespath: put a folder holding it on PYTHONPATH to run the tool tests); a test that passes a
``GRPOConfig``/``GRPOTrainer`` argument the installed ``trl`` lacks is skipped as not applicable. Tests that fail on
plain (TRL's main branch tests behaviour newer than the installed release) are listed and left out of the comparison.
One test may run ``--test-timeout`` seconds (default 600).

Prints a table (one row per test, its outcome in each mode) and a summary, writes ``docs/results/trl_grpo_suite.json``
(format: shared/RESULTS.md), and exits 1 when a test that passes on plain fails in another mode and is not listed in
``--expected-failures`` (lines ``MODE TEST_ID REASON``, MODE one of ``guards-off``, ``all``, ``*``; ``#`` comments).
Exit 2: the suite could not be run (no tests found, a pytest process crashed, a bad argument).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import datetime
import hashlib
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results" / "trl_grpo_suite.json"
TEST_FILE = "test_grpo_trainer.py"
MODES = ("plain", "guards-off", "all")
PLUGIN = Path(__file__).stem  # this file, loaded by each pytest process with ``-p``
STANDIN_VERSION = "5"  # bump when the stand-ins change: a reused --workdir rebuilds them

# Environment of a pytest process started by ``run_mode``; the plugin hooks below do nothing without MODE_ENV.
MODE_ENV = "TRL_GRPO_SUITE_MODE"
DATASETS_ENV = "TRL_GRPO_SUITE_DATASETS"  # JSON {hub id: local folder}
MODELS_ENV = "TRL_GRPO_SUITE_MODELS"  # JSON [hub ids with a stand-in model]
CACHES_ENV = "TRL_GRPO_SUITE_CACHES"  # JSON {layout: HF cache folder}, see LAYOUTS
TIMEOUT_ENV = "TRL_GRPO_SUITE_TEST_TIMEOUT"  # seconds one test may run (0: no limit)
NOTES_ENV = "TRL_GRPO_SUITE_NOTES"  # file the plugin appends "shim NAME" / "real-ids TEST_ID" lines to

# Skip reasons the plugin gives; the report groups tests by them.
NOT_APPLICABLE = "[not applicable]"
NO_STANDIN = "[no offline stand-in]"
HUB_ID = re.compile(r"\b(?:trl-internal-testing|HuggingFaceTB|Qwen|meta-llama|google)/[\w.-]+")


# --------------------------------------------------------------------------------------------------------------------
# Stand-ins: tokenizers, models, data sets
# --------------------------------------------------------------------------------------------------------------------

QWEN2_5_SPECIALS = (
    *((t, True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>")),
    *((t, True) for t in ("<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>")),
    *((t, True) for t in ("<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")),
    *((t, False) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>")),
    *((t, False) for t in ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
)
QWEN3_SPECIALS = (
    *QWEN2_5_SPECIALS,
    *((t, False) for t in ("<tool_response>", "</tool_response>", "<think>", "</think>")),
)


# Ids of multi-byte tokens of the Qwen vocabulary that TRL's tests put into scripted completions (tool calls and
# replies); the text is what the tests' comments say those ids decode to. In the real-ids layout they sit at these
# ids, so ``decode`` gives the tests' text; encoding never produces them (no merges: one token per byte).
QWEN_TEXT_TOKENS = {
    **{4913: '{"', 606: "name", 788: '":', 330: ' "', 497: '",', 16370: "arguments", 5212: ' {"', 11248: "}}\n"},
    **{64648: "multiply", 22785: "_tool", 7692: "async", 93054: "_multiply", 35744: "increment", 9520: "step"},
    **{450: "de", 13477: "crement", 927: "sh", 411: "out", 1318: "text", 6023: "hi", 95642: '"}}\n', 314: " {"},
    **{293: " b", 14172: "tool", 6659: "call", 397: ">\n", 522: "</", 17453: "Done", 1513: " don", 944: "'t"},
    **{1414: " know", 894: " any", 5392: " tool", 2765: " won", 16252: " increment"},
}
# Two stand-in caches. "fast": every family's special tokens right after the 256 byte tokens (a ~300-token
# vocabulary: a training test takes seconds, not the half minute of a 151k-token softmax on CPU). "real-ids": the
# Qwen families' special tokens at their real ids (151643 and up, the vocabulary as large as Qwen's) and
# QWEN_TEXT_TOKENS in place; a test gets it when it needs them (``_needs_real_ids``).
LAYOUTS = ("fast", "real-ids")


@dataclass(frozen=True)
class Vocabulary:
    """A byte-level tokenizer family: the 256 byte tokens at ids 0-255 in GPT-2's order (as in Qwen's and Llama 3's
    vocabularies), in the real-ids layout unreachable filler tokens up to ``first_special``, then the family's
    special tokens in order (Qwen's ``<|endoftext|>`` = 151643, ``<|im_end|>`` = 151645 there)."""

    first_special: int
    specials: tuple[tuple[str, bool], ...]  # (token, special); non-special ones survive skip_special_tokens
    eos: str
    pad: str | None = None
    bos: str | None = None
    chat_template: str | None = None  # a file in the installed trl's chat_templates/
    extra_eos: tuple[str, ...] = ()  # more end-of-sequence tokens for generation_config


VOCABULARIES = {
    "qwen2.5": Vocabulary(
        151643, QWEN2_5_SPECIALS, "<|im_end|>", "<|endoftext|>", None, "qwen2_5.jinja", ("<|endoftext|>",)
    ),
    "qwen3": Vocabulary(151643, QWEN3_SPECIALS, "<|im_end|>", "<|endoftext|>", None, "qwen3.jinja", ("<|endoftext|>",)),
    "llama3.2": Vocabulary(
        256,
        tuple((t, True) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>")),
        "<|eot_id|>",
        None,
        "<|begin_of_text|>",
        "llama3_2.jinja",
    ),
    "gemma": Vocabulary(
        256,
        tuple((t, True) for t in ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")),
        "<eos>",
        "<pad>",
        "<bos>",
        "gemma.jinja",
    ),
    "mistral": Vocabulary(256, (("<unk>", True), ("<s>", True), ("</s>", True)), "</s>", None, "<s>"),
    "cohere2": Vocabulary(
        256,
        tuple((t, True) for t in ("<PAD>", "<UNK>", "<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>")),
        "<|END_OF_TURN_TOKEN|>",
        "<PAD>",
        "<BOS_TOKEN>",
        "cohere2.jinja",
    ),
    "glm4moe": Vocabulary(
        256,
        tuple((t, True) for t in ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")),
        "<|endoftext|>",
        "<|endoftext|>",
        None,
        "glm4moe.jinja",
        ("<|user|>",),
    ),
    "gptoss": Vocabulary(
        256,
        tuple((t, True) for t in ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>")),
        "<|return|>",
        "<|endoftext|>",
        None,
        "gptoss.jinja",
    ),
    "nemotron": Vocabulary(
        256,
        tuple((t, True) for t in ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")),
        "<|im_end|>",
        "<unk>",
        None,
        "nemotron_3_nano.jinja",
    ),
}
# The tiny models' shape (TRL's tiny test models are of this size; reward models use hidden_size=16).
TINY = {"hidden_size": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
TINY |= {"intermediate_size": 32}
REWARD = TINY | {"hidden_size": 16, "num_labels": 1}


@dataclass(frozen=True)
class ModelStandIn:
    hub_id: str
    model_class: str  # a transformers class name; its config_class builds the config
    vocabulary: str
    config: dict[str, Any]
    remote_code: str | None = None  # save as a custom-code model of this class name (a thin subclass, REMOTE_CODE)


# A custom-code model for ``trust_remote_code`` tests: model type "remote", a thin subclass of the Llama classes.
REMOTE_CODE = {
    "configuration_remote.py": """from transformers import LlamaConfig


class RemoteConfig(LlamaConfig):
    model_type = "remote"
""",
    "modeling_remote.py": """from transformers import LlamaForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(LlamaForCausalLM):
    config_class = RemoteConfig
""",
}


ORG = "trl-internal-testing/"
MODELS = (
    ModelStandIn(ORG + "tiny-Qwen2ForCausalLM-2.5", "Qwen2ForCausalLM", "qwen2.5", TINY),
    ModelStandIn(ORG + "tiny-Qwen2ForSequenceClassification-2.5", "Qwen2ForSequenceClassification", "qwen2.5", REWARD),
    ModelStandIn(ORG + "tiny-Qwen3ForCausalLM", "Qwen3ForCausalLM", "qwen3", TINY),
    ModelStandIn(ORG + "tiny-Qwen3ForSequenceClassification", "Qwen3ForSequenceClassification", "qwen3", REWARD),
    ModelStandIn(
        ORG + "tiny-Qwen3MoeForCausalLM",
        "Qwen3MoeForCausalLM",
        "qwen3",
        TINY | {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
    ),
    ModelStandIn(ORG + "tiny-LlamaForCausalLM-3.2", "LlamaForCausalLM", "llama3.2", TINY),
    ModelStandIn(ORG + "tiny-LlamaForSequenceClassification-3.2", "LlamaForSequenceClassification", "llama3.2", REWARD),
    ModelStandIn(ORG + "tiny-MistralForCausalLM-0.2", "MistralForCausalLM", "mistral", TINY),
    ModelStandIn(ORG + "tiny-RemoteForCausalLM", "LlamaForCausalLM", "llama3.2", TINY, "RemoteForCausalLM"),
    ModelStandIn(ORG + "tiny-Gemma2ForCausalLM", "Gemma2ForCausalLM", "gemma", TINY | {"tie_word_embeddings": True}),
    ModelStandIn(ORG + "tiny-Cohere2ForCausalLM", "Cohere2ForCausalLM", "cohere2", TINY),
    ModelStandIn(
        ORG + "tiny-Glm4MoeForCausalLM",
        "Glm4MoeForCausalLM",
        "glm4moe",
        TINY | {"moe_intermediate_size": 32, "head_dim": 2, "n_routed_experts": 4, "num_experts_per_tok": 2},
    ),
    ModelStandIn(
        ORG + "tiny-GptOssForCausalLM",
        "GptOssForCausalLM",
        "gptoss",
        TINY | {"num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    ModelStandIn(
        ORG + "tiny-NemotronHForCausalLM-nano",
        "NemotronHForCausalLM",
        "nemotron",
        {
            "hidden_size": 16,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "intermediate_size": 32,
            "layers_block_type": ["mamba", "attention", "moe"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 4,
            "mamba_n_groups": 1,
            "ssm_state_size": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "use_mamba_kernels": False,
        },
    ),
)


def byte_tokens() -> dict[int, str]:
    """``{byte: token}`` for the 256 byte tokens in GPT-2's byte-level order (printable bytes first, standing for
    themselves; the others as characters from U+0100 on): the n-th entry is token id n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}


def build_tokenizer(vocab: Vocabulary, layout: str) -> Any:
    """A ``PreTrainedTokenizerFast`` of family ``vocab``: one token per byte (no merges), the special tokens where
    ``layout`` puts them, the family's chat template from the installed trl and a BOS prepended where the real
    tokenizer does it."""
    import trl
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte = byte_tokens()
    table = {token: i for i, token in enumerate(byte.values())}
    if layout == "real-ids" and vocab.first_special > len(table):
        text = {i: "".join(byte[b] for b in t.encode()) for i, t in QWEN_TEXT_TOKENS.items()}
        table |= {text.get(i, f"<|filler_{i}|>"): i for i in range(len(table), vocab.first_special)}
    backend = Tokenizer(models.BPE(vocab=table, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in vocab.specials])
    if vocab.bos is not None:
        bos_id = backend.token_to_id(vocab.bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{vocab.bos} $A", pair=f"{vocab.bos} $A {vocab.bos} $B", special_tokens=[(vocab.bos, bos_id)]
        )
    tokens = {"eos_token": vocab.eos, "pad_token": vocab.pad, "bos_token": vocab.bos}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, **{k: v for k, v in tokens.items() if v is not None}, model_max_length=32768
    )
    if vocab.chat_template is not None:
        tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / vocab.chat_template).read_text()
    return tokenizer


def build_model(spec: ModelStandIn, out: Path, layout: str, seed: int = 0) -> None:
    """Save a randomly initialised ``spec`` with its tokenizer and generation config to ``out`` (bf16 weights, as
    TRL's tiny test models are stored)."""
    import torch
    import transformers
    from torch import nn

    vocab = VOCABULARIES[spec.vocabulary]
    tokenizer = build_tokenizer(vocab, layout)
    model_class = getattr(transformers, spec.model_class)
    ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    config = model_class.config_class(vocab_size=len(tokenizer), **ids, **spec.config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
        for module in model.modules():  # as TRL's tiny models: no NaNs, gradients large enough to move at lr 0.1
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
    model = model.to(torch.bfloat16)
    eos = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(vocab.extra_eos))]
    model.generation_config = transformers.GenerationConfig(**(ids | {"eos_token_id": eos if len(eos) > 1 else eos[0]}))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if spec.remote_code is not None:  # loadable only with trust_remote_code=True, as the hub's custom-code models
        for name, code in REMOTE_CODE.items():
            (out / name).write_text(code)
        saved = json.loads((out / "config.json").read_text())
        saved |= {"model_type": "remote", "architectures": [spec.remote_code]}
        saved["auto_map"] = {"AutoConfig": "configuration_remote.RemoteConfig"}
        saved["auto_map"]["AutoModelForCausalLM"] = f"modeling_remote.{spec.remote_code}"
        (out / "config.json").write_text(json.dumps(saved, indent=2))


def zen_rows() -> list[str]:
    """The 19 aphorisms of the Zen of Python, from the standard library's ``this`` module."""
    import codecs

    with contextlib.redirect_stdout(io.StringIO()):  # importing ``this`` prints the poem
        import this
    lines = codecs.decode(this.s, "rot13").splitlines()
    return [line for line in lines[2:] if line.strip()]


# The hub data set's prompts are these many leading words of each aphorism (test_prepare_input_called_with_correct_data
# asserts the first twelve).
ZEN_PROMPT_WORDS = (4, 2, 3, 1, 4, 3, 1, 4, 3, 3, 2, 6, 6, 11, 2, 4, 7, 5, 5)


def build_zen(out: Path) -> None:
    """``trl-internal-testing/zen`` as the GRPO tests use it: configs ``standard_prompt_only`` ({"prompt": str}) and
    ``conversational_prompt_only`` ({"prompt": [user message]}), 19 rows split 17 train / 2 test, in a folder that
    ``datasets.load_dataset(folder, config, split=..., streaming=...)`` reads like the hub repo."""
    from datasets import Dataset

    aphorisms = zen_rows()
    prompts = [" ".join(a.split()[:n]) for a, n in zip(aphorisms, ZEN_PROMPT_WORDS, strict=True)]
    configs = {
        "standard_prompt_only": {"prompt": prompts},
        "conversational_prompt_only": {"prompt": [[{"role": "user", "content": f"Complete: {p}"}] for p in prompts]},
    }
    card = ["---", "configs:"]
    for name, columns in configs.items():
        splits = Dataset.from_dict(columns).train_test_split(test_size=0.1, shuffle=False)
        card += [f"- config_name: {name}", "  data_files:"]
        for split, data in splits.items():
            data.to_parquet(out / name / f"{split}.parquet")
            card += [f"  - split: {split}", f"    path: {name}/{split}.parquet"]
    (out / "README.md").write_text("\n".join([*card, "---", "Stand-in built by steadyrl's scripts/trl_grpo_suite.py"]))


DATASETS: dict[str, Callable[[Path], None]] = {ORG + "zen": build_zen}


def publish(hub_cache: Path, repo_id: str, folder: Path) -> None:
    """Move ``folder`` into ``hub_cache`` as the ``main`` snapshot of model repo ``repo_id`` (the layout
    ``huggingface_hub`` reads with ``HF_HUB_OFFLINE=1``)."""
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir(exist_ok=True)
    shutil.move(folder, repo / "snapshots" / commit)


def build_standins(root: Path) -> dict[str, Any]:
    """Build every stand-in under ``root`` (``hub-<layout>/`` an HF cache per layout, ``datasets/`` one folder per
    data set) unless a build of this ``STANDIN_VERSION`` is already there. Returns the manifest."""
    manifest_path = root / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("version") == STANDIN_VERSION:
            return manifest
    shutil.rmtree(root, ignore_errors=True)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    caches = {layout: root / f"hub-{layout}" for layout in LAYOUTS}
    models, failed = [], {}
    for spec in MODELS:
        try:
            for layout, cache in caches.items():
                scratch = root / "scratch" / layout / spec.hub_id.replace("/", "--")
                build_model(spec, scratch, layout)
                publish(cache, spec.hub_id, scratch)
        except Exception as exc:  # a transformers release without this architecture: its tests get skipped
            failed[spec.hub_id] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            continue
        models.append(spec.hub_id)
    datasets = {}
    for repo_id, build in DATASETS.items():
        folder = root / "datasets" / repo_id.replace("/", "--")
        folder.mkdir(parents=True)
        build(folder)
        datasets[repo_id] = str(folder)
    shutil.rmtree(root / "scratch", ignore_errors=True)
    manifest = {"version": STANDIN_VERSION, "models": models, "datasets": datasets, "build_failures": failed}
    manifest["caches"] = {layout: str(cache) for layout, cache in caches.items()}
    manifest["hf_home"] = str(root / "hf_home")  # datasets' and remote code's caches: rebuilt with the stand-ins
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return manifest


# --------------------------------------------------------------------------------------------------------------------
# The pytest plugin: active only in a process started by run_mode (MODE_ENV set)
# --------------------------------------------------------------------------------------------------------------------

_ACCEPTED: dict[str, set[str]] = {}  # keyword arguments the installed trl's GRPOConfig / GRPOTrainer take
_REPLACEMENT: list[type] = []  # the class that stands in for trl.GRPOTrainer in this mode
_REAL_IDS: set[str] = set()  # node ids of the tests that get the real-ids stand-in cache
FAST_VOCABULARY = 256 + max(len(v.specials) for v in VOCABULARIES.values())  # ids below it exist in every layout


def trainer_for(mode: str) -> type:
    """The class the test module gets as ``GRPOTrainer`` in ``mode``."""
    import trl

    if mode == "plain":
        return trl.GRPOTrainer
    from steadyrl.trainers.grpo import SteadyGRPOTrainer

    if mode == "guards-off":
        return SteadyGRPOTrainer

    class ShippedGuardsGRPOTrainer(SteadyGRPOTrainer):
        """``SteadyGRPOTrainer(guards="all")``: every guard layer at its shipped defaults."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("guards", "all")
            super().__init__(*args, **kwargs)

    return ShippedGuardsGRPOTrainer


def _note(kind: str, value: str) -> None:
    """Tell the runner something about this process (a line in the NOTES_ENV file)."""
    path = os.environ.get(NOTES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{kind} {value}\n")


def _supply_missing_trl_names() -> None:
    """TRL's tests/testing_utils.py imports ``is_<package>_available`` helpers from ``trl.import_utils``; the ones a
    newer TRL added and the installed one lacks are answered with an import check of that package."""
    import_utils = importlib.import_module("trl.import_utils")

    def missing(name: str) -> Callable[..., bool]:
        match = re.fullmatch(r"is_(\w+)_available", name)
        if match is None:
            raise AttributeError(f"module 'trl.import_utils' has no attribute {name!r}")
        _note("shim", f"trl.import_utils.{name}")
        package = match.group(1)
        return lambda *args, **kwargs: importlib.util.find_spec(package) is not None

    import_utils.__getattr__ = missing  # PEP 562: asked only for names the module lacks


def _redirect_datasets(local: dict[str, str]) -> None:
    """``load_dataset(hub_id, ...)`` reads the local stand-in folder of ``hub_id`` instead."""
    import functools

    import datasets

    original = datasets.load_dataset

    @functools.wraps(original)
    def load_dataset(path: str, *args: Any, **kwargs: Any) -> Any:
        return original(local.get(path, path), *args, **kwargs)

    datasets.load_dataset = load_dataset


def _replace_trainer(mode: str) -> None:
    """``trl.GRPOTrainer`` (and its other import paths) become ``trainer_for(mode)`` before the test module imports
    it with ``from trl import GRPOTrainer``."""
    replacement = trainer_for(mode)
    for name in ("trl", "trl.trainer", "trl.trainer.grpo_trainer"):
        importlib.import_module(name).GRPOTrainer = replacement
    _REPLACEMENT.append(replacement)


def pytest_configure(config: Any) -> None:
    """Patch what this process's mode asks, before collection imports the test module."""
    mode = os.environ.get(MODE_ENV)
    if mode is None:
        return
    import trl

    _ACCEPTED["GRPOConfig"] = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    _ACCEPTED["GRPOTrainer"] = set(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    _supply_missing_trl_names()
    _redirect_datasets(json.loads(os.environ[DATASETS_ENV]))
    if mode != "plain":
        _replace_trainer(mode)


def _body_source(function: Callable[..., Any]) -> str:
    """The source of ``function`` without its decorators (a parametrize list names models this item does not use)."""
    try:
        lines = inspect.getsource(function).splitlines()
    except (OSError, TypeError):
        return ""
    start = next((i for i, line in enumerate(lines) if re.match(r"\s*(async\s+)?def\s", line)), 0)
    return "\n".join(lines[start:])


def _absent_arguments(source: str) -> list[str]:
    """``GRPOConfig(x=...)`` / ``GRPOTrainer(x=...)`` keywords in ``source`` that the installed trl does not take."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return []
    absent = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            accepted = _ACCEPTED.get(name or "")
            if accepted is not None:
                absent |= {f"{name}({kw.arg}=)" for kw in node.keywords if kw.arg and kw.arg not in accepted}
    return sorted(absent)


def _needs_real_ids(source: str) -> bool:
    """Whether the test in ``source`` depends on the vocabulary's real size: it holds a list of integers too large
    for the fast layout (scripted token ids), or sets ``mask_truncated_completions=True`` (it relies on a random
    model sampling EOS about once in 151k tokens)."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.List) and any(
            isinstance(x, ast.Constant) and type(x.value) is int and x.value >= FAST_VOCABULARY for x in node.elts
        ):
            return True
        if isinstance(node, ast.keyword) and node.arg == "mask_truncated_completions":
            return not (isinstance(node.value, ast.Constant) and node.value.value is False)
    return False


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    """Skip what cannot run here, the same way in every mode: tests that pass arguments the installed trl lacks (not
    applicable) and tests that load a hub model or data set without a local stand-in (not runnable offline)."""
    mode = os.environ.get(MODE_ENV)
    if mode is None:
        return
    available = set(json.loads(os.environ[MODELS_ENV])) | set(json.loads(os.environ[DATASETS_ENV]))
    for item in items:
        module = getattr(item, "module", None)
        if _REPLACEMENT and module is not None and getattr(module, "GRPOTrainer", None) is not _REPLACEMENT[0]:
            raise pytest.UsageError(f"{module.__name__}.GRPOTrainer was not replaced in mode {mode}")
        function = getattr(item, "function", None)
        if function is None:
            continue
        source = _body_source(function)
        setup = getattr(getattr(item, "cls", None), "setup_method", None)
        source += "\n" + (_body_source(setup) if setup is not None else "")
        params = getattr(getattr(item, "callspec", None), "params", {})
        named = set(HUB_ID.findall(source)) | {p for p in params.values() if isinstance(p, str) and HUB_ID.fullmatch(p)}
        absent = _absent_arguments(_body_source(function))
        if _needs_real_ids(_body_source(function)):
            _REAL_IDS.add(item.nodeid)
            _note("real-ids", item.nodeid.split("::", 1)[1])
        if absent:
            reason = f"{NOT_APPLICABLE} installed trl lacks {', '.join(absent)}"
            item.add_marker(pytest.mark.skip(reason=reason))
        elif named - available:
            reason = f"{NO_STANDIN} {', '.join(sorted(named - available))}"
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    """Point huggingface_hub (read at each call) at the stand-in cache of this test's layout."""
    if os.environ.get(MODE_ENV) is None:
        return
    import huggingface_hub.constants

    caches = json.loads(os.environ[CACHES_ENV])
    huggingface_hub.constants.HF_HUB_CACHE = caches["real-ids" if item.nodeid in _REAL_IDS else "fast"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    """Fail a test that runs past TIMEOUT_ENV seconds (SIGALRM), so that one slow test cannot stall a mode."""
    seconds = float(os.environ.get(TIMEOUT_ENV) or 0) if os.environ.get(MODE_ENV) else 0.0
    if seconds <= 0:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"test ran past {seconds:.0f} s (--test-timeout)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------------------------------------------------
# Running the three modes and reading their outcomes
# --------------------------------------------------------------------------------------------------------------------

PASSED, FAILED, ERROR, SKIPPED, XFAILED = "passed", "failed", "error", "skipped", "xfailed"
NOT_RUN = "not run"  # absent from a mode's report (deselected there, or its pytest process died)


@dataclass
class Outcome:
    status: str
    message: str = ""  # the first line of the failure, error or skip reason

    def failing(self) -> bool:
        return self.status in (FAILED, ERROR, NOT_RUN)


@dataclass
class ModeRun:
    mode: str
    outcomes: dict[str, Outcome]
    wall_s: float
    returncode: int
    log: Path


def read_junit(path: Path) -> dict[str, Outcome]:
    """``{test id: Outcome}`` from pytest's junit xml; the test id is the node id within the test file
    (``TestGRPOTrainer::test_train[...]``)."""
    outcomes: dict[str, Outcome] = {}
    if not path.is_file():
        return outcomes
    for case in ET.parse(path).iter("testcase"):
        owner = (case.get("classname") or "").rsplit(".", 1)[-1]
        name = case.get("name") or ""
        test_id = name if owner == Path(TEST_FILE).stem else f"{owner}::{name}"
        found = {child.tag: child for child in case}
        for tag, status in (("failure", FAILED), ("error", ERROR), ("skipped", SKIPPED)):
            if tag in found:
                child = found[tag]
                if status == SKIPPED and child.get("type") == "pytest.xfail":
                    status = XFAILED
                text = child.get("message") or child.text or ""
                line = next((x.strip() for x in text.splitlines() if x.strip()), "")
                if status != FAILED or test_id not in outcomes:
                    outcomes[test_id] = Outcome(status, line[:300])
                break
        else:
            outcomes[test_id] = Outcome(PASSED)
    return outcomes


def locate_tests(path: Path) -> Path:
    """The TRL tests folder: ``path`` itself or ``path/tests``."""
    for folder in (path, path / "tests"):
        if (folder / TEST_FILE).is_file():
            return folder
    raise SystemExit(f"error: no {TEST_FILE} in {path} or {path / 'tests'}")


def prepare(tests: Path, workdir: Path) -> Path:
    """A scratch copy of the tests folder (the runner never writes into the given one) and of this file, the plugin
    the three pytest processes load (a copy: editing the script during a run cannot change a later mode); returns
    the tests' rootdir."""
    root = workdir / "trl"
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(tests, root / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (root / "pytest.ini").write_text("[pytest]\n")  # stops pytest from reading a config further up
    (workdir / "plugin").mkdir(exist_ok=True)
    shutil.copyfile(__file__, workdir / "plugin" / f"{PLUGIN}.py")
    return root


def run_mode(
    mode: str, root: Path, manifest: dict[str, Any], workdir: Path, pytest_args: list[str], test_timeout: float
) -> ModeRun:
    """One pytest process over the test file in ``mode``; its log and junit xml go to ``workdir``."""
    xml, log, notes = (workdir / f"{mode}.{ext}" for ext in ("xml", "log", "notes"))
    for stale in (xml, notes):
        stale.unlink(missing_ok=True)
    env = os.environ | {
        MODE_ENV: mode,
        DATASETS_ENV: json.dumps(manifest["datasets"]),
        MODELS_ENV: json.dumps(manifest["models"]),
        CACHES_ENV: json.dumps(manifest["caches"]),
        NOTES_ENV: str(notes),
        TIMEOUT_ENV: str(test_timeout),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_CACHE": manifest["caches"]["fast"],
        "HF_HOME": manifest["hf_home"],
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(workdir / "plugin"), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", PLUGIN, "-c", str(root / "pytest.ini")]
    command += ["--rootdir", str(root), f"--junitxml={xml}", "-q", "-rfE", f"tests/{TEST_FILE}", *pytest_args]
    print(f"[{mode}] pytest running (log: {log})", flush=True)
    start = time.monotonic()
    with log.open("w") as out:
        returncode = subprocess.run(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - start
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    print(f"[{mode}] exit {returncode} in {wall:.0f} s: {tail[0] if tail else '(no output)'}", flush=True)
    return ModeRun(mode, read_junit(xml), wall, returncode, log)


# --------------------------------------------------------------------------------------------------------------------
# Comparing and reporting
# --------------------------------------------------------------------------------------------------------------------


def read_expected(path: Path | None) -> dict[tuple[str, str], str]:
    """``{(mode, test id): reason}`` from an expected-failures file (``MODE TEST_ID REASON`` lines)."""
    expected: dict[tuple[str, str], str] = {}
    if path is None:
        return expected
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(maxsplit=2)
        if len(parts) < 3 or parts[0] not in (*MODES[1:], "*"):
            raise SystemExit(f"error: {path}:{number}: expected 'MODE TEST_ID REASON' (MODE guards-off, all or *)")
        mode, test_id, reason = parts
        for each in MODES[1:] if mode == "*" else (mode,):
            expected[(each, test_id)] = reason
    return expected


def category(outcome: Outcome) -> str:
    """Why a test did not run, in words; '' for one that ran."""
    if outcome.status != SKIPPED:
        return ""
    if outcome.message.startswith(NOT_APPLICABLE):
        return "not applicable"
    return "not runnable here"


LIKELY_ABSENT_API = re.compile(r"unexpected keyword argument|has no attribute|cannot import name|No module named")


def summarise(runs: dict[str, ModeRun], expected: dict[tuple[str, str], str]) -> dict[str, Any]:
    """Counts, regressions against plain, and the test ids in table order."""
    plain = runs["plain"].outcomes if "plain" in runs else {}
    ids = sorted(set().union(*(run.outcomes for run in runs.values())))
    skipped = {i: plain[i] for i in ids if i in plain and plain[i].status == SKIPPED}
    passed = [i for i in ids if i in plain and plain[i].status == PASSED]
    summary: dict[str, Any] = {
        "collected": len(ids),
        "not_applicable": {i: o.message for i, o in skipped.items() if category(o) == "not applicable"},
        "not_runnable": {i: o.message for i, o in skipped.items() if category(o) == "not runnable here"},
        "runnable": len(ids) - len(skipped),
        "plain_counts": dict(Counter(o.status for o in plain.values())),
        "passed_on_plain": len(passed),
        "failing_on_plain": {
            i: plain[i].message + ("  [trl API absent?]" if LIKELY_ABSENT_API.search(plain[i].message) else "")
            for i in ids
            if i in plain and plain[i].failing()
        },
        "ids": ids,
        "against_plain": {},
    }
    for mode in MODES[1:]:
        if mode not in runs or not plain:
            continue
        outcomes = runs[mode].outcomes
        failing = {i: outcomes.get(i, Outcome(NOT_RUN)) for i in passed if outcomes.get(i, Outcome(NOT_RUN)).failing()}
        summary["against_plain"][mode] = {
            "failing": {i: f"{o.status}: {o.message}".rstrip(": ") for i, o in failing.items()},
            "unexpected": sorted(i for i in failing if (mode, i) not in expected),
            "expected_now_passing": sorted(i for m, i in expected if m == mode and i not in failing and i in passed),
        }
    return summary


SHORT = {PASSED: "pass", FAILED: "FAIL", ERROR: "ERROR", SKIPPED: "skip", XFAILED: "xfail", NOT_RUN: "-"}


def print_report(runs: dict[str, ModeRun], summary: dict[str, Any], expected: dict[tuple[str, str], str]) -> None:
    modes = [m for m in MODES if m in runs]
    width = max([len(i) for i in summary["ids"]] + [10])
    print("\n" + "test".ljust(width) + "".join(m.rjust(12) for m in modes))
    for test_id in summary["ids"]:
        cells = [SHORT[runs[m].outcomes.get(test_id, Outcome(NOT_RUN)).status] for m in modes]
        print(test_id.ljust(width) + "".join(c.rjust(12) for c in cells))
    print(f"\ncollected {summary['collected']}; not applicable to the installed trl {len(summary['not_applicable'])};")
    print(f"not runnable here (offline, a package or a GPU missing) {len(summary['not_runnable'])}; ", end="")
    print(f"runnable {summary['runnable']}")
    reasons = Counter(NO_STANDIN if m.startswith(NO_STANDIN) else m for m in summary["not_runnable"].values())
    for reason, n in reasons.most_common():
        print(f"  {n:4d} skipped: {reason}")
    missing = {x for m in summary["not_runnable"].values() if m.startswith(NO_STANDIN) for x in HUB_ID.findall(m)}
    if missing:
        print(f"       {NO_STANDIN} named: {', '.join(sorted(missing))}")
    print(f"plain: {summary['plain_counts']}; passed on plain: {summary['passed_on_plain']}")
    for test_id, message in summary["failing_on_plain"].items():
        print(f"  plain {test_id}: {message}")
    for mode, comparison in summary["against_plain"].items():
        failing = comparison["failing"]
        print(f"{mode}: {len(failing)} of the {summary['passed_on_plain']} tests passing on plain fail")
        for test_id, message in failing.items():
            note = f"  (expected: {expected[(mode, test_id)]})" if (mode, test_id) in expected else ""
            print(f"  {mode} {test_id}: {message}{note}")
        for test_id in comparison["expected_now_passing"]:
            print(f"  {mode} {test_id}: listed as an expected failure, passes")


def git_commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return sha + ("-dirty" if dirty else "")


def write_results(
    path: Path,
    runs: dict[str, ModeRun],
    summary: dict[str, Any],
    tests: Path,
    ref: str | None,
    manifest: dict[str, Any],
) -> None:
    from steadyrl.environment import machine_line, package_versions

    plain_wall = runs["plain"].wall_s if "plain" in runs else None
    notes = {line for run in runs.values() for line in _read_lines(run.log.with_suffix(".notes"))}
    shims = sorted(line.split(" ", 1)[1] for line in notes if line.startswith("shim "))
    real_ids = sorted(line.split(" ", 1)[1] for line in notes if line.startswith("real-ids "))
    cells = []
    for mode, run in runs.items():
        statuses = {i: o.status for i, o in run.outcomes.items()}
        messages = {i: o.message for i, o in run.outcomes.items() if o.status in (FAILED, ERROR)}
        metrics: dict[str, Any] = {"counts": dict(Counter(statuses.values())), "outcomes": statuses, "errors": messages}
        if plain_wall:
            metrics["wall_time_ratio_to_plain"] = round(run.wall_s / plain_wall, 3)
        if mode in summary["against_plain"]:
            metrics["failing_passed_on_plain"] = summary["against_plain"][mode]["failing"]
        note = f"pytest exit {run.returncode}; {run.wall_s:.0f} s wall on this machine"
        cells.append({"scenario": f"trl tests/{TEST_FILE}", "variant": mode, "metrics": metrics, "note": note})
    record = {
        "benchmark": "trl_grpo_suite",
        "command": "python " + " ".join([str(Path(sys.argv[0]).resolve().relative_to(REPO)), *sys.argv[1:]]),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "machine": machine_line(),
        "model": "local random-weight stand-ins of the trl-internal-testing tiny models (see standins)",
        "packages": package_versions(),
        "trl_tests": {
            "folder": str(tests),
            "ref": ref,
            "sha256": hashlib.sha256((tests / TEST_FILE).read_bytes()).hexdigest(),
            "compat_shims": shims,
        },
        "tests_on_real_ids_layout": real_ids,
        "standins": {k: manifest[k] for k in ("models", "datasets", "build_failures")} | {"version": STANDIN_VERSION},
        "summary": {k: v for k, v in summary.items() if k != "ids"},
        "cells": cells,
    }
    record["standins"]["datasets"] = sorted(manifest["datasets"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


def _read_lines(path: Path) -> Iterable[str]:
    return path.read_text().splitlines() if path.is_file() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-tests", type=Path, required=True, help="TRL's tests folder (or a checkout holding it)")
    parser.add_argument("--trl-ref", help="where the tests come from, for the results (e.g. a TRL commit)")
    parser.add_argument("--expected-failures", type=Path, help="lines 'MODE TEST_ID REASON' (MODE guards-off|all|*)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="default: all three")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression: run a subset (results not written)")
    parser.add_argument("--results", type=Path, help=f"default {RESULTS.relative_to(REPO)} (none with -k)")
    parser.add_argument("--no-results", action="store_true", help="write no results file")
    parser.add_argument("--test-timeout", type=float, default=600, help="seconds one test may run (0: no limit)")
    parser.add_argument(
        "--workdir",
        type=Path,
        help="scratch folder, kept: logs, junit xml, stand-ins (reused); default: a temp one, removed",
    )
    args = parser.parse_args(argv)

    tests = locate_tests(args.trl_tests.resolve())
    expected = read_expected(args.expected_failures)
    workdir = args.workdir.resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="trl-grpo-suite-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        start = time.monotonic()
        manifest = build_standins(workdir / "standins")
        print(
            f"stand-ins: {len(manifest['models'])} models, {len(manifest['datasets'])} data sets "
            f"({time.monotonic() - start:.0f} s)",
            flush=True,
        )
        for hub_id, error in manifest["build_failures"].items():
            print(f"  not built: {hub_id}: {error}")
        root = prepare(tests, workdir)
        pytest_args = ["-k", args.keyword] if args.keyword else []
        runs = {
            mode: run_mode(mode, root, manifest, workdir, pytest_args, args.test_timeout)
            for mode in MODES
            if mode in args.modes
        }
        if not any(run.outcomes for run in runs.values()):
            print("error: no test outcomes (see the logs above)", file=sys.stderr)
            return 2
        summary = summarise(runs, expected)
        print_report(runs, summary, expected)
        results = None if args.no_results else args.results or (None if args.keyword else RESULTS)
        if results is not None:
            write_results(results, runs, summary, tests, args.trl_ref, manifest)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    unexpected = sum(len(comparison["unexpected"]) for comparison in summary["against_plain"].values())
    crashed = [m for m, run in runs.items() if run.returncode not in (0, 1)]
    if crashed:
        print(f"error: pytest did not finish in {crashed} (exit codes above)", file=sys.stderr)
        return 2
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
