"""The `ppo` section, `algorithm: ppo|reward` and their contradiction checks (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from steadyrl.config import ConfigError, load_config
from steadyrl.trainers.build import guard_parts

REPO = Path(__file__).resolve().parents[2]
PPO = REPO / "configs" / "tiny" / "ppo.yaml"
REWARD = REPO / "configs" / "tiny" / "reward.yaml"


def test_tiny_ppo_config_resolves_with_its_ppo_section():
    cfg = load_config(PPO)
    assert cfg.algorithm == "ppo" and cfg.trainer["num_generations"] == 1
    assert (cfg.ppo.gamma, cfg.ppo.lam, cfg.ppo.kl_estimator, cfg.ppo.value_model) == (1.0, 0.95, "k1", None)
    assert cfg.ppo.critic_lr == 1e-3 and cfg.ppo.whiten_advantages is True


def test_ppo_section_range_checks_and_unknown_keys():
    with pytest.raises(ConfigError, match=r"kl_estimator: unknown 'k2'; valid: \['k1', 'k3'\]"):
        load_config(PPO, ["ppo.kl_estimator=k2"])
    with pytest.raises(ConfigError, match=r"^ppo.lam \(set in command line\): must be in \[0, 1\], got 1.5$"):
        load_config(PPO, ["ppo.lam=1.5"])
    with pytest.raises(ConfigError, match="Did you mean 'vf_coef'"):
        load_config(PPO, ["ppo.vf_coeff=0.5"])
    with pytest.raises(ConfigError, match="is not a folder"):
        load_config(PPO, ["ppo.value_model=/does/not/exist"])


def test_ppo_refuses_grpo_only_and_unwired_guards():
    with pytest.raises(ConfigError, match="GRPO-only"):
        load_config(PPO, ["guards.gepo.enabled=true"])  # its MAD advantage is on by default
    load_config(PPO, ["guards.gepo.enabled=true", "guards.gepo.advantage.enabled=false"])  # spike skip etc. is fine
    quatro = ["guards.quatro.enabled=true", "trainer.beta=0.04", "guards.quatro.filters.zero_variance.enabled=false"]
    assert guard_parts(load_config(PPO, quatro)).quatro.kl is None  # adaptive KL: off by default
    cfg = load_config(PPO, [*quatro, "guards.quatro.kl.enabled=true"])  # works for PPO: it reads the rollout's KL
    assert guard_parts(cfg).quatro.kl is not None
    replay = load_config(PPO, [*quatro, "guards.quatro.replay.enabled=true"])  # replay works for PPO too
    assert guard_parts(replay).quatro.replay is not None
    with pytest.raises(ConfigError, match=r"zero_variance\.enabled=false"):
        load_config(PPO, ["guards.quatro.enabled=true", "trainer.beta=0.04"])  # zero-variance filter: on by default
    # TRL's default beta 0: valid, the KL controller is inactive at run time (nothing to control)
    assert load_config(PPO, [*quatro, "trainer.beta=0.0"]).guards.quatro.enabled
    brake = [*quatro, "guards.quatro.entropy.pg_brake=1.0"]
    assert guard_parts(load_config(PPO, brake)).quatro.entropy.pg_brake == 1.0  # the brake works for PPO
    moments = guard_parts(load_config(PPO, [*brake, "guards.quatro.entropy.brake_moments=0.01"]))  # the critic's
    assert moments.quatro.entropy.brake_moments == 0.01  # groups keep their moments (test_ppo.py)
    with pytest.raises(ConfigError, match="loss_type=cispo"):
        load_config(PPO, ["trainer.loss_type=cispo"])


def test_num_generations_1_is_refused_for_grpo():
    with pytest.raises(ConfigError, match=r"TRL rejected.*at least 2"):
        from steadyrl.trainers.build import trl_args

        trl_args(load_config(REPO / "configs" / "tiny" / "grpo.yaml", ["trainer.num_generations=1"]))


def test_reward_config_needs_an_eval_split_and_reward_config_fields():
    cfg = load_config(REWARD)
    assert cfg.algorithm == "reward" and cfg.trainer["max_length"] == 64
    with pytest.raises(ConfigError, match="calibration report on held-out pairs"):
        load_config(REWARD, ["data.eval_split=null"])
    with pytest.raises(ConfigError, match=r"unknown key 'num_generations' for trl\.RewardConfig"):
        load_config(REWARD, ["trainer.num_generations=4"])


def test_ppo_accepts_vllm_rollouts(monkeypatch: pytest.MonkeyPatch):
    """PPO generates with vLLM like GRPO (tests/vllm_cpu runs it for real); validation passes the settings through."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    cfg = load_config(PPO, ["trainer.use_vllm=true", "trainer.vllm_mode=colocate"])
    assert cfg.trainer["use_vllm"] is True and cfg.trainer["vllm_mode"] == "colocate"
