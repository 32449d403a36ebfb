"""A tiny LLaMA-style causal LM and a byte-level tokenizer, built locally (no hub access).

The tokenizer maps each UTF-8 byte to one token (GPT-2's byte-to-unicode table, no merges), plus three
special tokens: ``<pad>`` = 0, ``</s>`` = 1, ``<unk>`` = 2. Unlike ``ByT5Tokenizer`` it does not append
``</s>`` to every encoded text, which matters because TRL tokenizes raw prompts with the tokenizer's
defaults: a prompt ending in EOS would teach the model to answer after an end-of-sequence token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


def _bytes_to_unicode() -> dict[int, str]:
    """Printable stand-in character for each byte, as in GPT-2's byte-level BPE (so the vocab is text)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer: ids 0-2 are special, byte ``b`` is id ``b + 3``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    table = _bytes_to_unicode()
    for b in range(256):
        vocab[table[b]] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_model(
    output_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 384,
    max_position_embeddings: int = 64,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised tiny LLaMA and the byte tokenizer, save both to ``output_dir``.

    The defaults give about 0.9 M parameters. Returns the directory, which ``from_pretrained`` can load.
    """
    output_dir = Path(output_dir)
    tokenizer = build_byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir
