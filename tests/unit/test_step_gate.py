"""The optimizer-step gate against a fake context: veto, bookkeeping, error-feedback hand-off, clipping."""

from __future__ import annotations

import math

import pytest
import torch
from fake_context import FakeContext

from steadyrl.guards.base import StepDecision
from steadyrl.metrics import EVENT_SKIP, GEPO_SKIPPED_STEPS, OPEFO_EF_WEIGHT, gepo_skipped
from steadyrl.trainers.step_gate import StepGate


class _Threshold:
    """Vetoes a norm above ``limit`` (reason ``spike``) or a non-finite one (``nonfinite``)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.skipped: list[tuple[int, str]] = []

    def decide(self, grad_norm: torch.Tensor, step: int) -> StepDecision:
        norm = float(grad_norm)
        if not math.isfinite(norm):
            return StepDecision(True, "nonfinite")
        return StepDecision(norm > self.limit, "spike" if norm > self.limit else "")

    def on_skip(self, gradients: list, decision: StepDecision, step: int) -> None:
        self.skipped.append((step, decision.reason))


class _Feedback:
    """ErrorFeedback's interface: a residual is always pending; applying it adds 1 to every gradient."""

    pending = True

    def __init__(self) -> None:
        self.stored: list[list[torch.Tensor]] = []
        self.fed = 0

    def store(self, gradients: list) -> bool:
        self.stored.append([g.clone() for g in gradients])
        return True

    def apply(self, gradients: list) -> dict[str, float]:
        self.fed += 1
        for g in gradients:
            g.add_(1.0)  # changes the gradients: the gate must norm them again
        return {OPEFO_EF_WEIGHT: 1.0}


def _model_with_grad(value: float) -> torch.nn.Linear:
    model = torch.nn.Linear(2, 1, bias=False)
    model.weight.grad = torch.full_like(model.weight, value)
    return model


def test_a_veto_drops_the_gradients_counts_and_records_the_step_it_belongs_to() -> None:
    ctx, guard, feedback = FakeContext(step=4), _Threshold(1.0), _Feedback()
    gate = StepGate([guard], ctx, feedback)
    model = _model_with_grad(3.0)  # norm sqrt(2) * 3 = 4.24
    norm, skipped = gate.clip_or_skip(model, max_grad_norm=1.0)
    assert skipped and float(norm) == pytest.approx(3 * math.sqrt(2))
    assert model.weight.grad is None
    assert guard.skipped == [(4, "spike")] and feedback.fed == 0
    assert feedback.stored[0][0].tolist() == [[3.0, 3.0]]
    assert ctx.events == [(5, EVENT_SKIP, {"reason": "spike", "grad_norm": pytest.approx(3 * math.sqrt(2))})]
    assert ctx.metrics == [(GEPO_SKIPPED_STEPS, 1.0), (gepo_skipped("spike"), 1.0)]
    assert gate.counters == {"skipped_steps": 1.0, "skipped_spike": 1.0}
    assert ctx.seconds > 0


def test_a_taken_step_gets_error_feedback_then_is_clipped_on_the_new_norm() -> None:
    ctx, feedback = FakeContext(), _Feedback()
    gate = StepGate([_Threshold(10.0)], ctx, feedback)
    model = _model_with_grad(0.5)  # norm 0.707: taken; feedback makes the gradient 1.5 (norm 2.12)
    norm, skipped = gate.clip_or_skip(model, max_grad_norm=1.0)
    assert not skipped and feedback.fed == 1
    assert float(norm) == pytest.approx(1.5 * math.sqrt(2))
    torch.testing.assert_close(model.weight.grad, torch.full((1, 2), 1 / math.sqrt(2)))  # clipped to norm 1
    assert ctx.metrics == [(GEPO_SKIPPED_STEPS, 0.0), (OPEFO_EF_WEIGHT, 1.0)] and ctx.events == []


def test_reasons_are_counted_one_by_one() -> None:
    """Each guard's reason counts (two guards that both say ``spike`` count it twice); the step counts once."""
    ctx = FakeContext()
    gate = StepGate([_Threshold(1.0), _Threshold(0.5)], ctx)
    gate.decide(torch.tensor(float("nan")), [])
    gate.decide(torch.tensor(2.0), [])
    assert gate.counters == {"skipped_steps": 2.0, "skipped_nonfinite": 2.0, "skipped_spike": 2.0}
    assert [e[2]["reason"] for e in ctx.events] == ["nonfinite,nonfinite", "spike,spike"]


def test_deepspeed_installation_refuses_an_optimizer_without_zero_hooks() -> None:
    gate = StepGate([_Threshold(1.0)], FakeContext())
    optimizer = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="ZeRO stage 1/2"):
        gate.install_deepspeed(optimizer)


class _FakeZero:
    """The two DeepSpeed ZeRO-1/2 methods the gate hooks, as ``DeepSpeedZeroOptimizer.step`` calls them."""

    def __init__(self, norm: float) -> None:
        self.norm, self.loss_scale, self.overflow = norm, 1.0, False
        self.averaged_gradients = {0: [torch.ones(2)]}

    def scaled_global_norm(self, norm_type: int = 2) -> torch.Tensor:
        return torch.tensor(self.norm)

    def _update_scale(self, has_overflow: bool = False) -> None:
        self.overflow = has_overflow

    def step(self) -> bool:
        self.scaled_global_norm()
        self._update_scale(False)
        return self.overflow  # True: DeepSpeed drops the gradients and returns


def test_deepspeed_hook_raises_overflow_on_a_veto_only() -> None:
    ctx = FakeContext()
    gate = StepGate([_Threshold(1.0)], ctx)
    zero = _FakeZero(norm=5.0)
    gate.install_deepspeed(zero)
    gate.install_deepspeed(zero)  # idempotent
    assert zero.step() is True and gate.counters["skipped_steps"] == 1
    zero.norm = 0.5
    assert zero.step() is False and gate.counters["skipped_steps"] == 1


def test_a_step_the_mismatch_gate_skips_is_not_fed_back_a_spike_skip_is() -> None:
    from steadyrl.guards.error_feedback import ErrorFeedback, ErrorFeedbackConfig
    from steadyrl.guards.mismatch import MismatchGate

    mismatch, spike = MismatchGate(0.9), _Threshold(1.0)
    feedback = ErrorFeedback(ErrorFeedbackConfig(enabled=True))
    gate = StepGate([spike, mismatch], FakeContext(step=3), feedback)
    mismatch.note(0.5)  # off-policy batch, small gradient: only the mismatch gate vetoes
    skipped = gate.clip_or_skip(_model_with_grad(0.1), max_grad_norm=1.0)[1]
    assert skipped and gate.counters == {"skipped_steps": 1.0, "skipped_mismatch": 1.0}
    assert not feedback.pending and feedback.stored == 0
    mismatch.note(0.5)  # both veto: the off-policy direction wins, nothing kept
    assert gate.clip_or_skip(_model_with_grad(3.0), max_grad_norm=1.0)[1]
    assert not feedback.pending and gate.counters["skipped_spike"] == 1.0
    mismatch.note(0.99)  # on-policy spike: kept for feedback as before
    assert gate.clip_or_skip(_model_with_grad(3.0), max_grad_norm=1.0)[1]
    assert feedback.pending and feedback.stored == 1
