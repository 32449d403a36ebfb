"""The reward-model stage (SFT -> **RM** -> PPO): train with TRL's RewardTrainer, calibrate, serve as a reward.

docs/DESIGN.md, "Reward-model stage": a Bradley-Terry reward model on (chosen, rejected) pairs; after training, a
held-out calibration set checks that it separates good from bad answers (below 60% pairwise accuracy: retrain before
any RL), and its output is normalised (mean, std) so the RL stage sees rewards on a stable scale.

- ``train_reward_model``: ``trl.RewardTrainer`` on the SFT checkpoint, saved to ``output_dir/final``;
- ``calibration_report``: ``calibration.json``, ``reward_stats.json`` (mean/std of chosen + rejected scores) and
  ``calibration.png``;
- ``RewardModelReward`` / ``reward_model_score``: the trained model as a TRL reward function (normalised scores; one
  load per path and process), e.g. ``rewards: [{fn: steadyrl.ppo.reward_stage:reward_model_score, kwargs: {path:
  runs/tiny-rm/final}}]``;
- ``run_reward_stage``: train + calibrate, what ``steadyrl reward CONFIG`` runs.

Calibration and ``RewardModelReward`` score exactly the token ids ``RewardTrainer`` trained on (``prompt +
completion + eos``, read at the last non-pad token); TRL's built-in reward-model path in GRPO scores without EOS,
at a position the model was not trained to score.
"""


from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn

logger = logging.getLogger(__name__)

ACCURACY_WARNING = (
    0.60  # docs/DESIGN.md "Reward-model stage": below 60% pairwise accuracy, retrain the reward model first
)
STATS_FILE = "reward_stats.json"
CALIBRATION_FILE = "calibration.json"
CALIBRATION_PLOT = "calibration.png"


# ------------------------------------------------------------------------------------------------ encoding


def encode_pair(tokenizer: Any, prompt: Any, completion: Any) -> list[int]:
    """Token ids of ``prompt + completion`` exactly as ``trl.RewardTrainer`` builds them for training.

    Text: ``prompt + completion``, with the EOS token appended unless already there, tokenized with the
    tokenizer's defaults. Conversational (message lists): ``apply_chat_template(prompt + completion)``.
    """
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
            chunk = [list(x) for x in ids[start : start + batch_size]]
            width = max(len(x) for x in chunk)
            input_ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, x in enumerate(chunk):
                input_ids[row, : len(x)] = torch.tensor(x, dtype=torch.long)
                attention_mask[row, : len(x)] = 1
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
    finally:
        model.train(was_training)
    return scores


# ------------------------------------------------------------------------------------------------ training


