"""Fault injectors for tests and benchmarks: rewards and training steps that misbehave reproducibly.

- reward-side faults are reward functions (``rewards: [{fn: "steadyrl.faults:NAME", kwargs: {...}}]``), seeded by
  ``(seed, global_step)`` from the ``trainer_state`` TRL passes to every reward function;
- trainer-side faults are ``TrainerCallback`` classes (``callbacks: ["steadyrl.faults:NAME"]``), built without
  arguments, so they read the environment (explicit constructor arguments win): ``STEADYRL_FAULT_STEP`` the 1-based
  optimizer step hit, the one at whose end ``global_step`` becomes k (default 3); ``STEADYRL_FAULT_RANK`` the only
  ``RANK`` that injects (unset: every process); ``STEADYRL_FAULT_VALUE`` the value written into the optimizer state
  (``InfExpAvgSqAtStep``; default inf); ``STEADYRL_FAULT_SCALE`` the gradient multiplier (``GradSpikeAtStep``; 1e4).

A trainer-side fault appends a JSON line to ``<output_dir>/faults.jsonl`` (``FAULT_LOG``) when it fires, so a benchmark
can tell "the guard held" from "the fault never happened". ``inject_nan_loss`` and ``CorruptOptimizerState`` are the
object-level forms for tests. Left out: faults inside generation or the reference model; bit flips in weights.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from steadyrl.tasks.arithmetic import _completion_text, exact_match

FAULT_STEP_ENV = "STEADYRL_FAULT_STEP"
FAULT_RANK_ENV = "STEADYRL_FAULT_RANK"
FAULT_VALUE_ENV = "STEADYRL_FAULT_VALUE"
FAULT_SCALE_ENV = "STEADYRL_FAULT_SCALE"
FAULT_LOG = "faults.jsonl"
DEFAULT_FAULT_STEP = 3
BURST_VALUES: tuple[float | None, ...] = (None, math.nan, math.inf, -math.inf)  # TRL reads None as NaN


def exact_match_cauchy(
    completions: Sequence[Any],
    answer: Sequence[str],
    scale: float = 1.0,
    seed: int = 0,
    trainer_state: Any = None,
    **_: Any,
) -> list[float]:
    """Exact match plus Cauchy noise of ``scale``: a heavy-tailed reward model (docs/DESIGN.md, "GRADE: reward scaler").

    Seeded by (seed, optimizer step): a step sees the same noise in every variant of a benchmark.
    """
    step = int(getattr(trainer_state, "global_step", 0) or 0)
    rng = np.random.default_rng([seed, step])
    noise = scale * rng.standard_cauchy(len(completions))
    return [r + float(n) for r, n in zip(exact_match(completions, answer), noise, strict=True)]


def inject_nan_loss(trainer: Any, micro_step: int) -> Callable[[], None]:
    """Make the loss of micro-batch ``micro_step`` (TRL's ``trainer._step``, from 0) NaN: its advantages are multiplied
    by NaN after TRL prepared them. Any ``trl.GRPOTrainer``. Returns a function that removes the fault.
    """
    original = trainer._prepare_inputs

    def poisoned(generation_batch: Any) -> Any:
        inputs = original(generation_batch)
        if trainer.model.training and trainer._step == micro_step:
            inputs = {**inputs, "advantages": inputs["advantages"] * float("nan")}
        return inputs

    trainer._prepare_inputs = poisoned
    return lambda: setattr(trainer, "_prepare_inputs", original)


class CorruptOptimizerState(TrainerCallback):
    """Write ``value`` (inf by default) into one Adam moment at the end of optimizer step ``step``.

    The entry: the first element of ``key`` (``exp_avg_sq``) of the first parameter with optimizer state (under ZeRO-2,
    this rank's first partition); ``rank``: only that ``RANK``, None every process. Runs after steadyrl's own step-end
    work, so the next step trains on the corrupted state and the next check finds it.
    """

    def __init__(self, step: int = 2, value: float = float("inf"), rank: int | None = None, key: str = "exp_avg_sq"):
        self.step, self.value, self.rank, self.key = step, value, rank, key
        self.fired = False

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        import os

        from steadyrl.trainers.recovery import optimizer_chain

        if state.global_step != self.step or self.fired:
            return
        if self.rank is not None and int(os.environ.get("RANK", "0")) != self.rank:
            return
        base = optimizer_chain(optimizer)[-1]
        first = next(st for st in base.state.values() if self.key in st)
        with torch.no_grad():
            first[self.key].view(-1)[0] = self.value
        self.fired = True


# ---------------------------------------------------------------------------------------- reward-side faults


def exact_match_nonfinite_burst(
    completions: Sequence[Any],
    answer: Sequence[str],
    fraction: float = 0.25,
    start: int = DEFAULT_FAULT_STEP,
    steps: int = 1,
    seed: int = 0,
    trainer_state: Any = None,
    **_: Any,
) -> list[float | None]:
    """Exact match, except during a burst: ``fraction`` of the rows are unscorable or non-finite.

    The burst hits the rollouts of optimizer steps ``start .. start + steps - 1`` (1-based; scored while
    ``global_step`` is one less): ``round(fraction * len(completions))`` rows, drawn with seed (seed, step), get
    ``None``, NaN, +inf, -inf in turn. TRL 1.16 reads None and NaN as unscorable; one inf makes its whole group's
    advantages NaN, which TRL then sets to 0.
    """
    scores: list[float | None] = list(exact_match(completions, answer))
    step = int(getattr(trainer_state, "global_step", 0) or 0) + 1  # the optimizer step these rollouts train
    if not start <= step < start + steps:
        return scores
    rng = np.random.default_rng([seed, step])
    hit = np.sort(rng.permutation(len(scores))[: round(fraction * len(scores))])
    for i, row in enumerate(hit.tolist()):
        scores[row] = BURST_VALUES[i % len(BURST_VALUES)]
    return scores


def artefact_offsets(n: int, rate: float, low: float, high: float, seed: int, step: int) -> np.ndarray:
    """Reward-model artefacts for one batch of ``n`` rows: each row, with probability ``rate``, gets an offset of
    magnitude uniform in ``[low, high]`` and a random sign; the others 0. Seeded by (seed, step) only, so every
    variant of a benchmark sees the same artefacts at the same rows of the same step. Shape (n,)."""
    rng = np.random.default_rng([seed, step, 4])
    hit = rng.random(n) < rate
    magnitude = rng.uniform(low, high, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return np.where(hit, sign * magnitude, 0.0)


def reward_model_artefacts(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    path: str | None = None,
    rate: float = 0.0,
    low: float = 5.0,
    high: float = 20.0,
    seed: int = 0,
    log: str | None = None,
    trainer_state: Any = None,
    **_: Any,
) -> list[float | None]:
    """A reward model's normalised score plus occasional large artefacts (``artefact_offsets``): the long-tailed learned
    RM of docs/DESIGN.md "GRADE: reward scaler". ``rate=0`` is the reward model alone.

    ``log``: a JSONL file, one line ``{"step", "prompts", "rewards", "artefacts"}`` per call with ``trainer_state``.
    """
    from steadyrl.trainers.reward_model import reward_model_score

    scores = reward_model_score(prompts, completions, path=path)
    step = int(getattr(trainer_state, "global_step", 0) or 0)
    offsets = artefact_offsets(len(scores), rate, low, high, seed, step) if rate > 0 else np.zeros(len(scores))
    out = [s + float(o) if s is not None else None for s, o in zip(scores, offsets, strict=True)]
    if log is not None and trainer_state is not None:
        row = {"step": step, "prompts": [str(p) for p in prompts], "rewards": out, "artefacts": offsets.tolist()}
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
    return out


def repetition_reward(completions: Sequence[Any], **_: Any) -> list[float]:
    """Pays for repetition (forced entropy collapse): the share of the completion taken by its most common character,
    when it occurs at least twice; else 0.0. ``"aaab"`` -> 0.75, ``"77"`` -> 1.0, ``"1212"`` -> 0.5, ``"ab"`` -> 0.0.
    """
    scores = []
    for completion in completions:
        text = _completion_text(completion)
        top = Counter(text).most_common(1)[0][1] if text else 0
        scores.append(top / len(text) if top >= 2 else 0.0)
    return scores


# --------------------------------------------------------------------------------------- trainer-side faults


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    return default if text is None or not text.strip() else float(text)


def fault_step_from_env(default: int = DEFAULT_FAULT_STEP) -> int:
    """``STEADYRL_FAULT_STEP`` as an int (the 1-based optimizer step a callback fault hits)."""
    return int(_env_number(FAULT_STEP_ENV, default))


def fault_rank_from_env() -> int | None:
    """``STEADYRL_FAULT_RANK`` as an int, or None (every process) when unset or empty."""
    text = os.environ.get(FAULT_RANK_ENV, "").strip()
    return int(text) if text else None


def _this_rank(rank: int | None) -> bool:
    return rank is None or int(os.environ.get("RANK", "0")) == rank


def record_fault(output_dir: str | os.PathLike[str] | None, fault: str, step: int, **fields: Any) -> None:
    """Append ``{"fault": fault, "step": step, "rank": RANK, **fields}`` to ``<output_dir>/faults.jsonl``."""
    if output_dir is None:
        return
    path = Path(output_dir) / FAULT_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"fault": fault, "step": int(step), "rank": int(os.environ.get("RANK", "0")), **fields}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_fault_log(output_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows ``record_fault`` wrote into ``<output_dir>/faults.jsonl`` (empty when nothing fired)."""
    path = Path(output_dir) / FAULT_LOG
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _times_nan(output: Any) -> Any:
    """A module output with its hidden states (a tensor, ``last_hidden_state`` or the first tuple item) times NaN."""
    if isinstance(output, torch.Tensor):
        return output * float("nan")
    if getattr(output, "last_hidden_state", None) is not None:  # transformers' ModelOutput
        output.last_hidden_state = output.last_hidden_state * float("nan")
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (output[0] * float("nan"), *output[1:])
    raise TypeError(f"NanLossAtStep cannot poison a module output of type {type(output).__name__}")


class NanLossAtStep(TrainerCallback):
    """NaN loss on one micro-batch: the first training forward of optimizer step ``step`` yields NaN hidden states.

    A forward hook on the backbone (``get_decoder()``: TRL 1.16 computes training log-probs from ``lm_head.weight``
    without calling ``lm_head``, so a hook there never fires) lets no-grad and eval-mode passes through, multiplies the
    first grad-enabled training pass's hidden states by NaN, and removes itself. step, rank: default
    ``STEADYRL_FAULT_STEP``, ``STEADYRL_FAULT_RANK`` (unset: every process).
    """

    name = "nan_loss"

    def __init__(self, step: int | None = None, rank: int | None = None) -> None:
        self.step = fault_step_from_env() if step is None else step
        self.rank = fault_rank_from_env() if rank is None else rank
        self.fired = False
        self._handle: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.fired or self._handle is not None or state.global_step + 1 != self.step or not _this_rank(self.rank):
            return
        target = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
        if target is None:
            raise RuntimeError("NanLossAtStep needs a model with a backbone (transformers' get_decoder())")
        output_dir = getattr(args, "output_dir", None)

        def poison(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
            if not (module.training and torch.is_grad_enabled()):
                return None
            self._remove()
            self.fired = True
            record_fault(output_dir, self.name, self.step)
            return _times_nan(output)

        self._handle = target.register_forward_hook(poison)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()  # a step without a training forward pass (cannot happen in GRPO) leaves no hook behind

    def _remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class InfExpAvgSqAtStep(CorruptOptimizerState):
    """``CorruptOptimizerState`` from the environment, for ``callbacks:`` in a config.

    Records the firing and, at the end of training, how many Adam moment entries are still non-finite
    (``nonfinite_state_entries``): Adam divides by ``sqrt(inf)``, so an unguarded run does not die, the entry's weight
    silently stops learning.
    """

    name = "inf_exp_avg_sq"

    def __init__(self, step: int | None = None, value: float | None = None, rank: int | None = None) -> None:
        super().__init__(
            step=fault_step_from_env() if step is None else step,
            value=_env_number(FAULT_VALUE_ENV, math.inf) if value is None else value,
            rank=fault_rank_from_env() if rank is None else rank,
        )

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        before = self.fired
        super().on_step_end(args, state, control, optimizer=optimizer, **kwargs)
        if self.fired and not before:
            record_fault(getattr(args, "output_dir", None), self.name, self.step, value=str(self.value))

    def on_train_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        from steadyrl.trainers.recovery import optimizer_chain

        if not self.fired or optimizer is None:
            return
        base = optimizer_chain(optimizer)[-1]
        bad = sum(
            int((~torch.isfinite(t)).sum())
            for st in base.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        )
        record_fault(getattr(args, "output_dir", None), "train_end", state.global_step, nonfinite_state_entries=bad)


class GradSpikeAtStep(TrainerCallback):
    """Gradient spike: every trainable parameter's gradient times ``scale`` during optimizer step ``step``.

    Tensor hooks go on at ``on_step_begin`` (every micro-batch is hit, before clipping or a step guard) and come off at
    ``on_step_end``. Defaults: ``STEADYRL_FAULT_STEP``, ``STEADYRL_FAULT_SCALE`` or 1e4, ``STEADYRL_FAULT_RANK``.
    """

    name = "grad_spike"

    def __init__(self, step: int | None = None, scale: float | None = None, rank: int | None = None) -> None:
        self.step = fault_step_from_env() if step is None else step
        self.scale = _env_number(FAULT_SCALE_ENV, 1e4) if scale is None else scale
        self.rank = fault_rank_from_env() if rank is None else rank
        self.fired = False
        self._handles: list[Any] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.fired or state.global_step + 1 != self.step or not _this_rank(self.rank) or model is None:
            return
        output_dir = getattr(args, "output_dir", None)

        def spike(grad: torch.Tensor) -> torch.Tensor:
            if not self.fired:
                self.fired = True
                record_fault(output_dir, self.name, self.step, scale=self.scale)
            return grad * self.scale

        self._handles = [p.register_hook(spike) for p in model.parameters() if p.requires_grad]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class StaleVllmAfterStep(TrainerCallback):
    """A weight sync that stops reaching vLLM: from the end of optimizer step ``step`` (default ``STEADYRL_FAULT_STEP``)
    on, TRL's ``VLLMGeneration.sync_weights`` does nothing, so vLLM keeps generating from that step's starting weights.

    Stands for a sync that silently writes nowhere (a loader that ignores unknown names, packed kernels keeping a copy).
    Patches the class for the rest of the process; records the firing and, at the end, ``swallowed_syncs``.
    """

    name = "stale_vllm"

    def __init__(self, step: int | None = None) -> None:
        self.step = fault_step_from_env() if step is None else step
        self.fired = False
        self.swallowed = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.fired or state.global_step != self.step:
            return
        from trl.generation.vllm_generation import VLLMGeneration

        def swallow(generation: Any) -> None:
            self.swallowed += 1

        VLLMGeneration.sync_weights = swallow  # type: ignore[method-assign]
        self.fired = True
        record_fault(getattr(args, "output_dir", None), self.name, self.step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.fired:
            output_dir = getattr(args, "output_dir", None)
            record_fault(output_dir, "train_end", state.global_step, swallowed_syncs=self.swallowed)
