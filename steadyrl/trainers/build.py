"""From a validated RunConfig to a running TRL trainer: model, data, rewards, peft, resume, final eval."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import yaml
from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from peft import LoraConfig
from transformers import AutoConfig, AutoTokenizer

from steadyrl.callbacks.gold_watch import GoldWatch
from steadyrl.callbacks.metrics_log import MetricsLog
from steadyrl.callbacks.periodic_eval import PeriodicEval, trainer_log_fn
from steadyrl.callbacks.preemption import Preempted, PreemptionCallback
from steadyrl.callbacks.progress import terminal_callbacks
from steadyrl.config import RunConfig
from steadyrl.config.checks import BUILTIN_MODELS, _deepspeed_config, _deepspeed_launch
from steadyrl.config.loader import ConfigError
from steadyrl.config.schema import load_object, trl_config_class, world_size_from_env
from steadyrl.data import load_datasets
from steadyrl.data_rows import check_rows
from steadyrl.environment import write_environment
from steadyrl.evaluation import evaluate_rewards
from steadyrl.rewards import bind_reward, check_reward_columns, load_reward_fn, required_columns
from steadyrl.rewards.guarded import guarded_reward
from steadyrl.storage import write_report
from steadyrl.tasks.smollm2 import BUILTIN_SMOLLM2, smollm2_folder
from steadyrl.tasks.tiny_model import build_tiny_model
from steadyrl.trainers import checkpoints
from steadyrl.trainers.reward_model import hub_kwargs, run_reward_stage
from steadyrl.trainers.vllm_support import check_cpu_engine, prepare_vllm, shutdown_vllm

if TYPE_CHECKING:
    from steadyrl.trainers.layers import GuardParts

logger = logging.getLogger(__name__)


def reward_functions(cfg: RunConfig) -> dict[str, Any]:
    """name -> ``GuardedReward`` (``fn`` entries) or reward-model path (``model`` entries), in config order."""
    out: dict[str, Any] = {}
    for entry in cfg.rewards:
        name = entry.resolved_name
        if entry.fn is None:
            out[name] = entry.model
        else:  # on_error / retries / timeout / checked returns (steadyrl.rewards.guarded)
            bound = bind_reward(name, load_reward_fn(entry.fn), entry.kwargs)
            out[name] = guarded_reward(name, bound, entry, output_dir=cfg.trainer.get("output_dir"))
    return out


def _trainer_kwargs(cfg: RunConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``trainer`` section for the TRL config (less ``resume_from_checkpoint``: ``resolve_resume`` handles it) and
    the ``from_pretrained`` kwargs from the model section (``trainer.model_init_kwargs`` wins)."""
    trainer_kwargs = dict(cfg.trainer)
    trainer_kwargs.pop("resume_from_checkpoint", None)
    init_kwargs = dict(trainer_kwargs.pop("model_init_kwargs", None) or {})
    init_kwargs.setdefault("dtype", cfg.model.dtype)
    if cfg.model.attn_implementation is not None:
        init_kwargs.setdefault("attn_implementation", cfg.model.attn_implementation)
    if cfg.model.revision is not None:
        init_kwargs.setdefault("revision", cfg.model.revision)
    trainer_kwargs.setdefault("trust_remote_code", cfg.model.trust_remote_code)
    return trainer_kwargs, init_kwargs


def model_files_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """``revision`` and ``trust_remote_code`` for every other load of the model's files (tokenizer, config): the
    values its weights load with (``trainer.model_init_kwargs`` over ``trainer.trust_remote_code`` over ``model``)."""
    trainer_kwargs, init_kwargs = _trainer_kwargs(cfg)
    return hub_kwargs(init_kwargs, trainer_kwargs["trust_remote_code"])


def trl_args(cfg: RunConfig) -> Any:
    """The TRL config object: the ``trainer`` section unchanged, plus model-loading kwargs from ``model``."""
    kwargs, init_kwargs = _trainer_kwargs(cfg)
    _cpu_process_group(kwargs)
    if cfg.algorithm in ("grpo", "ppo"):
        kwargs["reward_weights"] = [r.weight for r in cfg.rewards]
    try:
        return trl_config_class(cfg.algorithm)(model_init_kwargs=init_kwargs, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"trainer: TRL rejected the settings: {exc}") from exc


