"""The packages a config needs at run time, checked when it is validated (before any model or data loads).

Without this check a GPU run fails late: ``report_to: [tensorboard]`` without tensorboard stops the Trainer at
construction, after the model loaded; ``trl.rewards:accuracy_reward`` without math-verify fails at the first reward
call, after the first generation. ``check_requirements`` names every missing package at once, what needs it, and
the command that installs it (the ``gpu`` extra holds what the shipped per-size configs need).

What is checked: the ``report_to`` backends; reward functions with known optional dependencies (steadyrl's
built-ins and TRL's math rewards); ``peft`` when a ``peft`` section is set; ``deepspeed`` when the run is (or will
be) launched with DeepSpeed: ``trainer.deepspeed`` set, ``ACCELERATE_USE_DEEPSPEED=true`` (accelerate's launcher
sets it), or an accelerate config with ``distributed_type: DEEPSPEED`` given to ``steadyrl validate
--accelerate-config``. A user's own reward module is imported at validation, so its imports are checked there.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadyrl.config.loader import ConfigError

GPU_EXTRA = "pip install -e .[gpu]"

# report_to name -> (module to import, install command). transformers' integrations import these modules.
REPORT_BACKENDS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", f"{GPU_EXTRA}  (or: pip install tensorboard)"),
    "wandb": ("wandb", "pip install wandb"),
    "mlflow": ("mlflow", "pip install mlflow"),
    "comet_ml": ("comet_ml", "pip install comet-ml"),
    "trackio": ("trackio", "pip install trackio"),
    "swanlab": ("swanlab", "pip install swanlab"),
    "clearml": ("clearml", "pip install clearml"),
    "dvclive": ("dvclive", "pip install dvclive"),
    "neptune": ("neptune", "pip install neptune"),
    "aim": ("aim", "pip install aim"),
    "codecarbon": ("codecarbon", "pip install codecarbon"),
}
# reward fn spec -> (module, install command), for rewards whose dependency is optional
REWARD_MODULES: dict[str, tuple[str, str]] = {
    "math_answer": ("math_verify", "pip install -e .[real]  (or: pip install math-verify)"),
    "trl.rewards:accuracy_reward": ("math_verify", f"{GPU_EXTRA}  (or: pip install math-verify)"),
    "trl.rewards:reasoning_accuracy_reward": ("math_verify", f"{GPU_EXTRA}  (or: pip install math-verify)"),
}


@dataclass(frozen=True)
class Missing:
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


def _report_backends(report_to: Any) -> list[str]:
    if report_to in (None, "none", []):
        return []
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if "all" in names:  # transformers then uses whatever is installed: nothing can be missing
        return []
    return [n for n in names if n != "none"]


def deepspeed_accelerate_config(path: str | Path) -> bool:
    """Whether an accelerate config file launches DeepSpeed (``distributed_type: DEEPSPEED``)."""
    import yaml

    tree = yaml.safe_load(Path(path).read_text()) or {}
    return str(tree.get("distributed_type", "")).upper() == "DEEPSPEED" or "deepspeed_config" in tree


def missing_requirements(cfg: Any, accelerate_config: str | Path | None = None) -> list[Missing]:
    """Every package ``cfg`` needs that is not importable, in config order."""
    out: list[Missing] = []
    for name in _report_backends(cfg.trainer.get("report_to")):
        if name in REPORT_BACKENDS and not installed(REPORT_BACKENDS[name][0]):
            module, install = REPORT_BACKENDS[name]
            out.append(Missing(module, f"trainer.report_to: {name}", install))
    for i, reward in enumerate(cfg.rewards):
        if reward.fn in REWARD_MODULES and not installed(REWARD_MODULES[reward.fn][0]):
            module, install = REWARD_MODULES[reward.fn]
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
    return out


def check_requirements(cfg: Any, accelerate_config: str | Path | None = None) -> None:
    """ConfigError listing every missing package with what needs it and how to install it; nothing when complete."""
    missing = missing_requirements(cfg, accelerate_config)
    if missing:
        lines = "\n  ".join(m.line() for m in missing)
        raise ConfigError(f"missing package(s) this config needs:\n  {lines}")
