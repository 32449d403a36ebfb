"""Config loading: extends, overrides, strict validation, contradictions, shipped configs."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from steadyrl.config import ConfigError, load_config
from steadyrl.config.loader import load_config_tree, parse_override
from steadyrl.config.requirements import installed as module_installed

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").rglob("*.yaml"))
RUN_CONFIGS = [p for p in SHIPPED if "accelerate" not in p.parts]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


BASE = """\
    algorithm: grpo
    model: {path: some/model}
    data: {path: builtin:arithmetic}
    rewards: [{fn: exact_match}]
    trainer:
      output_dir: out
      per_device_train_batch_size: 8
      num_generations: 4
      learning_rate: 1.0e-5
      bf16: false
"""


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return write(tmp_path / "base" / "grpo.yaml", BASE)


def test_extends_deep_merges_child_over_parent(tmp_path: Path, base: Path) -> None:
    child = write(
        tmp_path / "models" / "m.yaml",
        """\
        extends: ../base/grpo.yaml
        model: {path: other/model}
        trainer: {learning_rate: 2.0e-6}
    """,
    )
    cfg = load_config(child)
    assert cfg.model.path == "other/model"
    assert cfg.trainer["learning_rate"] == 2e-6
    assert cfg.trainer["num_generations"] == 4  # inherited
    assert cfg.rewards[0].fn == "exact_match"


def test_overrides_are_yaml_typed(base: Path) -> None:
    cfg = load_config(
        base, ["trainer.learning_rate=1e-6", "trainer.bf16=false", "peft.r=16", "guards.gepo.enabled=false"]
    )
    assert cfg.trainer["learning_rate"] == 1e-6 and isinstance(cfg.trainer["learning_rate"], float)
    assert cfg.peft is not None and cfg.peft.r == 16 and cfg.peft.lora_alpha == 32
    assert cfg.guards.gepo.enabled is False


def test_parse_override() -> None:
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a.b=[x, y]") == (["a", "b"], ["x", "y"])
    with pytest.raises(ConfigError, match=r"section.key=value"):
        parse_override("nonsense")


def test_unknown_key_names_key_file_and_suggestion(tmp_path: Path, base: Path) -> None:
    child = write(tmp_path / "c.yaml", "extends: base/grpo.yaml\nmodel: {pth: x}\n")
    with pytest.raises(ConfigError) as err:
        load_config(child)
    msg = str(err.value)
    assert "model.pth" in msg and str(child) in msg and "Did you mean 'path'" in msg


def test_unknown_trainer_key_did_you_mean(base: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"unknown key 'learnig_rate' for trl.GRPOConfig. Did you mean 'learning_rate'"
    ):
        load_config(base, ["trainer.learnig_rate=1e-5"])


def test_unknown_top_level_section(base: Path) -> None:
    with pytest.raises(ConfigError, match=r"Did you mean 'rewards'"):
        load_config(base, ["reward.x=1"])


def test_wrong_type_is_an_error(base: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer.num_generations .*expected int"):
        load_config(base, ["trainer.num_generations=four"])
    with pytest.raises(ConfigError, match=r"peft.r .*expected int"):
        load_config(base, ["peft.r=[1]"])


def test_missing_required_key(tmp_path: Path) -> None:
    cfg = write(tmp_path / "c.yaml", "model: {path: m}\ntrainer: {output_dir: o}\n")
    with pytest.raises(ConfigError, match=r"data: required key is missing"):
        load_config(cfg)


def test_extends_cycle_is_reported(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle"):
        load_config_tree(tmp_path / "a.yaml")


def test_num_generations_must_divide_generation_batch(base: Path) -> None:
    with pytest.raises(ConfigError, match=r"num_generations=3 does not divide the generation batch of 8"):
        load_config(base, ["trainer.num_generations=3"])
    # with two processes the generation batch is 16: 16 % 8 == 0 is fine, 16 % 6 is not
    load_config(base, ["trainer.num_generations=8"], world_size=2)
    with pytest.raises(ConfigError, match=r"generation batch of 16"):
        load_config(base, ["trainer.num_generations=6"], world_size=2)


def test_peft_on_top_of_an_adapter_is_a_contradiction(tmp_path: Path, base: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is a LoRA adapter.*merge"):
        load_config(base, [f"model.path={adapter}", "peft.r=8"])


def test_vllm_without_vllm_installed(base: Path) -> None:
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError, match=r"vllm is not installed"):
        load_config(base, ["trainer.use_vllm=true"])


def test_checkpointing_keys_follow_the_installed_transformers() -> None:
    from steadyrl.config.schema import rename_for_installed

    before_5_20 = {"gradient_checkpointing", "gradient_checkpointing_kwargs", "output_dir"}
    trainer = {"activation_checkpointing": False, "activation_checkpointing_kwargs": {"use_reentrant": False}}
    origins = {"trainer.activation_checkpointing": "a.yaml"}
    rename_for_installed(trainer, before_5_20, origins)
    assert trainer == {"gradient_checkpointing": False, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert origins["trainer.gradient_checkpointing"] == "a.yaml"

    only_new = {"activation_checkpointing", "output_dir"}  # a future release that drops the old name
    trainer = {"gradient_checkpointing": True}
    rename_for_installed(trainer, only_new, {})
    assert trainer == {"activation_checkpointing": True}

    both = before_5_20 | {"activation_checkpointing"}  # 5.20+: both spellings are fields, nothing is rewritten
    trainer = {"activation_checkpointing": False}
    rename_for_installed(trainer, both, {})
    assert trainer == {"activation_checkpointing": False}

    for installed in (before_5_20, both):  # both spellings at once: an error whatever the version
        with pytest.raises(ConfigError, match=r"trainer.activation_checkpointing \(set in a.yaml\): trainer.gradi"):
            both_set = {"activation_checkpointing": False, "gradient_checkpointing": True}
            rename_for_installed(both_set, installed, origins)


def test_bf16_without_gpu(base: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=r"set trainer.bf16=false"):
        load_config(base, ["trainer.bf16=true"])


def test_missing_resume_path(base: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(base, ["trainer.resume_from_checkpoint=/no/such/checkpoint"])
    assert load_config(base, ["trainer.resume_from_checkpoint=auto"]).trainer["resume_from_checkpoint"] == "auto"


def test_quatro_section_builds_its_parts(base: Path) -> None:
    on = ["guards.quatro.enabled=true", "trainer.beta=0.04"]
    kl = ["guards.quatro.kl.enabled=true", "guards.quatro.kl.target=0.01"]
    cfg = load_config(base, [*on, "guards.quatro.filters.repetition.n=5", *kl])
    q = cfg.guards.quatro
    assert q.kl.target == 0.01 and q.entropy.floor_ratio == 0.15 and not q.replay.enabled
    filters = q.filters.to_config()
    assert type(filters).__name__ == "FilterConfig" and filters.repetition.n == 5 and filters.max_drop_share == 0.5
    from steadyrl.trainers.build import guard_parts

    parts = guard_parts(cfg).quatro
    assert parts.kl.target == 0.01 and parts.filters.repetition.n == 5 and parts.entropy is not None
    assert guard_parts(load_config(base, on)).quatro.kl is None  # the adaptive KL controller is off by default
    off = load_config(base, [*on, "guards.quatro.filters.enabled=false", "guards.quatro.entropy.enabled=false"])
    assert guard_parts(off).quatro.filters is None and guard_parts(off).quatro.entropy is None
    with pytest.raises(ConfigError, match=r"filters.parrot.max_overlap \(set in command line\): must be in \[0, 1\]"):
        load_config(base, [*on, "guards.quatro.filters.parrot.max_overlap=1.5"])
    with pytest.raises(ConfigError, match=r"guards.quatro.kl.up \(set in command line\): must be finite and > 1"):
        load_config(base, [*on, "guards.quatro.kl.up=0.9"])


def test_quatro_contradictions_name_the_fix(base: Path) -> None:
    # TRL's default beta 0: valid, the KL controller is inactive at run time (it starts where TRL starts)
    assert load_config(base, ["guards.quatro.enabled=true"]).trainer.get("beta", 0.0) == 0.0
    with pytest.raises(ConfigError, match=r"trainer.beta=-0.1 is negative"):
        load_config(base, ["guards.quatro.enabled=true", "trainer.beta=-0.1"])
    assert load_config(base, ["guards.quatro.enabled=true", "guards.quatro.kl.enabled=false"]).guards.quatro.enabled
    # the absolute bounds were removed (CHANGELOG, "Removed options"): a config that still sets one fails by name
    with pytest.raises(ConfigError, match=r"guards.quatro.kl.beta_min \(set in command line\): unknown key 'beta_min'"):
        load_config(base, ["guards.quatro.enabled=true", "trainer.beta=0.04", "guards.quatro.kl.beta_min=0.01"])
    cfg = load_config(base, ["guards.quatro.enabled=true", "trainer.beta=2.0", "guards.quatro.kl.target=auto"])
    assert cfg.guards.quatro.kl.bounds(2.0) == (2.0, 8.0)  # beta_range is relative: any trainer.beta > 0 fits
    # TRL's own adaptive entropy, set by the user, wins over the floor at run time (a logged warning)
    assert load_config(base, ["guards.quatro.enabled=true", "trainer.use_adaptive_entropy=true"]).guards.quatro.enabled
    from steadyrl.trainers.build import guard_parts

    replay_on = ["guards.quatro.enabled=true", "trainer.beta=0.04", "guards.quatro.replay.enabled=true"]
    replay = guard_parts(load_config(base, replay_on)).quatro.replay
    assert type(replay).__name__ == "ReplayConfig" and (replay.capacity, replay.replay_ratio) == (8, 0.3)
    # per_device_train_batch_size 8: 0.0625 x 8 = 0.5 -> 1 row (half up); 0.9 x 8 = 7.2 -> 7 (1 fresh row) are fine
    for ratio in (0.0625, 0.9):
        assert load_config(
            base, [*replay_on, f"guards.quatro.replay.replay_ratio={ratio}"]
        ).guards.quatro.replay.enabled
    with pytest.raises(ConfigError, match=r"ratio=0.05 x .*batch_size=8 gives 0 replayed rows .* change replay_ratio"):
        load_config(base, [*replay_on, "guards.quatro.replay.replay_ratio=0.05"])
    with pytest.raises(ConfigError, match=r"ratio=0.95 x .*batch_size=8 gives 8 replayed rows .* at least 1 fresh row"):
        load_config(base, [*replay_on, "guards.quatro.replay.replay_ratio=0.95"])
    with pytest.raises(ConfigError, match=r"quatro.replay.capacity \(set in command line\): must be >= 1, got 0"):
        load_config(base, [*replay_on, "guards.quatro.replay.capacity=0"])


def test_entropy_gate_reward_must_name_a_grpo_reward(base: Path) -> None:
    """``gate_reward`` names a reward of the run (weight 0 allowed); a typo, a PPO run or a gate that is off are
    refused at load time with the fix."""
    on = ["guards.quatro.enabled=true", "trainer.beta=0.04"]
    watched = "rewards=[{name: proxy, fn: exact_match}, {name: verifier, fn: exact_match, weight: 0.0}]"
    cfg = load_config(base, [*on, watched, "guards.quatro.entropy.gate_reward=verifier"])
    assert cfg.guards.quatro.entropy.gate_reward == "verifier"
    assert load_config(base, on).guards.quatro.entropy.gate_reward is None  # default: the weighted reward
    with pytest.raises(ConfigError, match=r"'verfier' is not a reward name; valid: \['proxy', 'verifier'\]"):
        load_config(base, [*on, watched, "guards.quatro.entropy.gate_reward=verfier"])
    with pytest.raises(ConfigError, match=r"'verifier' is read only by the learning gate.*learning_gate: t"):
        load_config(base, [*on, watched, "guards.quatro.entropy.gate_reward=verifier",
                           "guards.quatro.entropy.learning_gate=false"])  # fmt: skip
    ppo = [*on, watched, "algorithm=ppo", "trainer.num_generations=1", "guards.quatro.filters.enabled=false",
           "guards.gepo.enabled=false", "guards.quatro.entropy.gate_reward=verifier"]  # fmt: skip
    with pytest.raises(ConfigError, match=r"gate_reward='verifier' reads one reward function's column .* PPO"):
        load_config(base, ppo)


def test_opefo_section_validates_its_parts(base: Path) -> None:
    cfg = load_config(base, ["guards.opefo.enabled=true", "guards.opefo.rollback.storage=disk"])
    opefo = cfg.guards.opefo.to_config()
    assert opefo.enabled and opefo.error_feedback.weights == (0.3, 0.3, 0.2, 0.2)
    assert not opefo.error_feedback.enabled  # off by default: it cost a SmolLM2 run 36 points after a spike
    assert opefo.rollback.storage == "disk" and opefo.floor.interval == 100
    with pytest.raises(
        ConfigError, match=r"guards.opefo.rollback.storage \(set in command line\): must be one of \['memory', 'disk'\]"
    ):
        load_config(base, ["guards.opefo.enabled=true", "guards.opefo.rollback.storage=tape"])
    with pytest.raises(ConfigError, match=r"guards.opefo.error_feedback"):
        load_config(base, ["guards.opefo.error_feedback.weights=[0.5, 0.6]"])


def test_broken_reward_function_fails_at_validation(base: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module'"):
        load_config(base, ["rewards=[{fn: 'no_such_module:f'}]"])
    with pytest.raises(ConfigError, match=r"not a built-in"):
        load_config(base, ["rewards=[{fn: exact_matc}]"])
    with pytest.raises(ConfigError, match=r"exactly one of `fn`"):
        load_config(base, ["rewards=[{weight: 1.0}]"])


def test_reward_weights_come_from_the_rewards_list(base: Path) -> None:
    with pytest.raises(ConfigError, match=r"weight"):
        load_config(base, ["trainer.reward_weights=[1.0]"])


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_validates(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("#"), "each shipped config starts with a comment naming its launch command"
    overrides = []
    import torch

    if not torch.cuda.is_available():  # GPU configs ask for bf16/vllm; validate the rest of them here
        tree, _ = load_config_tree(path)
        overrides = [f"trainer.{k}=false" for k in ("bf16", "use_vllm") if tree.get("trainer", {}).get(k)]
        if tree.get("trainer", {}).get("report_to") and not module_installed(
            "tensorboard"
        ):  # the gpu extra's; see below
            overrides.append("trainer.report_to=[]")
    cfg = load_config(path, overrides, world_size=8 if "models" in path.parts else 1)
    assert cfg.trainer["output_dir"]


GPU_EXTRA_MODULES = ("tensorboard", "math_verify", "deepspeed")


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_configs_name_the_extra_they_need(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the gpu extra's packages, a config that needs them fails validation naming each one and the extra;
    the header of every config that needs them names the extra too."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in GPU_EXTRA_MODULES else real(n, *a))
    tree, _ = load_config_tree(path)
    trainer = tree.get("trainer", {})
    overrides = [f"trainer.{k}=false" for k in ("bf16", "use_vllm") if trainer.get(k)]
    needs = []  # (package named, install command named)
    if trainer.get("report_to"):
        needs.append(("'tensorboard'", "pip install -e .[gpu]"))
    fns = [r.get("fn") for r in tree.get("rewards", [])]
    if "trl.rewards:accuracy_reward" in fns:
        needs.append(("'math_verify'", "pip install -e .[gpu]"))
    if "math_answer" in fns:
        needs.append(("'math_verify'", "pip install -e .[real]"))
    world_size = 8 if "models" in path.parts else 1
    if not needs:
        load_config(path, overrides, world_size=world_size)
        return
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides, world_size=world_size)
    message = str(info.value)
    assert message.startswith("missing package(s) this config needs")
    assert all(package in message and install in message for package, install in needs), message
    if "models" in path.parts:
        header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
        assert "pip install -e .[gpu]" in header, "the config's header names the extra to install"


def test_deepspeed_accelerate_config_needs_deepspeed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from steadyrl.config.requirements import check_requirements, deepspeed_accelerate_config

    assert deepspeed_accelerate_config(REPO / "configs/accelerate/zero2.yaml")
    assert not deepspeed_accelerate_config(REPO / "configs/accelerate/multi_cpu.yaml")
    cfg = load_config(REPO / "configs/tiny/grpo.yaml")
    check_requirements(cfg, REPO / "configs/accelerate/zero2.yaml")  # deepspeed is in the dev extra
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a))
    with pytest.raises(ConfigError, match=r"zero2.yaml \(distributed_type: DEEPSPEED\) needs the 'deepspeed'"):
        check_requirements(cfg, REPO / "configs/accelerate/zero2.yaml")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=r"DeepSpeed launch \(ACCELERATE_USE_DEEPSPEED\) needs the 'deepspeed'"):
        load_config(REPO / "configs/tiny/grpo.yaml")


def test_gpu_only_backend_on_cpu(base: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match=r"set trainer.ddp_backend=gloo"):
        load_config(base, ["trainer.ddp_backend=nccl"], world_size=2)


def test_yaml_no_read_as_boolean_gets_a_quoting_hint(base: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer.save_strategy .*boolean False.*quote the value"):
        load_config(base, ["trainer.save_strategy=no"])
    assert load_config(base, ['trainer.save_strategy="no"']).trainer["save_strategy"] == "no"


def test_spike_skip_needs_clipping_outside_deepspeed(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    with pytest.raises(ConfigError, match=r"and guards.opefo need trainer.max_grad_norm > 0"):
        load_config(base, ["guards.gepo.enabled=true", "trainer.max_grad_norm=0"])


def test_spike_skip_under_deepspeed_accepts_zero2_and_rejects_zero3(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", raising=False)
    ds = tmp_path / "ds.json"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    # ZeRO-2: the hook sits in DeepSpeed's own step, which computes the norm whether or not it clips
    assert load_config(base, ["guards.gepo.enabled=true", "trainer.max_grad_norm=0"]).guards.gepo.spike.enabled
    ds.write_text('{"zero_optimization": {"stage": 3}}')
    with pytest.raises(ConfigError, match=r"this launch uses ZeRO stage 3; use stage 2"):
        load_config(base, ["guards.gepo.enabled=true"])
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    ds.write_text('{"zero_optimization": {"stage": 2}}')  # the launcher's env wins over the file
    with pytest.raises(ConfigError, match=r"ZeRO stage 3"):
        load_config(base, ["guards.gepo.enabled=true"])


def test_grade_kl_compensation_needs_a_kl_term_and_a_sane_range(base: Path) -> None:
    on = ["guards.grade.enabled=true", "guards.grade.kl_compensation=true"]
    with pytest.raises(ConfigError, match=r"trainer.beta is 0 \(no KL term"):
        load_config(base, [*on, "trainer.beta=0.0"])
    with pytest.raises(ConfigError, match=r"kl_compensation_range must be \[lo, hi\] with 0 < lo <= 1 <= hi"):
        load_config(base, [*on, "trainer.beta=0.04", "guards.grade.kl_compensation_range=[1.5, 2.0]"])
    cfg = load_config(base, [*on, "trainer.beta=0.04"])
    assert cfg.guards.grade.kl_compensation_range == [0.5, 2.0]


def test_what_a_guard_cannot_protect_is_refused(base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OPEFO with a non-Adam optimizer state, FSDP with a step guard, ZeRO-Offload with error feedback, DeepSpeed
    without gradient norms with a step guard: each a config error naming the cause and the fix (issue 14)."""
    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    opefo, gepo = ["guards.opefo.enabled=true"], ["guards.gepo.enabled=true"]
    for optim in ("adafactor", "sgd", "adamw_bnb_8bit"):
        with pytest.raises(ConfigError, match=rf"trainer.optim={optim} keeps another state.*Set trainer.optim"):
            load_config(base, [*opefo, f"trainer.optim={optim}"])
    assert load_config(base, [*opefo, "trainer.optim=adamw_torch"]).guards.opefo.enabled
    assert load_config(base, ["trainer.optim=sgd"]).trainer["optim"] == "sgd"  # no OPEFO: nothing to protect
    with pytest.raises(ConfigError, match=r"under FSDP each rank holds a shard.*Use DDP or DeepSpeed ZeRO-2"):
        load_config(base, [*gepo, "trainer.fsdp=full_shard"])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match=r"under FSDP"):
        load_config(base, opefo)
    monkeypatch.delenv("ACCELERATE_USE_FSDP")

    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}')
    ef_on = [*opefo, "guards.opefo.error_feedback.enabled=true"]  # off by default
    with pytest.raises(ConfigError, match=r"ZeRO-Offload \(offload_optimizer.device=cpu\).*feedback.enabled=false"):
        load_config(base, [*ef_on, f"trainer.deepspeed={ds}"])
    assert load_config(base, [*opefo, f"trainer.deepspeed={ds}"]).guards.opefo.enabled
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "nvme")  # the accelerate plugin, no JSON
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    with pytest.raises(ConfigError, match=r"offload_optimizer.device=nvme"):
        load_config(base, ef_on)
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE")

    ds.write_text('{"zero_optimization": {"stage": 2, "compute_grad_norm": false}}')
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
    for guards in (gepo, opefo):
        with pytest.raises(ConfigError, match=r"compute_grad_norm is false.*would never run"):
            load_config(base, guards)
    ds.write_text('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}')
    with pytest.raises(ConfigError, match=r"optimizer.type is 'lamb', whose state OPEFO cannot read"):
        load_config(base, opefo)
    ds.write_text('{"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}')
    assert load_config(base, [*opefo, *gepo]).guards.opefo.enabled


GUARD_LAYERS = ("gepo", "opefo", "quatro", "grade")


def test_deepspeeds_decoupled_checkpoint_engines_are_refused(base: Path, tmp_path: Path) -> None:
    """A decoupled engine (checkpoint.writer.decoupled, datastates_ckpt) commits a checkpoint at a later optimizer step,
    after steadyrl has published the staged folder: refused, guards on or off; a synchronous writer is kept."""
    ds = tmp_path / "ds.json"
    for tree, what in (
        ({"checkpoint": {"writer": {"type": "fast", "decoupled": True}}}, "checkpoint.writer.decoupled: true"),
        ({"datastates_ckpt": {}}, "datastates_ckpt"),
    ):
        ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, **tree}))
        with pytest.raises(ConfigError, match=rf"config's {re.escape(what)} writes each checkpoint in the background"):
            load_config(base, [f"trainer.deepspeed={ds}"])
        with pytest.raises(ConfigError, match=r"the published checkpoint would lack the optimizer state"):
            load_config(base, [f"trainer.deepspeed={ds}", *(f"guards.{g}.enabled=false" for g in GUARD_LAYERS)])
    for tree in ({"checkpoint": {"writer": {"type": "fast", "decoupled": False}}}, {"datastates_ckpt": False}):
        ds.write_text(json.dumps({"zero_optimization": {"stage": 2}, **tree}))
        assert load_config(base, [f"trainer.deepspeed={ds}"]).trainer["deepspeed"] == str(ds)


# ------------------------------------------------------------------ typos keep their origin (issue 15)

VALID_OPEFO = "['enabled', 'error_feedback', 'floor', 'mode', 'rollback']"


def _error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def test_misspelt_section_names_its_file(tmp_path: Path, base: Path) -> None:
    child = write(tmp_path / "c.yaml", "extends: base/grpo.yaml\nguards:\n  opefo:\n    rollbak: {enabled: false}\n")
    assert _error(child) == (
        f"guards.opefo.rollbak (set in {child}): unknown key 'rollbak'. Did you mean 'rollback'? "
        f"Valid keys here: {VALID_OPEFO}"
    )


def test_misspelt_section_names_the_command_line(base: Path) -> None:
    assert _error(base, ["guards.opefo.rollbak.enabled=false"]) == (
        "guards.opefo.rollbak (set in command line): unknown key 'rollbak'. Did you mean 'rollback'? "
        f"Valid keys here: {VALID_OPEFO}"
    )


def test_misspelt_key_in_a_list_entry_names_its_file_or_the_command_line(tmp_path: Path, base: Path) -> None:
    child = write(
        tmp_path / "c.yaml", "extends: base/grpo.yaml\nrewards:\n  - fn: exact_match\n  - {fn: x:y, wieght: 2}\n"
    )
    assert _error(child).startswith(f"rewards[1].wieght (set in {child}): unknown key 'wieght'. Did you mean 'weight'?")
    cli = _error(base, ["rewards=[{fn: exact_match, wieght: 2}]"])
    assert cli.startswith("rewards[0].wieght (set in command line): unknown key 'wieght'. Did you mean 'weight'?")