def _load_tokenizer(model_path: str | Path, **hub_kwargs: Any) -> Any:
    """The tokenizer of ``model_path`` (``hub_kwargs``: the ``revision`` / ``trust_remote_code`` its weights use)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, **hub_kwargs)
    if tokenizer.pad_token is None:  # sequence classifiers need a pad token to find the last real token
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _bf16_default() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def train_reward_model(
    model_path: str | Path,
    train_ds: Dataset,
    eval_ds: Dataset | None,
    output_dir: str | Path,
    **reward_config_kwargs: Any,
) -> Any:
    """Train a Bradley-Terry reward model with ``trl.RewardTrainer``; save it to ``output_dir/final``.

    model_path: a causal-LM (or reward-model) folder; TRL loads it as ``AutoModelForSequenceClassification`` with
    ``num_labels=1`` (fresh ``score`` head, seeded by ``seed``). train_ds/eval_ds: ``prompt``/``chosen``/``rejected``
    rows (e.g. :func:`steadyrl.tasks.preferences.arithmetic_preferences`). ``reward_config_kwargs`` are
    ``trl.RewardConfig`` fields; defaults that differ from TRL's: ``report_to=[]``, and ``bf16`` only where a GPU
    supports it. Returns the ``RewardTrainer`` (model, tokenizer and ``state.log_history`` on it).
    """
    import dataclasses

    from trl import RewardConfig, RewardTrainer

    from steadyrl.config.schema import rename_for_installed

    kwargs = {"report_to": [], "bf16": _bf16_default(), **reward_config_kwargs, "output_dir": str(output_dir)}
    rename_for_installed(kwargs, {f.name for f in dataclasses.fields(RewardConfig)}, {})  # activation_checkpointing
    args = RewardConfig(**kwargs)
    init_kwargs = args.model_init_kwargs or {}  # the weights' revision and trust_remote_code go to the tokenizer too
    hub_kwargs = {"trust_remote_code": init_kwargs.get("trust_remote_code", args.trust_remote_code)}
    if init_kwargs.get("revision") is not None:
        hub_kwargs["revision"] = init_kwargs["revision"]
    tokenizer = _load_tokenizer(model_path, **hub_kwargs)
    from steadyrl.callbacks.progress import terminal_callbacks

    trainer = RewardTrainer(
        model=str(model_path), args=args, train_dataset=train_ds, eval_dataset=eval_ds, processing_class=tokenizer,
        callbacks=terminal_callbacks(),
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))
    return trainer


# --------------------------------------------------------------------------------------------- calibration


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(t.mean()), float(t.std()) if len(values) > 1 else 0.0


def pairwise_summary(
    chosen: Sequence[float], rejected: Sequence[float], kinds: Sequence[str] | None = None
) -> dict[str, Any]:
    """Calibration numbers from paired scores (pure): accuracy, ties, margin, score mean/std, per-kind accuracy.

    ``accuracy`` = share of pairs with ``chosen > rejected`` strictly (a tie counts as wrong, as in TRL's metric).
    ``mean``/``std`` are over all ``2n`` scores (unbiased std): the normalisation for RL rewards. Logs a WARNING when
    accuracy is below :data:`ACCURACY_WARNING`.
    """
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
            'RL (docs/DESIGN.md, "Reward-model stage")',
            accuracy,
            n,
            ACCURACY_WARNING,
        )
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
    ax.set_title(f"Reward model calibration: pairwise accuracy {accuracy:.1%}")
    ax.set_xlabel("reward score (raw)")
    ax.set_ylabel("count")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def calibration_report(
    model: nn.Module, tokenizer: Any, eval_ds: Dataset, output_dir: str | Path, *, batch_size: int = 64
) -> dict[str, Any]:
    """Score the held-out pairs; write ``calibration.json``, ``reward_stats.json`` and ``calibration.png``.

    eval_ds: ``chosen``/``rejected`` and optionally ``prompt`` and ``kind`` columns. Returns the summary of
    :func:`pairwise_summary` plus the file paths. ``reward_stats.json`` holds ``{"mean", "std", "n"}``, read by
    :class:`RewardModelReward` and ``CriticModel.from_pretrained(reward_stats=...)``.
    """
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
    model_path: str | Path,
    train_ds: Dataset,
    eval_ds: Dataset,
    output_dir: str | Path,
    **reward_config_kwargs: Any,
) -> dict[str, Any]:
    """Train (:func:`train_reward_model`), then calibrate on ``eval_ds`` (main process only).

    Writes the calibration files to ``output_dir`` and copies ``reward_stats.json`` into ``output_dir/final`` so
    the final folder alone is a usable reward (``RewardModelReward("…/final")``). Returns the calibration summary
    (an empty dict on non-main processes).
    """
    trainer = train_reward_model(model_path, train_ds, eval_ds, output_dir, **reward_config_kwargs)
    report: dict[str, Any] = {}
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        report = calibration_report(model, trainer.processing_class, eval_ds, output_dir)
        final = Path(output_dir) / "final"
        (final / STATS_FILE).write_text((Path(output_dir) / STATS_FILE).read_text())
    trainer.accelerator.wait_for_everyone()
    return report


# ----------------------------------------------------------------------------------------- reward adapter


def load_reward_stats(stats: dict[str, float] | str | Path | None, model_path: str | Path) -> dict[str, float]:
    """``{"mean", "std"}`` from a dict, a JSON file, or (None) ``reward_stats.json`` beside or above the model."""
    if isinstance(stats, dict):
        found = stats
    else:
        candidates = [Path(stats)] if stats is not None else [Path(model_path) / STATS_FILE]
        if stats is None:
            candidates.append(Path(model_path).parent / STATS_FILE)
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
    """A trained reward model as a TRL reward function: ``(prompts, completions, **kwargs) -> list[float]``.

    Scores ``prompt + completion + eos`` (the RewardTrainer's format, :func:`encode_pair`) and returns
    ``(score - mean) / std`` with the calibration stats (``stats``: a dict, a JSON path, or None to read
    ``reward_stats.json`` from the model folder or its parent); ``normalize=False`` returns raw scores.
    A non-finite score is returned as ``None`` (TRL: unscorable). ``__name__`` (for TRL's metric names) is
    ``name``. Runs the model on ``device`` (default: CUDA if available, else CPU) under ``torch.no_grad``.
    """

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
        from transformers import AutoModelForSequenceClassification

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
    """A trained reward model as a config reward function (``kwargs: {path: ..., normalize: ...}``).

    Loads :class:`RewardModelReward` for ``path`` once per process and caches it; returns its scores.
    """
    if path is None:
        raise ValueError("reward_model_score needs kwargs: {path: <reward model folder>} in the rewards entry")
    key = (str(path), normalize)
    if key not in _LOADED:
        _LOADED[key] = RewardModelReward(path, normalize=normalize)
    return _LOADED[key](prompts, completions)
