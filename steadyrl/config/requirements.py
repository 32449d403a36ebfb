"""The packages a config needs at run time, checked when it is validated, not after the model loaded.

``check_requirements`` names every missing package at once (``report_to`` backends, rewards' optional dependencies,
``peft``, ``deepspeed`` for a DeepSpeed launch), what needs it, and the command that installs it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, NamedTuple

from steadyrl.config.loader import ConfigError

GPU_EXTRA = "pip install -e .[gpu]"

# report_to name -> (module to import, install command). transformers' integrations import these modules.
REPORT_BACKENDS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", f"{GPU_EXTRA}  (or: pip install tensorboard)"),
    "comet_ml": ("comet_ml", "pip install comet-ml"),
    **{
        n: (n, f"pip install {n}")
        for n in "wandb mlflow trackio swanlab clearml dvclive neptune aim codecarbon".split()
    },
}
# reward fn spec -> (module, install command), for rewards whose dependency is optional
REWARD_MODULES: dict[str, tuple[str, str]] = {
    "math_answer": ("math_verify", "pip install -e .[real]  (or: pip install math-verify)"),
    "trl.rewards:accuracy_reward": ("math_verify", f"{GPU_EXTRA}  (or: pip install math-verify)"),
    "trl.rewards:reasoning_accuracy_reward": ("math_verify", f"{GPU_EXTRA}  (or: pip install math-verify)"),
}


class Missing(NamedTuple):
    module: str
    needed_by: str
    install: str

    def line(self) -> str:
        return f"{self.needed_by} needs the {self.module!r} package: {self.install}"


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def deepspeed_accelerate_config(path: str | Path) -> bool:
    """Whether an accelerate config file launches DeepSpeed (``distributed_type: DEEPSPEED``)."""
    import yaml

    tree = yaml.safe_load(Path(path).read_text()) or {}
    return str(tree.get("distributed_type", "")).upper() == "DEEPSPEED" or "deepspeed_config" in tree


def check_requirements(cfg: Any, accelerate_config: str | Path | None = None) -> None:
    """ConfigError listing every missing package (in config order) with what needs it and how to install it."""
    out: list[Missing] = []
    report_to = cfg.trainer.get("report_to")
    names = [] if report_to is None else [report_to] if isinstance(report_to, str) else list(report_to)
    for name in [] if "all" in names else [n for n in names if n != "none"]:  # all: whatever is installed
        module, install = REPORT_BACKENDS.get(name, ("", ""))
        if module and not installed(module):
            out.append(Missing(module, f"trainer.report_to: {name}", install))
    for i, reward in enumerate(cfg.rewards):
        module, install = REWARD_MODULES.get(reward.fn, ("", ""))
        if module and not installed(module):
            out.append(Missing(module, f"rewards[{i}] ({reward.fn})", install))
    if cfg.peft is not None and not installed("peft"):
        out.append(Missing("peft", "the peft section (LoRA)", "pip install peft"))
    deepspeed_by = None
    if cfg.trainer.get("deepspeed"):
        deepspeed_by = "trainer.deepspeed"
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        deepspeed_by = "the DeepSpeed launch (ACCELERATE_USE_DEEPSPEED)"
    elif accelerate_config is not None and deepspeed_accelerate_config(accelerate_config):
        deepspeed_by = f"the accelerate config {accelerate_config} (distributed_type: DEEPSPEED)"
    if deepspeed_by and not installed("deepspeed"):
        out.append(Missing("deepspeed", deepspeed_by, f"{GPU_EXTRA}  (or: pip install -e .[deepspeed])"))
    if out:
        lines = "\n  ".join(m.line() for m in out)
        raise ConfigError(f"missing package(s) this config needs:\n  {lines}")