def test_a_child_list_replaces_the_parents_origins(tmp_path: Path) -> None:
    parent = write(tmp_path / "p.yaml", BASE.replace("[{fn: exact_match}]", "[{fn: exact_match}, {fn: digit_credit}]"))
    child = write(tmp_path / "c.yaml", "extends: p.yaml\nrewards: [{fn: exact_match, weight: oops}]\n")
    _, origins = load_config_tree(child)
    assert origins["rewards[0].weight"] == str(child)
    assert "rewards[1]" not in origins and "rewards[1].fn" not in origins  # the parent's second entry is gone
    assert str(parent) not in {origins[k] for k in origins if k.startswith("rewards")}


def test_micro_batch_granularity_is_refused_where_it_cannot_work(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed reduces each micro-batch inside backward; fp16's scaler must see the overflowing micro-batches."""
    from steadyrl.config import checks

    for name in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    micro = ["guards.gepo.enabled=true", "guards.gepo.spike.granularity=micro_batch"]
    assert load_config(base, micro).guards.gepo.spike.granularity == "micro_batch"
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    with pytest.raises(ConfigError, match=r"granularity=micro_batch .* DeepSpeed ZeRO reduces every micro-batch"):
        load_config(base, [*micro, f"trainer.deepspeed={ds}"])
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match=r"Use granularity=step under DeepSpeed"):
        load_config(base, micro)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    monkeypatch.setattr(checks, "_cuda", lambda: True)
    with pytest.raises(ConfigError, match=r"drop fp16's overflowing micro-batches.*granularity=step with fp16"):
        load_config(base, [*micro, "trainer.fp16=true"])
    assert load_config(base, ["guards.gepo.enabled=true", "trainer.fp16=true"]).trainer["fp16"]