def _cpu_process_group(kwargs: dict[str, Any]) -> None:
    """Multi-process DDP on a CPU-only machine: create the gloo process group and set ``use_cpu`` (accelerate 1.15
    with ``use_cpu`` never calls ``init_process_group``). DeepSpeed launches are left alone."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or kwargs.get("deepspeed")
    if world_size_from_env() <= 1 and kwargs.get("ddp_backend") and not deepspeed:
        # one process has no process group; transformers would try to start one and fail
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
    saved = checkpoints.saved_num_processes(folder)
    if saved is None or saved == processes or not (_deepspeed_launch() or _deepspeed_config(cfg) is not None):
        return
    if ((_deepspeed_config(cfg) or {}).get("checkpoint") or {}).get("load_universal"):
        return  # the way out this message names: DeepSpeed loads a universal checkpoint on any number
    tag = (folder / "latest").read_text().strip() if (folder / "latest").is_file() else "global_stepN"
    raise ConfigError(
        f"trainer.resume_from_checkpoint: {folder} was written by {saved} processes and this DeepSpeed run has "
        f"{processes}; ZeRO's optimizer partitions only load on the same number. Launch with --num_processes "
        f"{saved}, or convert it to DeepSpeed's universal checkpoint (python -m deepspeed.checkpoint.ds_to_universal "
        f"--inject_missing_state --input_folder {folder / tag} --output_folder {folder / tag}_universal; then "
        f'echo {tag}_universal > {folder / "latest_universal"}) and load that ("checkpoint": {{"load_universal": '
        "true} in the DeepSpeed config file), or start a new run from its weights "
        f"(model.path={folder}, trainer.resume_from_checkpoint=null)"
    )


def _resume_path(cfg: RunConfig) -> str | None:
    resume = cfg.trainer.get("resume_from_checkpoint")
    if resume in (None, False):
        return None
    if resume == "auto" or resume is True:
        found = checkpoints.find_resume_checkpoint(cfg.trainer["output_dir"])
        logger.info("resume_from_checkpoint=auto: %s", found or "no complete checkpoint, starting fresh")
        return str(found) if found is not None else None
    path = Path(str(resume))
    if not path.is_dir():
        raise ConfigError(f"trainer.resume_from_checkpoint: {resume!r} does not exist")
    if not checkpoints.is_complete_checkpoint(path):
        logger.warning("%s has no steadyrl completion marker; resuming from it anyway as asked", path)
    elif (problem := checkpoints.verify_checkpoint(path)) is not None:
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
    if cfg.model.path == BUILTIN_SMOLLM2:  # converted once from the installed wheel, then read from the cache
        if state.is_main_process:
            smollm2_folder()
        state.wait_for_everyone()
        return str(smollm2_folder())
    if cfg.model.path != BUILTIN_MODELS[0]:  # builtin:tiny-llama
        return cfg.model.path
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
    needs: dict[str, list[str]] = {}
    for name, fn in rewards.items():
        for column in sorted(required_columns(fn)) if callable(fn) else []:
            needs.setdefault(column, []).append(name)
    model_config = AutoConfig.from_pretrained(model_path, **model_files_kwargs(cfg))
    context = getattr(model_config, "max_position_embeddings", None)
    d = cfg.data
    local = Path(d.path).suffix in (".jsonl", ".json", ".parquet", ".csv")
    sources = (
        d.path if local else f"{d.path} ({d.split} split)",
        d.eval_path if d.eval_path is not None else f"{d.path} ({d.eval_split} split)",
    )
    rows = (d.on_bad_row, needs, tokenizer, context, args.max_completion_length)
    train_ds = check_rows(train_ds, sources[0], *rows)  # never None: build_trainer read its columns
    return train_ds, None if eval_ds is None else check_rows(eval_ds, sources[1], *rows)


def build_trainer(cfg: RunConfig, extra_callbacks: list[Any] | None = None) -> Any:
    """Everything but ``train()``: a SteadyGRPOTrainer, SteadyPPOTrainer or SFTTrainer from the config."""
    args = trl_args(cfg)  # constructing the TRL config also sets up the process group under a launcher
    state = PartialState()
    train_ds, eval_ds = load_datasets(cfg.data)
    rewards = reward_functions(cfg)
    for name, fn in rewards.items():
        if callable(fn):
            check_reward_columns(name, fn, train_ds.column_names)
    _write_resolved(cfg, state)
    model_path = _model_path(cfg, state)
    check_storage(cfg, args, model_path, state)  # before the model loads: a run that would fill its disk stops here
    tokenizer = AutoTokenizer.from_pretrained(model_path, **model_files_kwargs(cfg))
    if cfg.data.chat_template is not None:
        template = Path(cfg.data.chat_template)
        tokenizer.chat_template = template.read_text() if template.is_file() else cfg.data.chat_template
    if cfg.algorithm in ("grpo", "ppo"):
        train_ds, eval_ds = checked_rows(cfg, args, model_path, tokenizer, rewards, train_ds, eval_ds)
    # metrics.jsonl (every row, crash-safe) first; a status line per log on a terminal (quiet when piped)
    callbacks = [load_object(s, f"callbacks[{i}]")() for i, s in enumerate(cfg.callbacks)]
    callbacks = [MetricsLog(), *callbacks, *(extra_callbacks or []), *terminal_callbacks()]
    if cfg.preemption.enabled:
        callbacks.append(PreemptionCallback(cfg.preemption.signals, cfg.preemption.relay_window_s))
    peft = None if cfg.peft is None else LoraConfig(**dataclasses.asdict(cfg.peft), task_type="CAUSAL_LM")
    common = dict(
        model=model_path, args=args, train_dataset=train_ds, processing_class=tokenizer, peft_config=peft,
        callbacks=callbacks,
    )  # fmt: skip
    use_vllm = getattr(args, "use_vllm", False)
    if use_vllm:
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
    if use_vllm:
        check_cpu_engine(trainer)
    fns = {n: f for n, f in rewards.items() if callable(f)}
    if cfg.algorithm != "sft" and cfg.eval.enabled and cfg.eval.every > 0:
        if eval_ds is None or not fns:
            raise ConfigError(
                "eval.every > 0 needs an eval split (data.eval_split or data.eval_path) and a `fn` reward"
            )
        weights = {r.resolved_name: r.weight for r in cfg.rewards} if len(fns) == len(rewards) else None
        e = cfg.eval
        trainer.add_guard_callback(PeriodicEval(
            eval_ds, fns, tokenizer, every=e.every, metric=e.metric, max_new_tokens=e.max_new_tokens,
            batch_size=e.batch_size, max_samples=e.max_samples, num_samples_to_log=e.samples_to_log,
            reward_weights=weights, eval_on_start=e.on_start, log_fn=trainer_log_fn(trainer),
            sampling=eval_sampling(trainer.args) if e.do_sample else None, seed=trainer.args.seed,
        ))  # fmt: skip
        quatro = cfg.guards.quatro
        if quatro.enabled and quatro.gold.enabled:  # after PeriodicEval: reads its rows
            if trainer.gold_watch is not None:  # one watch: on steadyrl's periodic eval, not on TRL's own eval
                trainer.callback_handler.remove_callback(trainer.gold_watch)
            watch = GoldWatch(quatro.gold, trainer, observe=quatro.mode == "observe")
            trainer.add_guard_callback(watch)
            trainer.guard_state.stateful["gold"] = trainer.gold_watch = watch
    trainer.steady_eval_dataset = eval_ds
    trainer.steady_rewards = rewards
    return trainer


def check_storage(cfg: RunConfig, args: Any, model_path: str, state: Any) -> None:
    """The storage plan (steadyrl/storage.py), logged by the main process; every rank agrees before any raises
    ``StorageError`` (free space is per node)."""
    from steadyrl.storage import StorageError, check, run_plan
    from steadyrl.trainers.checkpoints import _every_rank

    storage = run_plan(cfg, args, model_path, state.num_processes, model_files_kwargs(cfg))
    error: BaseException | None = None
    if storage is not None:
        try:
            warning = check(storage, args.output_dir)
        except StorageError as exc:
            error, warning = exc, None
        if state.is_main_process:
            logger.info("storage plan for %s: %s", args.output_dir, storage)
            if warning is not None:
                logger.warning(warning)
    errors = [text for text in _every_rank(state, error) if text]
    if errors:
        raise StorageError(errors[0].removeprefix("StorageError: "))


def eval_sampling(args: Any) -> dict[str, Any]:
    """``generate``'s sampling settings from the trainer arguments (TRL's temperature, top_p, top_k; 0 / None: off)."""
    sampling: dict[str, Any] = {"temperature": float(args.temperature), "top_p": float(getattr(args, "top_p", 1.0))}
    top_k = getattr(args, "top_k", None)
    sampling["top_k"] = int(top_k) if top_k else 0
    return sampling


def final_eval(cfg: RunConfig, trainer: Any) -> dict[str, Any] | None:
    """Greedy eval on the eval split with the run's reward functions (main process); None without eval data."""
    eval_ds = trainer.steady_eval_dataset
    fns = {n: f for n, f in trainer.steady_rewards.items() if callable(f)}
    if not cfg.eval.enabled or eval_ds is None or not fns:
        return None
    result = None
    if trainer.accelerator.is_main_process:
        e, model = cfg.eval, trainer.accelerator.unwrap_model(trainer.model)
        result = evaluate_rewards(
            model, trainer.processing_class, eval_ds, fns,
            max_new_tokens=e.max_new_tokens, batch_size=e.batch_size, max_samples=e.max_samples,
        )  # fmt: skip
        result["metric"] = metric = e.metric or next(iter(fns))
        result["accuracy"] = result["rewards"][metric]
        write_report(Path(cfg.trainer["output_dir"]) / "eval_results.json", json.dumps(result, indent=2))
    trainer.accelerator.wait_for_everyone()
    return result


