"""The rollout-trainer mismatch (steadyrl.guards.mismatch): mismatch/* by hand, the ESS gate, the config checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from steadyrl.config import load_config
from steadyrl.config.loader import ConfigError
from steadyrl.guards.mismatch import MismatchError, MismatchGate, gather_rows, log_ratio_rows, measure
from steadyrl.trainers.layers import guard_parts
from tests.unit.test_config import BASE, write

LN2 = math.log(2.0)
NAN = math.nan
# two sequences: tokens with ratio 2, 1 | 1 and one token vLLM gave no log-prob for (NaN)
ROWS = torch.tensor([[LN2, 0.0], [0.0, NAN]])


def test_every_metric_by_hand():
    found = measure(ROWS, "token_truncate", None, 1.5)
    rho = [2.0, 1.0, 1.0]  # the scored tokens' ratios; sequence weights exp(S) = 2 and 1
    assert found["mismatch/corrected_share"] == pytest.approx(1 / 3)  # one token above clip_max 1.5
    assert found["mismatch/ess"] == pytest.approx((2 + 1) ** 2 / (2 * (4 + 1)))  # 0.9
    assert found["mismatch/ratio_q01"] == pytest.approx(1.0)
    assert found["mismatch/ratio_q99"] == pytest.approx(1.98)  # sorted 1, 1, 2: 1 + 0.98 x (2 - 1)
    assert found["mismatch/log_ppl_diff"] == pytest.approx(-(LN2 / 2 + 0.0) / 2)  # per-sequence token means
    assert found["mismatch/kl"] == pytest.approx(sum(p - 1 - math.log(p) for p in rho) / 3)
    assert found["mismatch/chi2"] == pytest.approx(sum((p - 1) ** 2 for p in rho) / 3)  # 1/3


def test_sequence_modes_judge_whole_sequences_and_clip_min_counts():
    assert measure(ROWS, "sequence_mask", None, 1.5)["mismatch/corrected_share"] == pytest.approx(1 / 2)
    assert measure(ROWS, "sequence_mask", None, 3.0)["mismatch/corrected_share"] == 0.0
    low = torch.tensor([[math.log(0.25), 0.0]])  # one token vLLM found 4x likelier than the trainer
    assert measure(low, "token_mask", 0.5, 3.0)["mismatch/corrected_share"] == pytest.approx(1 / 2)
    assert measure(low, "token_mask", None, 3.0)["mismatch/corrected_share"] == 0.0


def test_agreement_is_ess_one_and_zero_distance():
    found = measure(torch.zeros(4, 3), "sequence_mask", None, 3.0)
    assert found["mismatch/ess"] == pytest.approx(1.0) and found["mismatch/kl"] == 0.0
    assert found["mismatch/chi2"] == 0.0 and found["mismatch/corrected_share"] == 0.0


def test_ess_survives_huge_log_ratios_and_reaches_one_over_n():
    rows = torch.tensor([[800.0], [0.0], [0.0], [0.0]])  # exp(800) overflows a double: the shift keeps it finite
    assert measure(rows, "sequence_mask", None, 3.0)["mismatch/ess"] == pytest.approx(1 / 4)
    assert measure(torch.full((2, 2), NAN), "token_mask", None, 3.0) == {}  # nothing scored: nothing logged


def test_log_ratio_rows_masks_padding_and_tools():
    output = {
        "old_per_token_logps": torch.tensor([[-1.0, -2.0, -3.0]]),
        "sampling_per_token_logps": torch.tensor([[-1.5, -2.0, -9.0]]),
        "completion_mask": torch.tensor([[1, 1, 0]]),
    }
    assert torch.allclose(log_ratio_rows(output), torch.tensor([[0.5, 0.0, NAN]]), equal_nan=True)
    output["tool_mask"] = torch.tensor([[1, 0, 1]])
    assert torch.allclose(log_ratio_rows(output), torch.tensor([[0.5, NAN, NAN]]), equal_nan=True)
    assert log_ratio_rows({"completion_mask": output["completion_mask"]}) is None  # no vLLM: no sampling log-probs


def test_gather_rows_pads_each_rank_to_the_widest():
    parts = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0, 5.0]])]  # two ranks, widths 2 and 3
    calls = []

    def gather(t):  # what accelerate's gather does with every rank's flat tensor
        calls.append(t)
        if t.numel() == 1:
            return torch.tensor([2, 3])
        return torch.cat([torch.nn.functional.pad(parts[0], (0, 1), value=NAN).reshape(-1), t])

    out = gather_rows(parts[1], gather, processes=2)
    assert torch.allclose(out, torch.tensor([[1.0, 2.0, NAN], [3.0, 4.0, 5.0]]), equal_nan=True)
    assert len(calls) == 2 and gather_rows(parts[0], gather, processes=1) is not None


def test_gate_skips_below_ess_min_and_stops_when_it_never_recovers():
    gate = MismatchGate(0.5, max_consecutive=2)
    norm = torch.tensor(1.0)
    assert not gate.decide(norm, 0).skip  # no vLLM batch measured yet
    gate.note(0.9)
    assert not gate.decide(norm, 1).skip
    gate.note(0.3)
    decision = gate.decide(norm, 2)
    assert decision.skip and decision.reason == "mismatch"
    # the same batch trains the next step too (steps_per_generation): the 2nd low-ESS step in a row stops the run
    with pytest.raises(MismatchError, match=r"step 4: 2 optimizer steps in a row .* guards.gepo.mismatch.ess_min=0.5"):
        gate.decide(norm, 3)
    other = MismatchGate(0.5)
    other.load_state_dict(gate.state_dict())
    assert (other.ess, other.skipped, other.consecutive) == (0.3, 2, 2)
    gate.note(0.6)
    assert not gate.decide(norm, 5).skip and gate.consecutive == 0


def test_the_gate_is_off_by_default_and_on_with_ess_min():
    parts = guard_parts("all")
    assert parts.mismatch is not None and parts.mismatch.ess_min is None
    assert not any(isinstance(g, MismatchGate) for g in parts.step_guards)
    parts = guard_parts({"gepo": {"enabled": True, "mismatch": {"ess_min": 0.4}}})
    gates = [g for g in parts.step_guards if isinstance(g, MismatchGate)]
    assert len(gates) == 1 and gates[0].ess_min == 0.4
    assert guard_parts({"gepo": {"enabled": True, "mismatch": {"enabled": False}}}).mismatch is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("guards.gepo.mismatch.ess_min=1.5", r"ess_min \(set in command line\): must be in \(0, 1\) \(or null\)"),
        ("guards.gepo.mismatch.ess_min=0.5", r"ignores it while trainer.use_vllm is false .* trainer.use_vllm=true"),
        ("trainer.vllm_importance_sampling_mode=token", r"'token' is not one of \['token_truncate'"),
        ("trainer.vllm_importance_sampling_clip_max=0.9", r"clip_max: 0.9 must be above 1"),
        ("trainer.vllm_importance_sampling_clip_min=1.0", r"clip_min: 1.0 must be in \[0, 1\)"),
    ],
)
def test_bad_settings_are_refused_before_anything_loads(tmp_path: Path, override: str, message: str, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # as if vLLM were installed
    base = write(tmp_path / "grpo.yaml", BASE)
    vllm = [] if override.endswith("=0.5") else ["trainer.use_vllm=true"]
    with pytest.raises(ConfigError, match=message):
        load_config(base, ["guards.gepo.enabled=true", *vllm, override])


def test_trl_defaults_and_valid_choices_pass(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    base = write(tmp_path / "grpo.yaml", BASE)
    load_config(base)
    overrides = [
        "guards.gepo.enabled=true",
        "trainer.use_vllm=true",
        "trainer.vllm_importance_sampling_mode=token_mask",
    ]
    cfg = load_config(
        base, [*overrides, "trainer.vllm_importance_sampling_clip_min=0.5", "guards.gepo.mismatch.ess_min=0.3"]
    )
    assert cfg.trainer["vllm_importance_sampling_mode"] == "token_mask"


def test_ratio_quantiles_of_a_batch_past_torch_quantiles_limit():
    # 2^24 + 1 scored tokens (a 7B batch of long completions): torch.quantile refuses the whole; a sample of 2^20
    # reads the 1st and 99th percentile of a known distribution within 0.01 of the exact ones
    n = (1 << 24) + 1
    rank = torch.arange(n, dtype=torch.float64) / (n - 1)  # rho uniform on [1, 2]: q01 = 1.01, q99 = 1.99
    found = measure(torch.log1p(rank).view(1, -1), "token_truncate", None, 3.0)
    assert found["mismatch/ratio_q01"] == pytest.approx(1.01, abs=0.01)
    assert found["mismatch/ratio_q99"] == pytest.approx(1.99, abs=0.01)
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(torch.log1p(rank).exp(), torch.tensor([0.01], dtype=torch.float64))
