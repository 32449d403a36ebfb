"""From a validated RunConfig to a running TRL trainer: model, data, rewards, peft, resume, final eval."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from steadyrl.config import RunConfig
from steadyrl.config.loader import ConfigError
from steadyrl.config.schema import load_object, world_size_from_env
from steadyrl.environment import write_environment
from steadyrl.rewards import bind_reward, check_reward_columns, load_reward_fn, required_columns
from steadyrl.rewards.guarded import GuardedReward

if TYPE_CHECKING:
    from steadyrl.trainers.layers import GuardParts

logger = logging.getLogger(__name__)

BUILTIN_MODEL = "builtin:tiny-llama"


def reward_functions(cfg: RunConfig) -> dict[str, Any]:
    """name -> callable (``fn`` entries, each a ``GuardedReward``) or reward-model path (``model`` entries), in
    config order."""
    out: dict[str, Any] = {}
    for entry in cfg.rewards:
        name = entry.resolved_name
        if entry.fn is None:
            out[name] = entry.model
        else:  # on_error / retries / timeout / checked returns (steadyrl.rewards.guarded)
            bound = bind_reward(name, load_reward_fn(entry.fn), entry.kwargs)
            out[name] = GuardedReward(name, bound, entry, output_dir=cfg.trainer.get("output_dir"))
    return out


def peft_config(cfg: RunConfig) -> Any:
    if cfg.peft is None:
        return None
    from peft import LoraConfig

    p = cfg.peft
    return LoraConfig(
        r=p.r,
        lora_alpha=p.lora_alpha,
        lora_dropout=p.lora_dropout,
        target_modules=p.target_modules,
        bias=p.bias,
        modules_to_save=p.modules_to_save,
        task_type="CAUSAL_LM",
    )


def _model_init_kwargs(cfg: RunConfig, trainer_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained`` kwargs from the model section (``trainer.model_init_kwargs`` wins); pops them from
    ``trainer_kwargs`` and sets its ``trust_remote_code`` default."""
    init_kwargs = dict(trainer_kwargs.pop("model_init_kwargs", None) or {})
    init_kwargs.setdefault("dtype", cfg.model.dtype)
    if cfg.model.attn_implementation is not None:
        init_kwargs.setdefault("attn_implementation", cfg.model.attn_implementation)
    if cfg.model.revision is not None:
        init_kwargs.setdefault("revision", cfg.model.revision)
    trainer_kwargs.setdefault("trust_remote_code", cfg.model.trust_remote_code)
    return init_kwargs


def model_files_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """``revision`` and ``trust_remote_code`` for every other load of the model's files (tokenizer, config): the
    values its weights load with (``trainer.model_init_kwargs`` over ``trainer.trust_remote_code`` over ``model``)."""
    trainer_kwargs = dict(cfg.trainer)
    init_kwargs = _model_init_kwargs(cfg, trainer_kwargs)
    out = {"trust_remote_code": init_kwargs.get("trust_remote_code", trainer_kwargs["trust_remote_code"])}
    if init_kwargs.get("revision") is not None:
        out["revision"] = init_kwargs["revision"]
    return out


def trl_args(cfg: RunConfig) -> Any:
    """The TRL config object: the ``trainer`` section unchanged, plus model-loading kwargs from ``model``."""
    from steadyrl.config.schema import trl_config_class

    kwargs = dict(cfg.trainer)
    kwargs.pop("resume_from_checkpoint", None)  # handled by resolve_resume: the Trainer ignores this field
    init_kwargs = _model_init_kwargs(cfg, kwargs)
    _cpu_process_group(kwargs)
    if cfg.algorithm in ("grpo", "ppo"):
        kwargs["reward_weights"] = [r.weight for r in cfg.rewards]
    try:
        return trl_config_class(cfg.algorithm)(model_init_kwargs=init_kwargs, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"trainer: TRL rejected the settings: {exc}") from exc


def _cpu_process_group(kwargs: dict[str, Any]) -> None:
    """Multi-process DDP on a CPU-only machine: create the gloo process group before accelerate looks.

    accelerate 1.15 treats a launch without GPUs as non-distributed unless ``use_cpu`` is set, and with
    ``use_cpu`` set it never calls ``init_process_group`` (then fails asking for it). So steadyrl creates the
    group itself and sets ``use_cpu``: each process trains on the CPU, gradients are all-reduced over gloo.
    DeepSpeed launches are left alone (DeepSpeed's own init handles ``ddp_backend``).
    """
    import torch
    import torch.distributed as dist

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or kwargs.get("deepspeed")
    if world_size_from_env() <= 1 and kwargs.get("ddp_backend") and not deepspeed:
        # one process has no process group; transformers would try to start one and fail (e.g. a config written
        # for 2 processes, resumed on 1)
        logger.warning("trainer.ddp_backend=%s has no effect with one process; ignored", kwargs.pop("ddp_backend"))
    if world_size_from_env() <= 1 or torch.cuda.is_available() or deepspeed:
        return
    kwargs["use_cpu"] = True
    if not dist.is_initialized():
        timeout = timedelta(seconds=int(kwargs.get("ddp_timeout", 1800)))
        dist.init_process_group(backend=kwargs.get("ddp_backend") or "gloo", timeout=timeout)


def resolve_resume(cfg: RunConfig) -> str | None:
    """``auto`` -> newest complete checkpoint in output_dir that verifies (or None); a path -> itself, once it
    verifies; null -> None. The main process reads and hashes the files; every rank gets its answer."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState()
    answer: list[Any] = [None, None]  # (checkpoint path or None, ConfigError text or None)
    if state.is_main_process:
        try:
            answer[0] = _resume_path(cfg)
            if answer[0] is not None:
                _check_resume_world_size(Path(answer[0]), state.num_processes, cfg)
        except ConfigError as exc:
            answer[1] = str(exc)
    if state.num_processes > 1:
        broadcast_object_list(answer)
    if answer[1] is not None:
        raise ConfigError(answer[1])
    return answer[0]


def _check_resume_world_size(folder: Path, processes: int, cfg: RunConfig) -> None:
    """DeepSpeed ZeRO partitions the optimizer state per rank and cannot load it on another number of processes;
    refuse before any model is loaded. (DDP resumes, dropping per-rank state: ``checkpoints.load_steady_state``.)"""
    from steadyrl.config.checks import _deepspeed_config, _deepspeed_launch
    from steadyrl.trainers.checkpoints import saved_num_processes

    saved = saved_num_processes(folder)
    if saved is None or saved == processes or not (_deepspeed_launch() or _deepspeed_config(cfg) is not None):
        return
    raise ConfigError(
        f"trainer.resume_from_checkpoint: {folder} was written by {saved} processes and this DeepSpeed run has "
        f"{processes}; ZeRO's optimizer partitions only load on the same number. Launch with --num_processes "
        f"{saved}, or convert it with DeepSpeed's universal checkpoint (python -m "
        "deepspeed.checkpoint.ds_to_universal) and load that, or start a new run from its weights "
        f"(model.path={folder}, trainer.resume_from_checkpoint=null)"
    )


def _resume_path(cfg: RunConfig) -> str | None:
    from steadyrl.trainers.checkpoints import find_resume_checkpoint, is_complete_checkpoint, verify_checkpoint

    resume = cfg.trainer.get("resume_from_checkpoint")
    if resume in (None, False):
        return None
    if resume == "auto" or resume is True:
        found = find_resume_checkpoint(cfg.trainer["output_dir"])
        logger.info("resume_from_checkpoint=auto: %s", found or "no complete checkpoint, starting fresh")
        return str(found) if found is not None else None
    path = Path(str(resume))
    if not path.is_dir():
        raise ConfigError(f"trainer.resume_from_checkpoint: {resume!r} does not exist")
    if not is_complete_checkpoint(path):
        logger.warning("%s has no steadyrl completion marker; resuming from it anyway as asked", path)
    elif (problem := verify_checkpoint(path)) is not None:
        raise ConfigError(
            f"trainer.resume_from_checkpoint: {path} is damaged: {problem}. Resume from an older checkpoint, or "
            "with auto (the newest one that verifies)"
        )
    return str(path)


def guard_parts(cfg: RunConfig) -> GuardParts:
    """SteadyGRPOTrainer's guard parts filled from the ``guards`` section (``steadyrl.trainers.layers``)."""
    from steadyrl.trainers.layers import guard_parts as from_section

    return from_section(cfg.guards)


