"""``model.revision`` (and ``trust_remote_code``) reach every load of the model's files, not only its weights: the
tokenizer, the config read for the prompt-length check, the reward stage's tokenizer and the PPO critic."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import transformers

from steadyrl.config import load_config
from steadyrl.config.sections import PPOSection

HUB = {"revision": "abc123", "trust_remote_code": False}


class Stop(Exception):
    """Raised by a stub once the load under test has been recorded."""


def record(monkeypatch: pytest.MonkeyPatch, cls: type, calls: list[dict[str, Any]]) -> None:
    """``cls.from_pretrained`` records its kwargs (calls from steadyrl or TRL, not transformers' own nested ones),
    then loads the local folder as usual (without the revision, which a local folder does not have)."""
    original = cls.from_pretrained

    def from_pretrained(path: Any, *args: Any, **kwargs: Any) -> Any:
        if "_from_auto" not in kwargs:
            calls.append(dict(kwargs))
        return original(path, *args, **{k: v for k, v in kwargs.items() if k != "revision"})

    monkeypatch.setattr(cls, "from_pretrained", from_pretrained)


def _config(tmp_path: Path, model: Path, algorithm: str) -> Any:
    data = "{path: builtin:arithmetic_preferences, eval_split: eval}" if algorithm == "reward" else (
        "{path: builtin:arithmetic, max_samples: 8}")  # fmt: skip
    rewards = "" if algorithm == "reward" else "rewards: [{fn: exact_match}]\n"
    grpo = "" if algorithm == "reward" else ", num_generations: 4, max_completion_length: 4"
    path = tmp_path / "run.yaml"
    path.write_text(
        f"algorithm: {algorithm}\nmodel: {{path: {model}, revision: abc123}}\ndata: {data}\n{rewards}"
        f"trainer: {{output_dir: {tmp_path / 'out'}, bf16: false, report_to: [], per_device_train_batch_size: 4"
        f"{grpo}}}\n"
    )
    return load_config(path)


def test_grpo_tokenizer_config_and_weights_load_the_same_revision(tmp_path, tiny_model_dir, monkeypatch) -> None:
    from steadyrl.trainers import build, grpo

    tokenizer, config, trainer = [], [], []
    record(monkeypatch, transformers.AutoTokenizer, tokenizer)
    record(monkeypatch, transformers.AutoConfig, config)

    def stub_trainer(**kwargs: Any) -> None:
        trainer.append(kwargs["args"].model_init_kwargs)
        raise Stop

    monkeypatch.setattr(grpo, "SteadyGRPOTrainer", stub_trainer)
    with pytest.raises(Stop):
        build.build_trainer(_config(tmp_path, tiny_model_dir, "grpo"))
    assert tokenizer == [HUB]  # the processing class
    # the storage plan's parameter count (steadyrl.storage), then max_position_embeddings for the prompt-length check
    assert config == [HUB, HUB]
    assert trainer[0]["revision"] == "abc123"  # the weights (TRL's from_pretrained kwargs)


def test_reward_stage_tokenizer_loads_the_weights_revision(tmp_path, tiny_model_dir, monkeypatch) -> None:
    import trl

    from steadyrl.trainers import build

    tokenizer, trainer = [], []
    record(monkeypatch, transformers.AutoTokenizer, tokenizer)

    def stub_trainer(**kwargs: Any) -> None:
        trainer.append((kwargs["args"].model_init_kwargs, kwargs["args"].trust_remote_code))
        raise Stop

    monkeypatch.setattr(trl, "RewardTrainer", stub_trainer)
    with pytest.raises(Stop):
        build.run_reward(_config(tmp_path, tiny_model_dir, "reward"))
    assert tokenizer == [HUB]
    assert trainer[0][0]["revision"] == "abc123" and trainer[0][1] is False


def test_ppo_critic_from_the_policy_loads_its_revision(tiny_model_dir, monkeypatch) -> None:
    from steadyrl.trainers.ppo import SteadyPPOTrainer

    config, model = [], []
    record(monkeypatch, transformers.AutoConfig, config)
    record(monkeypatch, transformers.AutoModel, model)
    trainer = SimpleNamespace(
        ppo=PPOSection(), args=SimpleNamespace(model_init_kwargs={"dtype": "float32", "revision": "abc123"},
                                               trust_remote_code=False))  # fmt: skip
    policy = SimpleNamespace(config=SimpleNamespace(_name_or_path=str(tiny_model_dir)))
    critic = SteadyPPOTrainer._load_critic(trainer, policy, None)
    assert critic.init_source == "policy"
    assert config == [HUB]
    assert model == [{"dtype": "float32", **HUB}]
