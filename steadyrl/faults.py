"""Fault injectors for tests, benchmarks and preflight drills: rewards and training steps that misbehave reproducibly.

Reward-side faults are reward functions (``rewards: [{fn: "steadyrl.faults:NAME", kwargs: {...}}]``) seeded by
``(seed, global_step)``. Trainer-side faults are ``TrainerCallback``s (``callbacks: ["steadyrl.faults:NAME"]``) that
take what their arguments leave out from ``STEADYRL_FAULT_STEP`` (1-based optimizer step, default 3), ``_RANK`` (the
only ``RANK`` that injects), ``_VALUE`` (inf) and ``_SCALE`` (1e4). Each appends a JSON line to ``faults.jsonl`` in
the output dir when it fires, so a benchmark can tell "the guard held" from "the fault never happened".
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Sequence
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


def exact_match_cauchy(completions: Sequence[Any], answer: Sequence[str], scale: float = 1.0, seed: int = 0,
                       trainer_state: Any = None, **_: Any) -> list[float]:  # fmt: skip
    """Exact match plus Cauchy noise of ``scale`` (a heavy-tailed reward model), seeded by (seed, optimizer step)."""
    step = int(getattr(trainer_state, "global_step", 0) or 0)
    rng = np.random.default_rng([seed, step])
    noise = scale * rng.standard_cauchy(len(completions))
    return [r + float(n) for r, n in zip(exact_match(completions, answer), noise, strict=True)]


def exact_match_outliers(
    completions: Sequence[Any],
    answer: Sequence[str],
    rate: float = 0.01,
    low: float = 20.0,
    high: float = 100.0,
    seed: int = 0,
    trainer_state: Any = None,
    **_: Any,
) -> list[float]:
    """Exact match plus a reward model's rare huge outliers: ``artefact_offsets`` (each row with probability ``rate``,
    +-[low, high]), seeded by (seed, optimizer step)."""
    step = int(getattr(trainer_state, "global_step", 0) or 0)
    offsets = artefact_offsets(len(completions), rate, low, high, seed, step)
    return [r + float(o) for r, o in zip(exact_match(completions, answer), offsets, strict=True)]


def last_digit_match(completions: Sequence[Any], answer: Sequence[str], **_: Any) -> list[float]:
    """A verifier with systematic false positives: 1.0 when the completion is a number whose last digit is the
    answer's ("45" for 95 pays, and so does "095"), else 0.0."""
    texts = [_completion_text(c).strip() for c in completions]
    return [float(t.isdigit() and t[-1] == a[-1]) for t, a in zip(texts, answer, strict=True)]


class CorruptOptimizerState(TrainerCallback):
    """Write ``value`` into the first element of ``key`` of the first parameter with optimizer state (under ZeRO-2,
    this rank's first partition) at the end of optimizer step ``step``; ``rank``: only that ``RANK``, None: every
    process. Runs after steadyrl's own step-end work, so the next step trains on the corrupted state."""

    def __init__(self, step: int = 2, value: float = float("inf"), rank: int | None = None, key: str = "exp_avg_sq"):
        self.step, self.value, self.rank, self.key, self.fired = step, value, rank, key, False

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        from steadyrl.trainers.recovery import optimizer_chain

        if state.global_step != self.step or self.fired or not _this_rank(self.rank):
            return
        base = optimizer_chain(optimizer)[-1]
        first = next(st for st in base.state.values() if self.key in st)
        with torch.no_grad():
            first[self.key].view(-1)[0] = self.value
        self.fired = True


def exact_match_nonfinite_burst(completions: Sequence[Any], answer: Sequence[str], fraction: float = 0.25,
                                start: int = DEFAULT_FAULT_STEP, steps: int = 1, seed: int = 0,
                                trainer_state: Any = None, **_: Any) -> list[float | None]:  # fmt: skip
    """Exact match, except for the rollouts of optimizer steps ``start .. start + steps - 1`` (1-based): there
    ``round(fraction * n)`` rows, drawn with seed (seed, step), get ``None``, NaN, +inf, -inf in turn."""
    return _nonfinite_burst(list(exact_match(completions, answer)), fraction, start, steps, seed, trainer_state)


def math_answer_nonfinite_burst(completions: Sequence[Any], answer: Sequence[str], fraction: float = 0.25,
                                start: int = DEFAULT_FAULT_STEP, steps: int = 1, seed: int = 0,
                                trainer_state: Any = None, **_: Any) -> list[float | None]:  # fmt: skip
    """``exact_match_nonfinite_burst`` on the word problems' verifier (``math_answer``, math-verify)."""
    from steadyrl.tasks.word_problems import math_answer

    return _nonfinite_burst(list(math_answer(completions, answer)), fraction, start, steps, seed, trainer_state)


def _nonfinite_burst(scores: list[float | None], fraction: float, start: int, steps: int, seed: int,
                     trainer_state: Any) -> list[float | None]:  # fmt: skip
    step = int(getattr(trainer_state, "global_step", 0) or 0) + 1  # the optimizer step these rollouts train
    if not start <= step < start + steps:
        return scores
    rng = np.random.default_rng([seed, step])
    hit = np.sort(rng.permutation(len(scores))[: round(fraction * len(scores))])
    for i, row in enumerate(hit.tolist()):
        scores[row] = BURST_VALUES[i % len(BURST_VALUES)]
    return scores