def run_reward(cfg: RunConfig) -> dict[str, Any]:
    """``algorithm: reward``: ``trainer`` to ``trl.RewardConfig``, train, calibrate (``run_reward_stage``). Returns
    the calibration summary (empty on non-main processes)."""
    kwargs, init_kwargs = _trainer_kwargs(cfg)
    output_dir = kwargs.pop("output_dir")
    state = PartialState()
    train_ds, eval_ds = load_datasets(cfg.data)
    assert eval_ds is not None  # _check_reward requires an eval split
    _write_resolved(cfg, state)
    model_path = _model_path(cfg, state)
    return run_reward_stage(model_path, train_ds, eval_ds, output_dir, model_init_kwargs=init_kwargs, **kwargs)


def run(cfg: RunConfig) -> dict[str, Any] | None:
    """Train, save the final model to ``<output_dir>/final``, evaluate. Returns the eval result (main process).
    Raises ``Preempted`` when a signal stopped training (the final save and eval are skipped)."""
    trainer = build_trainer(cfg)
    trainer.train(resume_from_checkpoint=resolve_resume(cfg))
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, PreemptionCallback)), None)
    if callback is not None and callback.stopped_at is not None:
        trainer.accelerator.wait_for_everyone()
        folder = Path(cfg.trainer["output_dir"]) / f"checkpoint-{callback.stopped_at}"  # what the Trainer just wrote
        checkpoint = str(folder) if (folder / "trainer_state.json").is_file() else None
        raise Preempted(callback.signal_name, callback.stopped_at, checkpoint, cfg.preemption.exit_code)

    def write_final(_: Path, folder: Path) -> None:
        trainer.save_model(str(folder))
        if trainer.accelerator.is_main_process:
            trainer.processing_class.save_pretrained(str(folder))
            if cfg.algorithm == "ppo":  # the critic also as a loadable folder (CriticModel.from_pretrained)
                trainer.policy_and_value.critic.save_pretrained(folder / "critic")

    # staged and renamed as a checkpoint is: a full disk stops the run with the message, no half-written final/
    step, output_dir = trainer.state.global_step, Path(cfg.trainer["output_dir"])
    checkpoints.save_atomically(trainer.accelerator, output_dir, step, None, write_final, name="final")
    result = final_eval(cfg, trainer)
    if getattr(trainer, "use_vllm", False):
        shutdown_vllm(trainer)
    return result
