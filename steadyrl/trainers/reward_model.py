"""The reward-model stage (SFT -> **RM** -> PPO): train with TRL's RewardTrainer, calibrate, serve as a reward.

docs/DESIGN.md, "Reward-model stage". ``run_reward_stage`` is ``steadyrl reward CONFIG``; ``reward_model_score`` is
the reward function (``fn: steadyrl.trainers.reward_model:reward_model_score, kwargs: {path: runs/tiny-rm/final}``).
Both score exactly the token ids ``RewardTrainer`` trained on (``prompt + completion + eos``), unlike TRL's built-in
reward-model path in GRPO (no EOS).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from steadyrl.callbacks.progress import terminal_callbacks
from steadyrl.config.schema import rename_for_installed

logger = logging.getLogger(__name__)

ACCURACY_WARNING = 0.60  # below 60% pairwise accuracy, retrain the reward model first
STATS_FILE = "reward_stats.json"
CALIBRATION_FILE = "calibration.json"
CALIBRATION_PLOT = "calibration.png"


def encode_pair(tokenizer: Any, prompt: Any, completion: Any) -> list[int]:
    """Token ids of ``prompt + completion`` exactly as ``trl.RewardTrainer`` builds them: text plus EOS (unless
    already there), or ``apply_chat_template(prompt + completion)`` for message lists."""
    if isinstance(prompt, list) or isinstance(completion, list):
        messages = (prompt if isinstance(prompt, list) else []) + (completion if isinstance(completion, list) else [])
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
        return list(out["input_ids"])
    text = f"{prompt}{completion}"
    eos = tokenizer.eos_token
    if eos is not None and not text.endswith(eos):
        text += eos
    return list(tokenizer(text)["input_ids"])


@torch.no_grad()
def score_ids(model: nn.Module, ids: Sequence[Sequence[int]], pad_token_id: int, batch_size: int = 64) -> list[float]:
    """Scalar reward for each id sequence: right-padded batches through a one-label sequence classifier."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    scores: list[float] = []
    try:
        for start in range(0, len(ids), batch_size):
            chunk = [torch.tensor(list(x), dtype=torch.long) for x in ids[start : start + batch_size]]
            input_ids = nn.utils.rnn.pad_sequence(chunk, batch_first=True, padding_value=pad_token_id)
            lengths = torch.tensor([len(x) for x in chunk])
            attention_mask = (torch.arange(input_ids.shape[1]) < lengths[:, None]).long()
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
    finally:
        model.train(was_training)
    return scores


def hub_kwargs(init_kwargs: dict[str, Any], trust_remote_code: bool) -> dict[str, Any]:
    """``trust_remote_code`` and ``revision`` for loading a model's other files (tokenizer, config) as its weights
    load (``init_kwargs``: ``model_init_kwargs``, which win over ``trust_remote_code``)."""
    out = {"trust_remote_code": init_kwargs.get("trust_remote_code", trust_remote_code)}
    if init_kwargs.get("revision") is not None:
        out["revision"] = init_kwargs["revision"]
    return out


def _load_tokenizer(model_path: str | Path, **hub_kwargs: Any) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(model_path, **hub_kwargs)
    if tokenizer.pad_token is None:  # sequence classifiers need a pad token to find the last real token
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def train_reward_model(
    model_path: str | Path, train_ds: Dataset, eval_ds: Dataset | None, output_dir: str | Path, **config_kwargs: Any
) -> Any:
    """Train a Bradley-Terry reward model (``trl.RewardTrainer``, one-label head) on ``prompt``/``chosen``/``rejected``
    rows; save it to ``output_dir/final``. ``config_kwargs``: ``trl.RewardConfig`` fields (defaults here:
    ``report_to=[]``, ``bf16`` only where a GPU supports it). Returns the ``RewardTrainer``."""
    from trl import RewardConfig, RewardTrainer  # looked up at call time (tests stub RewardTrainer)

    bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    kwargs = {"report_to": [], "bf16": bf16, **config_kwargs, "output_dir": str(output_dir)}
    rename_for_installed(kwargs, {f.name for f in dataclasses.fields(RewardConfig)}, {})  # activation_checkpointing
    args = RewardConfig(**kwargs)
    tokenizer = _load_tokenizer(model_path, **hub_kwargs(args.model_init_kwargs or {}, args.trust_remote_code))
    trainer = RewardTrainer(
        model=str(model_path), args=args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
        callbacks=terminal_callbacks(),
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))
    return trainer


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(values) > 1 else 0.0