def _model_path(cfg: RunConfig, state: Any) -> str:
    from steadyrl.tasks.smollm2 import BUILTIN_SMOLLM2

    if cfg.model.path == BUILTIN_SMOLLM2:  # converted once from the installed wheel, then read from the cache
        from steadyrl.tasks.smollm2 import smollm2_folder

        if state.is_main_process:
            smollm2_folder()
        state.wait_for_everyone()
        return str(smollm2_folder())
    if cfg.model.path != BUILTIN_MODEL:
        return cfg.model.path
    from steadyrl.tasks.tiny_model import build_tiny_model

    target = Path(cfg.trainer["output_dir"]) / "init_model"
    if state.is_main_process and not (target / "config.json").is_file():
        build_tiny_model(target, **cfg.model.tiny)
    state.wait_for_everyone()
    return str(target)


def _write_resolved(cfg: RunConfig, state: Any) -> None:
    if state.is_main_process:
        out = Path(cfg.trainer["output_dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "resolved_config.yaml").write_text(yaml.safe_dump(cfg.to_tree(), sort_keys=False))
        write_environment(out)


def checked_rows(
    cfg: RunConfig, args: Any, model_path: str, tokenizer: Any, rewards: dict[str, Any], train_ds: Any, eval_ds: Any
) -> tuple[Any, Any]:
    """Both splits through ``steadyrl.data_rows.check_rows`` (``data.on_bad_row``): empty prompts, empty reward
    columns, prompts that leave no room for ``max_completion_length`` in the model's context."""
    from transformers import AutoConfig

    from steadyrl.data_rows import check_rows

    needs: dict[str, list[str]] = {}
    for name, fn in rewards.items():
        for column in sorted(required_columns(fn)) if callable(fn) else []:
            needs.setdefault(column, []).append(name)
    model_config = AutoConfig.from_pretrained(model_path, **model_files_kwargs(cfg))
    context = getattr(model_config, "max_position_embeddings", None)
    d = cfg.data
    local = Path(d.path).suffix in (".jsonl", ".json", ".parquet", ".csv")
    sources = [
        d.path if local else f"{d.path} ({d.split} split)",
        d.eval_path if d.eval_path is not None else f"{d.path} ({d.eval_split} split)",
    ]
    checked = [
        None
        if ds is None
        else check_rows(ds, source, d.on_bad_row, needs, tokenizer, context, args.max_completion_length)
        for ds, source in zip((train_ds, eval_ds), sources, strict=True)
    ]
    return checked[0], checked[1]


def build_trainer(cfg: RunConfig, extra_callbacks: list[Any] | None = None) -> Any:
    """Everything but ``train()``: validated pieces assembled into a SteadyGRPOTrainer, SteadyPPOTrainer or
    SFTTrainer."""
    from accelerate import PartialState
    from transformers import AutoTokenizer

    from steadyrl.data import load_datasets

    args = trl_args(cfg)  # constructing the TRL config also sets up the process group under a launcher
    state = PartialState()
    train_ds, eval_ds = load_datasets(cfg.data)
    rewards = reward_functions(cfg)
    for name, fn in rewards.items():
        if callable(fn):
            check_reward_columns(name, fn, train_ds.column_names)
    _write_resolved(cfg, state)
    model_path = _model_path(cfg, state)
    tokenizer = AutoTokenizer.from_pretrained(model_path, **model_files_kwargs(cfg))
    if cfg.data.chat_template is not None:
        template = Path(cfg.data.chat_template)
        tokenizer.chat_template = template.read_text() if template.is_file() else cfg.data.chat_template
    if cfg.algorithm in ("grpo", "ppo"):
        train_ds, eval_ds = checked_rows(cfg, args, model_path, tokenizer, rewards, train_ds, eval_ds)
    common = dict(
        model=model_path,
        args=args,
        train_dataset=train_ds,
        processing_class=tokenizer,
        peft_config=peft_config(cfg),
        callbacks=[load_object(s, f"callbacks[{i}]")() for i, s in enumerate(cfg.callbacks)]
        + list(extra_callbacks or []),
    )
    from steadyrl.callbacks.metrics_log import MetricsLog

    common["callbacks"] = [MetricsLog(), *common["callbacks"]]  # metrics.jsonl: every row, crash-safe
    from steadyrl.callbacks.progress import terminal_callbacks

    common["callbacks"] += terminal_callbacks()  # a status line per log on a terminal; quiet when piped
    if cfg.preemption.enabled:
        from steadyrl.callbacks.preemption import PreemptionCallback

        common["callbacks"].append(PreemptionCallback(cfg.preemption.signals, cfg.preemption.relay_window_s))
    if cfg.algorithm != "sft" and cfg.guards.gepo.enabled and cfg.guards.gepo.monitor.enabled:
        from steadyrl.callbacks.monitor import SignalMonitor

        common["callbacks"] = [*common["callbacks"], SignalMonitor(cfg.guards.gepo.monitor)]
    if getattr(args, "use_vllm", False):
        from steadyrl.trainers.vllm_support import prepare_vllm

        prepare_vllm(args)
    if cfg.algorithm == "sft":
        from trl import SFTTrainer

        trainer = SFTTrainer(**common)
    elif cfg.algorithm == "ppo":
        from steadyrl.trainers.ppo import SteadyPPOTrainer

        trainer = SteadyPPOTrainer(reward_funcs=list(rewards.values()), ppo=cfg.ppo, guards=guard_parts(cfg), **common)
    else:
        from steadyrl.trainers.grpo import SteadyGRPOTrainer

        trainer = SteadyGRPOTrainer(reward_funcs=list(rewards.values()), guards=guard_parts(cfg), **common)
    if getattr(args, "use_vllm", False):
        from steadyrl.trainers.vllm_support import check_cpu_engine

        check_cpu_engine(trainer)
    fns = {n: f for n, f in rewards.items() if callable(f)}
    if cfg.algorithm != "sft" and cfg.eval.enabled and cfg.eval.every > 0:
        from steadyrl.callbacks.periodic_eval import PeriodicEval, trainer_log_fn

        if eval_ds is None or not fns:
            raise ConfigError(
                "eval.every > 0 needs an eval split (data.eval_split or data.eval_path) and a `fn` reward"
            )
        weights = {r.resolved_name: r.weight for r in cfg.rewards} if len(fns) == len(rewards) else None
        trainer.add_callback(
            PeriodicEval(
                eval_ds, fns, tokenizer,
                every=cfg.eval.every, metric=cfg.eval.metric, max_new_tokens=cfg.eval.max_new_tokens,
                batch_size=cfg.eval.batch_size, max_samples=cfg.eval.max_samples,
                num_samples_to_log=cfg.eval.samples_to_log, reward_weights=weights,
                eval_on_start=cfg.eval.on_start, log_fn=trainer_log_fn(trainer),
            )
        )  # fmt: skip
    trainer.steady_eval_dataset = eval_ds
    trainer.steady_rewards = rewards
    return trainer


def final_eval(cfg: RunConfig, trainer: Any) -> dict[str, Any] | None:
    """Greedy eval on the eval split with the run's reward functions (main process); None without eval data."""
    from steadyrl.evaluation import evaluate_rewards

    eval_ds = trainer.steady_eval_dataset
    fns = {n: f for n, f in trainer.steady_rewards.items() if callable(f)}
    if not cfg.eval.enabled or eval_ds is None or not fns:
        return None
    result = None
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        result = evaluate_rewards(
            model,
            trainer.processing_class,
            eval_ds,
            fns,
            max_new_tokens=cfg.eval.max_new_tokens,
            batch_size=cfg.eval.batch_size,
            max_samples=cfg.eval.max_samples,
        )
        metric = cfg.eval.metric or next(iter(fns))
        result["metric"] = metric
        result["accuracy"] = result["rewards"][metric]
        out = Path(cfg.trainer["output_dir"]) / "eval_results.json"
        out.write_text(json.dumps(result, indent=2))
    trainer.accelerator.wait_for_everyone()
    return result


def run_reward(cfg: RunConfig) -> dict[str, Any]:
    """``algorithm: reward``: train a Bradley-Terry reward model (``trl.RewardTrainer``), then calibrate it.

    The ``trainer`` section goes to ``trl.RewardConfig`` unchanged. Writes ``<output_dir>/final`` (model, tokenizer,
    ``reward_stats.json``) and the calibration report in ``output_dir`` (``calibration.json``,
    ``reward_stats.json``, ``calibration.png``). Returns the calibration summary (empty on non-main processes).
    """
    from accelerate import PartialState

    from steadyrl.data import load_datasets
    from steadyrl.ppo.reward_stage import run_reward_stage

    kwargs = dict(cfg.trainer)
    kwargs.pop("resume_from_checkpoint", None)
    output_dir = kwargs.pop("output_dir")
    init_kwargs = _model_init_kwargs(cfg, kwargs)
    state = PartialState()
    train_ds, eval_ds = load_datasets(cfg.data)
    assert eval_ds is not None  # _check_reward requires an eval split
    _write_resolved(cfg, state)
    model_path = _model_path(cfg, state)
    return run_reward_stage(model_path, train_ds, eval_ds, output_dir, model_init_kwargs=init_kwargs, **kwargs)


def _raise_if_preempted(cfg: RunConfig, trainer: Any) -> None:
    from steadyrl.callbacks.preemption import Preempted, PreemptionCallback

    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, PreemptionCallback)), None)
    if callback is None or callback.stopped_at is None:
        return
    trainer.accelerator.wait_for_everyone()
    folder = Path(cfg.trainer["output_dir"]) / f"checkpoint-{callback.stopped_at}"  # what the Trainer just wrote
    written = (folder / "trainer_state.json").is_file()
    checkpoint = str(folder) if written else None
    raise Preempted(callback.signal_name, callback.stopped_at, checkpoint, cfg.preemption.exit_code)


def run(cfg: RunConfig) -> dict[str, Any] | None:
    """Train, save the final model to ``<output_dir>/final``, evaluate. Returns the eval result (main process).

    Raises ``Preempted`` when a signal stopped training (``preemption``): the checkpoint is written, the final save
    and eval are skipped."""
    trainer = build_trainer(cfg)
    trainer.train(resume_from_checkpoint=resolve_resume(cfg))
    _raise_if_preempted(cfg, trainer)
    final_dir = Path(cfg.trainer["output_dir"]) / "final"
    trainer.save_model(str(final_dir))
    if trainer.accelerator.is_main_process:
        trainer.processing_class.save_pretrained(str(final_dir))
        if (
            cfg.algorithm == "ppo"
        ):  # the critic also as a loadable folder (CriticModel.from_pretrained, ppo.value_model)
            trainer.policy_and_value.critic.save_pretrained(final_dir / "critic")
    result = final_eval(cfg, trainer)
    if getattr(trainer, "use_vllm", False):
        from steadyrl.trainers.vllm_support import shutdown_vllm

        shutdown_vllm(trainer)
    return result
