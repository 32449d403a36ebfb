"""A tiny LLaMA-style causal LM and a byte-level tokenizer, built locally (no hub access).

The tokenizer maps each UTF-8 byte to one token (GPT-2's byte-to-unicode table, no merges), plus ``<pad>`` = 0,
``</s>`` = 1, ``<unk>`` = 2. Unlike ``ByT5Tokenizer`` it does not append ``</s>`` to every text: TRL tokenizes raw
prompts with the tokenizer's defaults, and a prompt ending in EOS would teach answering after end-of-sequence.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


def _bytes_to_unicode() -> dict[int, str]:
    """Printable stand-in character for each byte, as in GPT-2's byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    missing = [b for b in range(256) if b not in printable]
    chars = [*printable, *range(256, 256 + len(missing))]
    return {b: chr(c) for b, c in zip([*printable, *missing], chars, strict=True)}


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer: ids 0-2 are special, byte ``b`` is id ``b + 3``."""
    table = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *(table[b] for b in range(256))])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="left")  # fmt: skip


def build_tiny_model(output_dir: str | Path, *, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4,
                     intermediate_size: int = 384, max_position_embeddings: int = 64, seed: int = 0,
                     ) -> Path:  # fmt: skip
    """Save a randomly initialised tiny LLaMA (about 0.9 M parameters by default) and the byte tokenizer to
    ``output_dir``; returns it."""
    output_dir = Path(output_dir)
    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=max_position_embeddings, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, tie_word_embeddings=True)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id, None
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