def pairwise_summary(
    chosen: Sequence[float], rejected: Sequence[float], kinds: Sequence[str] | None = None
) -> dict[str, Any]:
    """Calibration numbers from paired scores: accuracy (``chosen > rejected`` strictly), ties, margin, mean/std over
    all ``2n`` scores (unbiased), per-kind accuracy. Warns when accuracy is below :data:`ACCURACY_WARNING`."""
    if len(chosen) != len(rejected) or not chosen:
        raise ValueError(
            f"need the same non-zero number of chosen and rejected scores, got {len(chosen)}, {len(rejected)}"
        )
    n = len(chosen)
    wins = [c > r for c, r in zip(chosen, rejected, strict=True)]
    accuracy = sum(wins) / n
    mean, std = _mean_std([*chosen, *rejected])
    summary: dict[str, Any] = {
        "n_pairs": n,
        "accuracy": accuracy,
        "ties": sum(c == r for c, r in zip(chosen, rejected, strict=True)) / n,
        "margin_mean": sum(c - r for c, r in zip(chosen, rejected, strict=True)) / n,
        "chosen_mean": _mean_std(chosen)[0],
        "rejected_mean": _mean_std(rejected)[0],
        "mean": mean,
        "std": std,
    }
    if kinds is not None:
        per_kind: dict[str, list[bool]] = {}
        for kind, win in zip(kinds, wins, strict=True):
            per_kind.setdefault(kind, []).append(win)
        summary["accuracy_by_kind"] = {k: sum(v) / len(v) for k, v in sorted(per_kind.items())}
        summary["pairs_by_kind"] = {k: len(v) for k, v in sorted(per_kind.items())}
    if accuracy < ACCURACY_WARNING:
        logger.warning(
            "reward model pairwise accuracy %.3f on %d held-out pairs is below %.2f: retrain the reward model before "
            'RL (docs/DESIGN.md, "Reward-model stage")', accuracy, n, ACCURACY_WARNING,
        )  # fmt: skip
    return summary


