"""PeriodicEval: eval on held-out prompts every ``every`` optimizer steps, logged beside training metrics.

After optimizer step k (a multiple of ``every``) each rank decodes its contiguous shard of the eval set -- greedily,
or sampled with the training temperature / top_p / top_k (``sampling``, seeded by ``seed`` and k, as TRL's own eval
samples) -- and scores it with the run's reward functions; sums, sums of squares and counts are all-reduced, so every
rank logs the same row (``eval/reward``, ``eval/accuracy`` and its standard error ``eval/accuracy_se``,
``eval/reward/<name>``, ``eval/mean_length``, ``eval/num_samples``; docs/DESIGN.md "Periodic eval"). It runs at the
start of step k+1 or at the end of training, so the row follows step k's training row, checkpoint and rollback; a run
resumed from checkpoint-k evaluates step k again. The RNG states are restored afterwards. Left out: pass@k; ZeRO-3
and FSDP (sharded parameters) raise.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import Trainer, TrainerCallback

from steadyrl.evaluation import eval_scores, finite_scores
from steadyrl.metrics import (
    EVAL_ACCURACY,
    EVAL_ACCURACY_SE,
    EVAL_MEAN_LENGTH,
    EVAL_NUM_SAMPLES,
    EVAL_REWARD,
    eval_reward,
)

logger = logging.getLogger("steadyrl.eval")

LogFn = Callable[[dict[str, float]], None]


def trainer_log_fn(trainer: Trainer) -> LogFn:
    """``transformers.Trainer.log`` bound to ``trainer`` (not ``trainer.log``: TRL's clears its ``_metrics``)."""
    return functools.partial(Trainer.log, trainer)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the torch (CPU and every initialised CUDA device), numpy and Python RNG states on exit."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(numpy_state)
        random.setstate(python_state)


def _bare_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model without DDP / DeepSpeed engine wrappers; refuses parameters sharded across ranks."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
        model = model.module
    if "FullyShardedDataParallel" in type(model).__name__ or "FSDP" in type(model).__name__:
        raise NotImplementedError("PeriodicEval: FSDP shards parameters across ranks; use DDP or ZeRO-2")
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise NotImplementedError("PeriodicEval: DeepSpeed ZeRO-3 shards parameters across ranks; use ZeRO-2")
    return model


def contiguous_shard(n: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s rows as ``Dataset.shard(world, rank, contiguous=True)``, or an empty range."""
    size, extra = divmod(n, world)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


def sample_mean_se(total: float, total_sq: float, n: float) -> float:
    """The standard error of a mean of n scores from their sum and sum of squares: sqrt(s^2 / n), s^2 the unbiased
    sample variance (NaN for n < 2)."""
    if n < 2:
        return math.nan
    variance = max(total_sq - total * total / n, 0.0) / (n - 1)
    return math.sqrt(variance / n)


def _noop(*_: Any, **__: Any) -> None:
    return None


class PeriodicEval(TrainerCallback):
    """Eval every ``every`` optimizer steps, scored with ``reward_fns``, logged as ``eval/...``.

    eval_dataset: held-out rows with a ``prompt`` column (text or messages) and the columns the rewards need.
    reward_fns: name -> TRL-style reward function; each one's mean is logged as ``eval/reward/<name>``.
    metric: the reward logged as ``eval/accuracy`` (the task's exact-match); None takes the first reward.
    reward_weights: name -> weight; when given ``eval/reward`` is the weighted sum of the reward means, otherwise
        the mean of ``metric``.
    max_samples: score the first ``max_samples`` rows only (taken before sharding).
    num_samples_to_log: prompt -> completion pairs from rank 0's shard written to the ``steadyrl.eval`` log.
    log_fn: called with each eval row on every rank (``trainer_log_fn(trainer)``); None: ``state.log_history`` only.
    eval_on_start: also evaluate before the first optimizer step (step 0).
    sampling: None decodes greedily; else ``generate``'s sampling settings (``temperature``, ``top_p``, ``top_k``),
        torch seeded with ``seed`` + the step on every rank (a resumed run samples the same eval again).
    """

    def __init__(
        self,
        eval_dataset: Dataset,
        reward_fns: Mapping[str, Callable[..., list[float | None]]],
        tokenizer: Any,
        *,
        every: int,
        metric: str | None = None,
        max_new_tokens: int = 16,
        batch_size: int = 64,
        max_samples: int | None = None,
        num_samples_to_log: int = 3,
        reward_weights: Mapping[str, float] | None = None,
        log_fn: LogFn | None = None,
        eval_on_start: bool = False,
        sampling: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        if every < 1:
            raise ValueError(f"PeriodicEval: every={every} must be >= 1 (leave the callback out to turn it off)")
        if not reward_fns:
            raise ValueError("PeriodicEval: needs at least one reward function")
        not_callable = [name for name, fn in reward_fns.items() if not callable(fn)]
        if not_callable:
            raise TypeError(f"PeriodicEval: rewards {not_callable} are not callable (reward models are not supported)")
        metric = next(iter(reward_fns)) if metric is None else metric
        if metric not in reward_fns:
            raise ValueError(f"PeriodicEval: metric {metric!r} is not one of the rewards {sorted(reward_fns)}")
        if reward_weights is not None and set(reward_weights) != set(reward_fns):
            raise ValueError(
                f"PeriodicEval: reward_weights names {sorted(reward_weights)} differ from rewards {sorted(reward_fns)}"
            )
        if "prompt" not in eval_dataset.column_names:
            raise ValueError(f"PeriodicEval: eval_dataset needs a 'prompt' column; it has {eval_dataset.column_names}")
        if max_samples is not None:
            eval_dataset = eval_dataset.select(range(min(max_samples, len(eval_dataset))))
        self.eval_dataset = eval_dataset
        self.reward_fns = dict(reward_fns)
        self.tokenizer = tokenizer
        self.every = every
        self.metric = metric
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.num_samples_to_log = num_samples_to_log
        self.reward_weights = dict(reward_weights) if reward_weights is not None else None
        self.log_fn = log_fn
        self.eval_on_start = eval_on_start
        self.sampling = dict(sampling) if sampling is not None else None
        self.seed = seed
        self._last_step: int | None = None  # the step last evaluated by this process

    def _due(self, step: int) -> bool:
        return step % self.every == 0 and (step > 0 or self.eval_on_start) and step != self._last_step

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        _bare_model(kwargs["model"])  # ZeRO-3 / FSDP fail here, not after the first ``every`` steps

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._due(state.global_step):
            self.run(kwargs["model"], state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._due(state.global_step):  # the last step, when no further step began
            self.run(kwargs["model"], state)

    def run(self, model: torch.nn.Module, state: Any) -> dict[str, float]:
        """Evaluate now (on every rank: it all-reduces), log the row and return it."""
        self._last_step = int(state.global_step)
        with preserved_rng():
            metrics, samples = self.evaluate(model, trainer_state=state)
        if state.is_world_process_zero:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
            logger.info("eval at step %d: %s", state.global_step, shown)
            for prompt, completion, score in samples:
                what = "eval sample at step %d: %r -> %r (%s=%.4g)"
                logger.info(what, state.global_step, prompt, completion, self.metric, score)
        if self.log_fn is not None:
            self.log_fn(dict(metrics))
        else:
            state.log_history.append({**metrics, "step": state.global_step})
        return metrics

    def evaluate(
        self, model: torch.nn.Module, trainer_state: Any = None
    ) -> tuple[dict[str, float], list[tuple[Any, str, float]]]:
        """Score this rank's shard and all-reduce: (the ``eval/...`` row, this rank's first sample triples). Means
        leave out ``None`` and NaN scores (none on any rank: NaN). Does not restore the RNG (``run`` does)."""
        model = _bare_model(model)
        distributed = dist.is_available() and dist.is_initialized()
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        start, stop = contiguous_shard(len(self.eval_dataset), rank, world)
        shard = self.eval_dataset.select(range(start, stop) if stop > start else [])  # range(1, 1) raises
        sizes = {"max_new_tokens": self.max_new_tokens, "batch_size": self.batch_size}
        noops = {"trainer_state": trainer_state, "log_extra": _noop, "log_metric": _noop}
        if self.sampling is not None:  # the same draw on a rerun of this step (a resume), another at each step
            step = int(getattr(trainer_state, "global_step", 0) or 0)
            torch.manual_seed(self.seed * 1_000_003 + step)
        kwargs = {"reward_kwargs": noops, "sampling": self.sampling}
        out = eval_scores(model, self.tokenizer, shard, self.reward_fns, **sizes, **kwargs)
        totals: list[float] = []
        for name in self.reward_fns:  # same order on every rank: dicts keep insertion order
            finite = finite_scores(out["scores"][name])
            totals += [sum(finite), float(len(finite))]
        metric_scores = finite_scores(out["scores"][self.metric])
        totals.append(sum(s * s for s in metric_scores))
        totals += [float(sum(len(ids) for ids in out["completion_ids"])), float(len(out["completion_ids"]))]
        summed = torch.tensor(totals, dtype=torch.float64, device=next(model.parameters()).device)
        if world > 1:
            dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        values = summed.tolist()
        means = {
            name: values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else math.nan
            for i, name in enumerate(self.reward_fns)
        }
        length_sum, rows = values[-2:]
        k = list(self.reward_fns).index(self.metric)
        metric_se = sample_mean_se(values[2 * k], values[-3], values[2 * k + 1])
        if self.reward_weights is None:
            reward = means[self.metric]
        else:  # nan-skipping like TRL's nansum over reward functions
            reward = sum(self.reward_weights[n] * m for n, m in means.items() if not math.isnan(m))
        metrics = {EVAL_REWARD: reward, EVAL_ACCURACY: means[self.metric], EVAL_ACCURACY_SE: metric_se}
        metrics |= {eval_reward(name): mean for name, mean in means.items()}
        metrics |= {EVAL_MEAN_LENGTH: length_sum / rows if rows else math.nan, EVAL_NUM_SAMPLES: int(rows)}
        triples = zip(out["prompts"], out["completions"], out["scores"][self.metric], strict=True)
        samples = [(p, c, math.nan if s is None else float(s)) for p, c, s in triples][: self.num_samples_to_log]
        return metrics, samples