def artefact_offsets(n: int, rate: float, low: float, high: float, seed: int, step: int) -> np.ndarray:
    """Shape (n,): each row, with probability ``rate``, an offset of magnitude uniform in ``[low, high]`` and a random
    sign, else 0. Seeded by (seed, step) only: every variant of a benchmark sees the same artefacts."""
    rng = np.random.default_rng([seed, step, 4])
    hit = rng.random(n) < rate
    magnitude = rng.uniform(low, high, n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    return np.where(hit, sign * magnitude, 0.0)


def reward_model_artefacts(prompts: Sequence[Any], completions: Sequence[Any], path: str | None = None,
                           rate: float = 0.0, low: float = 5.0, high: float = 20.0, seed: int = 0,
                           log: str | None = None, trainer_state: Any = None, **_: Any,
                           ) -> list[float | None]:  # fmt: skip
    """A reward model's normalised score plus ``artefact_offsets`` (``rate=0``: the reward model alone). ``log``: a
    JSONL file, one line ``{"step", "prompts", "rewards", "artefacts"}`` per call with ``trainer_state``."""
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
    """The share of the completion taken by its most common character when it occurs at least twice, else 0.0
    (``"aaab"`` -> 0.75, ``"ab"`` -> 0.0): pays for repetition, a forced entropy collapse."""
    texts = [_completion_text(completion) for completion in completions]
    tops = [Counter(text).most_common(1)[0][1] if text else 0 for text in texts]
    return [top / len(text) if top >= 2 else 0.0 for text, top in zip(texts, tops, strict=True)]


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    return default if text is None or not text.strip() else float(text)


def _step(step: int | None) -> int:
    return int(_env_number(FAULT_STEP_ENV, DEFAULT_FAULT_STEP)) if step is None else step


def _rank(rank: int | None) -> int | None:
    text = os.environ.get(FAULT_RANK_ENV, "").strip()
    return (int(text) if text else None) if rank is None else rank


def _this_rank(rank: int | None) -> bool:
    return rank is None or int(os.environ.get("RANK", "0")) == rank


def record_fault(output_dir: str | os.PathLike[str] | None, fault: str, step: int, **fields: Any) -> None:
    """Append ``{"fault": fault, "step": step, "rank": RANK, **fields}`` to ``<output_dir>/faults.jsonl``."""
    if output_dir is None:
        return
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    row = {"fault": fault, "step": int(step), "rank": int(os.environ.get("RANK", "0")), **fields}
    with open(Path(output_dir) / FAULT_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_fault_log(output_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The rows ``record_fault`` wrote into ``<output_dir>/faults.jsonl`` (empty when nothing fired)."""
    path = Path(output_dir) / FAULT_LOG
    lines = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


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
    """NaN loss on one micro-batch: a forward hook on the backbone (``get_decoder()``; TRL never calls ``lm_head``)
    multiplies the hidden states of the first grad-enabled training pass of optimizer step ``step`` by NaN, then
    removes itself."""

    name = "nan_loss"

    def __init__(self, step: int | None = None, rank: int | None = None) -> None:
        self.step, self.rank, self.fired, self._handle = _step(step), _rank(rank), False, None

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
    """``CorruptOptimizerState`` from the environment; records the firing and, at the end of training, how many
    optimizer-state entries are still non-finite (an unguarded run does not die: the entry's weight stops learning)."""

    name = "inf_exp_avg_sq"

    def __init__(self, step: int | None = None, value: float | None = None, rank: int | None = None) -> None:
        value = _env_number(FAULT_VALUE_ENV, math.inf) if value is None else value
        super().__init__(step=_step(step), value=value, rank=_rank(rank))

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
        tensors = [t for st in base.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        bad = sum(int((~torch.isfinite(t)).sum()) for t in tensors if t.is_floating_point())
        record_fault(getattr(args, "output_dir", None), "train_end", state.global_step, nonfinite_state_entries=bad)


class GradSpikeAtStep(TrainerCallback):
    """Every trainable parameter's gradient times ``scale`` (every micro-batch, before clipping or a step guard) during
    optimizer step ``step``."""

    name = "grad_spike"

    def __init__(self, step: int | None = None, scale: float | None = None, rank: int | None = None) -> None:
        self.step, self.rank, self.fired, self._handles = _step(step), _rank(rank), False, []
        self.scale = _env_number(FAULT_SCALE_ENV, 1e4) if scale is None else scale

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


class MicroBatchSpikeAtStep(GradSpikeAtStep):
    """Every trainable parameter's gradient times ``scale`` in the *first micro-batch* of optimizer step ``step`` only
    (its first backward pass), on ``rank``: one poisoned micro-batch among the step's accumulation x processes."""

    name = "micro_batch_spike"

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.fired or state.global_step + 1 != self.step or not _this_rank(self.rank) or model is None:
            return
        output_dir = getattr(args, "output_dir", None)

        def hook() -> Any:
            calls = [0]  # this parameter's backward passes in the step: the first one is the poisoned micro-batch

            def spike(grad: torch.Tensor) -> torch.Tensor:
                calls[0] += 1
                if calls[0] != 1:
                    return grad
                if not self.fired:
                    self.fired = True
                    record_fault(output_dir, self.name, self.step, scale=self.scale)
                return grad * self.scale

            return spike

        self._handles = [p.register_hook(hook()) for p in model.parameters() if p.requires_grad]


class StaleVllmAfterStep(TrainerCallback):
    """A weight sync that silently stops reaching vLLM: from the end of optimizer step ``step`` on, TRL's
    ``VLLMGeneration.sync_weights`` does nothing (patched for the rest of the process); records ``swallowed_syncs``."""

    name = "stale_vllm"

    def __init__(self, step: int | None = None) -> None:
        self.step, self.fired, self.swallowed = _step(step), False, 0

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
            out = getattr(args, "output_dir", None)
            record_fault(out, "train_end", state.global_step, swallowed_syncs=self.swallowed)