def plot_calibration(chosen: Sequence[float], rejected: Sequence[float], path: str | Path, accuracy: float) -> Path:
    """Overlaid histograms of chosen vs rejected scores (shared bins) saved as a PNG; returns the path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    lo, hi = min(*chosen, *rejected), max(*chosen, *rejected)
    bins = torch.linspace(lo, hi if hi > lo else lo + 1.0, 31).tolist()
    ax.hist(list(chosen), bins=bins, alpha=0.6, label=f"chosen (n={len(chosen)})", color="tab:green")
    ax.hist(list(rejected), bins=bins, alpha=0.6, label=f"rejected (n={len(rejected)})", color="tab:red")
    ax.set(
        title=f"Reward model calibration: pairwise accuracy {accuracy:.1%}", xlabel="reward score (raw)", ylabel="count"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(path))
    return Path(path)


def calibration_report(
    model: nn.Module, tokenizer: Any, eval_ds: Dataset, output_dir: str | Path, *, batch_size: int = 64
) -> dict[str, Any]:
    """Score the held-out ``chosen``/``rejected`` (optional ``prompt``, ``kind``) pairs; write ``calibration.json``,
    ``reward_stats.json`` (``{"mean", "std", "n"}``), ``calibration.png``. Returns :func:`pairwise_summary` + paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = eval_ds["prompt"] if "prompt" in eval_ds.column_names else [""] * len(eval_ds)
    chosen_ids = [encode_pair(tokenizer, p, c) for p, c in zip(prompts, eval_ds["chosen"], strict=True)]
    rejected_ids = [encode_pair(tokenizer, p, r) for p, r in zip(prompts, eval_ds["rejected"], strict=True)]
    scores = score_ids(model, chosen_ids + rejected_ids, tokenizer.pad_token_id, batch_size)
    chosen, rejected = scores[: len(chosen_ids)], scores[len(chosen_ids) :]
    kinds = eval_ds["kind"] if "kind" in eval_ds.column_names else None
    summary = pairwise_summary(chosen, rejected, kinds)
    stats = {"mean": summary["mean"], "std": summary["std"], "n": 2 * summary["n_pairs"]}
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    plot_calibration(chosen, rejected, out / CALIBRATION_PLOT, summary["accuracy"])
    summary["files"] = {"stats": str(out / STATS_FILE), "plot": str(out / CALIBRATION_PLOT)}
    (out / CALIBRATION_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def run_reward_stage(
    model_path: str | Path, train_ds: Dataset, eval_ds: Dataset, output_dir: str | Path, **config_kwargs: Any
) -> dict[str, Any]:
    """Train, then calibrate on ``eval_ds`` (main process) into ``output_dir``, with a copy of ``reward_stats.json``
    in ``output_dir/final``. Returns the calibration summary (empty on other processes)."""
    trainer = train_reward_model(model_path, train_ds, eval_ds, output_dir, **config_kwargs)
    report: dict[str, Any] = {}
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        report = calibration_report(model, trainer.processing_class, eval_ds, output_dir)
        (Path(output_dir) / "final" / STATS_FILE).write_text((Path(output_dir) / STATS_FILE).read_text())
    trainer.accelerator.wait_for_everyone()
    return report


def load_reward_stats(stats: dict[str, float] | str | Path | None, model_path: str | Path) -> dict[str, float]:
    """``{"mean", "std"}`` from a dict, a JSON file, or (None) ``reward_stats.json`` beside or above the model."""
    if isinstance(stats, dict):
        found = stats
    else:
        beside = [Path(model_path) / STATS_FILE, Path(model_path).parent / STATS_FILE]
        candidates = [Path(stats)] if stats is not None else beside
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise FileNotFoundError(
                f"no reward stats at {[str(c) for c in candidates]}; run the calibration report first, "
                "pass stats={'mean': ..., 'std': ...}, or normalize=False"
            )
        found = json.loads(path.read_text())
    mean, std = float(found["mean"]), float(found["std"])
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ValueError(f"reward stats need a finite mean and a std > 0, got mean={mean!r}, std={std!r}")
    return {"mean": mean, "std": std}


class RewardModelReward:
    """A trained reward model as a TRL reward function: ``(prompts, completions) -> (score - mean) / std`` per row
    (``stats``: see :func:`load_reward_stats`; ``normalize=False``: raw scores); a non-finite score is ``None``."""

    def __init__(
        self,
        path: str | Path,
        stats: dict[str, float] | str | Path | None = None,
        *,
        normalize: bool = True,
        device: str | torch.device | None = None,
        batch_size: int = 64,
        dtype: torch.dtype | None = None,
        name: str = "reward_model",
    ) -> None:
        self.path = Path(path)
        self.__name__ = name
        self.batch_size = batch_size
        self.stats = load_reward_stats(stats, path) if normalize else {"mean": 0.0, "std": 1.0}
        self.tokenizer = _load_tokenizer(path)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        self.model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
        if self.model.config.num_labels != 1:
            raise ValueError(f"{path} is not a reward model: num_labels={self.model.config.num_labels}, expected 1")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(device).eval()

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float | None]:
        """Normalised reward for each (prompt, completion); same length as ``completions``."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        ids = [encode_pair(self.tokenizer, p, c) for p, c in zip(prompts, completions, strict=True)]
        raw = score_ids(self.model, ids, self.tokenizer.pad_token_id, self.batch_size) if ids else []
        mean, std = self.stats["mean"], self.stats["std"]
        return [(s - mean) / std if math.isfinite(s) else None for s in raw]

    def __repr__(self) -> str:
        return f"RewardModelReward({str(self.path)!r}, mean={self.stats['mean']:.4g}, std={self.stats['std']:.4g})"


_LOADED: dict[tuple[str, bool], RewardModelReward] = {}


def reward_model_score(
    prompts: Sequence[Any], completions: Sequence[Any], path: str | None = None, normalize: bool = True, **_: Any
) -> list[float | None]:
    """A trained reward model as a config reward function (``kwargs: {path: ..., normalize: ...}``); loads
    :class:`RewardModelReward` once per path and process."""
    if path is None:
        raise ValueError("reward_model_score needs kwargs: {path: <reward model folder>} in the rewards entry")
    key = (str(path), normalize)
    if key not in _LOADED:
        _LOADED[key] = RewardModelReward(path, normalize=normalize)
    return _LOADED[key](prompts, completions)
