"""Shared helpers for integration tests: tiny GRPO configs and state comparisons."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from trl import GRPOConfig

from steadyrl.tasks import arithmetic_dataset


def grpo_args(output_dir: Path | str, config_cls: type = GRPOConfig, **overrides: Any) -> GRPOConfig:
    """A few-second GRPO config for the tiny model on CPU (``config_cls``: GRPOConfig or a subclass)."""
    kwargs: dict[str, Any] = dict(
        output_dir=str(output_dir),
        max_steps=3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        learning_rate=1e-3,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def small_dataset():
    return arithmetic_dataset("train", max_operand=9, eval_size=10)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


def per_step(log_history: list[dict[str, Any]], key: str) -> list[float]:
    return [row[key] for row in log_history if key in row]


def byte_mean(completions: list[str], **_: Any) -> list[float]:
    """A dense test reward that varies even for a random model: mean UTF-8 byte value / 255."""
    out = []
    for c in completions:
        data = c.encode()
        out.append(sum(data) / (255 * len(data)) if data else 0.0)
    return out


def hostile_reward(completions: list[str], trainer_state: Any = None, **_: Any) -> list[float | None]:
    """byte_mean, except: every 7th completion scores 1e9, every 11th inf, every 13th None (unscorable)."""
    out: list[float | None] = []
    for i, value in enumerate(byte_mean(completions)):
        if i % 13 == 12:
            out.append(None)
        elif i % 11 == 10:
            out.append(float("inf"))
        elif i % 7 == 6:
            out.append(1e9)
        else:
            out.append(value)
    return out


def tiny_grpo_trainer(model_dir: Path | str, out: Path | str, guards: Any = None, **args: Any):
    """A ``SteadyGRPOTrainer`` on the tiny model and dataset with the dense ``byte_mean`` reward; ``guards`` are its
    ``GuardParts`` fields (``quatro=...``, ...), ``args`` override ``grpo_args``."""
    from transformers import AutoTokenizer

    from steadyrl.trainers import SteadyGRPOTrainer
    from steadyrl.trainers.layers import GuardParts

    return SteadyGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(out, **args),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        guards=guards if isinstance(guards, GuardParts) else GuardParts(**(guards or {})),
    )


class TrainedOn:
    """What TRL's own loss trains on, next to what TRL generated and scored (a spy on ``GRPOTrainer``'s methods).

    ``generations``: one entry per training generation batch, in TRL's row order (before any shuffle or split):
    its ``index``, ``rewards_per_func`` (gathered, (N, num_funcs)) and ``rows`` (this rank's (prompt_ids,
    completion_ids) keys).
    ``losses``: one entry per loss call: the generation it trains on, its row keys and ``inputs["advantages"]``.
    ``expected_advantages(fn)`` pairs every loss row with its generation row, so a test compares, element by
    element, the advantages the loss received with ``fn(generation)`` (the guard's output, computed independently).
    """

    def __init__(self, monkeypatch: Any) -> None:
        from trl import GRPOTrainer

        self.generations: list[dict[str, Any]] = []
        self.losses: list[dict[str, Any]] = []
        calculate, generate, loss = (
            GRPOTrainer._calculate_rewards,
            GRPOTrainer._generate_and_score_completions,
            GRPOTrainer._compute_loss,
        )
        pending: dict[str, Any] = {}

        def spy_calculate(trainer, *args, **kwargs):
            out = calculate(trainer, *args, **kwargs)
            pending["rewards_per_func"] = out.detach().clone()
            return out

        def spy_generate(trainer, *args, **kwargs):
            out = generate(trainer, *args, **kwargs)
            if trainer.model.training:
                rewards = pending.pop("rewards_per_func")
                index = len(self.generations)
                self.generations.append({"index": index, "rewards_per_func": rewards, "rows": _row_keys(out)})
            return out

        def spy_loss(trainer, model, inputs):
            if trainer.model.training:
                advantages = inputs["advantages"].detach().clone()
                entry = {"generation": len(self.generations) - 1, "rows": _row_keys(inputs), "advantages": advantages}
                self.losses.append(entry)
            return loss(trainer, model, inputs)

        monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", spy_calculate)
        monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", spy_generate)
        monkeypatch.setattr(GRPOTrainer, "_compute_loss", spy_loss)

    def expected_advantages(self, fn: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each loss call: (advantages the loss received, ``fn(generation)`` of the same rows in the same order).

        ``fn(generation)`` -> one value per row of the generation (this rank's rows, TRL's order). Rows are matched
        by their (prompt, completion) token ids; identical rows are matched as a multiset.
        """
        out = []
        for entry in self.losses:
            generation = self.generations[entry["generation"]]
            values = fn(generation)
            by_key: dict[tuple, list[float]] = {}
            for key, value in zip(generation["rows"], values.tolist(), strict=True):
                by_key.setdefault(key, []).append(value)
            received = entry["advantages"].double()
            expected = []
            for key, got in zip(entry["rows"], received.tolist(), strict=True):
                candidates = by_key[key]
                # identical rows of one generation: take the candidate equal to what the loss got, else the first
                pick = next((i for i, c in enumerate(candidates) if c == got), 0)
                expected.append(candidates.pop(pick))
            out.append((received, torch.tensor(expected, dtype=torch.float64)))
        return out


def _row_keys(batch: dict[str, Any]) -> list[tuple]:
    prompts, completions = batch["prompt_ids"], batch["completion_ids"]
    return [(*p.tolist(), -1, *c.tolist()) for p, c in zip(prompts, completions, strict=True)]


def _grade_scaler() -> type:
    from steadyrl.guards.reward_scaler import GradeScaler

    class RecordingGrade(GradeScaler):
        """GRADE that keeps each call's raw input and output (``inputs``, ``outputs``: one (N,) tensor per
        generation batch)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.inputs: list[torch.Tensor] = []
            self.outputs: list[torch.Tensor] = []

        def __call__(self, rewards: torch.Tensor, prompts: list[Any], num_generations: int) -> torch.Tensor:
            self.inputs.append(rewards.detach().clone())
            out = super().__call__(rewards, prompts, num_generations)
            self.outputs.append(out.detach().clone())
            return out

    return RecordingGrade


RecordingGrade = _grade_scaler()


_FLAKY_CALLS = {"n": 0}


def flaky_reward(completions: list[str], fail_calls: list[int] = (), fail_from: int | None = None, **_: Any):
    """byte_mean, except that call number k (1-based, counted per process) raises ConnectionError when k is in
    ``fail_calls`` or k >= ``fail_from``: a reward server that drops requests."""
    _FLAKY_CALLS["n"] += 1
    call = _FLAKY_CALLS["n"]
    if call in fail_calls or (fail_from is not None and call >= fail_from):
        raise ConnectionError(f"reward server dropped call {call}")
    return byte_mean(completions)


_JUDGE_CALLS = {"n": 0}


async def async_judge(completions: list[str], hang_calls: list[int] = (), **_: Any) -> list[float]:
    """An LLM judge's shape: ``async def``, awaiting its service; byte_mean, except that call number k (1-based, per
    process) in ``hang_calls`` never answers."""
    _JUDGE_CALLS["n"] += 1
    await asyncio.sleep(3600 if _JUDGE_CALLS["n"] in hang_calls else 0)
    return byte_mean(completions)


QUIET_TRAINER = {  # trainer keys of a config-built test run: CPU fp32, one row per step, no saves, no terminal output
    "logging_steps": 1,
    "bf16": False,
    "report_to": [],
    "save_strategy": "no",
    "disable_tqdm": True,
    "activation_checkpointing": False,
}


def write_config(tmp_path: Any, tree: dict[str, Any]) -> Any:
    """``tree`` as ``tmp_path/cfg.yaml``, loaded as steadyrl loads a config file."""
    import yaml

    from steadyrl.config import load_config

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tree))
    return load_config(path)
