"""The rollout-trainer mismatch (steadyrl.guards.mismatch): mismatch/* by hand, the ESS gate, the config checks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from steadyrl.config import load_config
from steadyrl.config.loader import ConfigError
from steadyrl.guards.mismatch import MismatchError, MismatchGate, log_ratio_rows, measure
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


def _two_ranks(parts: list[torch.Tensor], **kw) -> tuple[list[dict[str, float]], list[list[int]]]:
    """``measure`` on two ranks (threads) with a real all-gather of their flat tensors; the sizes each rank sent."""
    from tests.unit.test_opefo import FakeRanks

    ranks, sizes = FakeRanks(2), [[], []]

    def run(rank: int) -> dict[str, float]:
        gather = ranks.all_gather(rank)

        def sent(t: torch.Tensor) -> torch.Tensor:
            sizes[rank].append(t.numel())
            return gather(t)

        return measure(parts[rank], "token_truncate", None, 1.5, sent, 2, rank)

    return ranks.run(run), sizes


def test_two_ranks_measure_the_whole_batch_without_sending_their_matrices():
    # ranks with other widths and row counts, one row with nothing scored: every metric equals the one-process
    # measure of the stacked batch (all tokens sampled: 2 x 3 + 3 x 5 < QUANTILE_SAMPLE)
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(2, 3, generator=g), torch.randn(3, 5, generator=g)]
    parts[1][1] = NAN
    parts[0][0, 2] = NAN
    stacked = torch.full((5, 5), NAN)
    stacked[:2, :3], stacked[2:] = parts
    whole = measure(stacked, "token_truncate", None, 1.5)
    found, sizes = _two_ranks(parts)
    for got in found:
        assert got.keys() == whole.keys() and got == pytest.approx(whole, rel=1e-12)
    assert sizes == [[2, 8 + 10], [2, 8 + 10]]  # (tokens, max S); 8 sums + the widest share (rank 1's 10 tokens)


def test_the_gathered_sample_is_bounded_and_drawn_in_proportion_to_each_ranks_tokens(monkeypatch):
    from steadyrl.guards import mismatch

    monkeypatch.setattr(mismatch, "QUANTILE_SAMPLE", 4000)
    # rank 0: 39,800 tokens with rho uniform on [1, 2]; rank 1: 200 at rho 4 (0.5 %). The batch's q01 = 1.010 and
    # q99 = 1.995 (the 4s are above it); a sample split evenly between the ranks would read q99 = 4
    parts = [torch.log1p(torch.arange(39_800, dtype=torch.float64) / 39_799).view(199, 200),
             torch.full((1, 200), math.log(4.0), dtype=torch.float64)]  # fmt: skip
    found, sizes = _two_ranks(parts)
    assert found[0] == found[1]
    assert sizes[0][1] == sizes[1][1] == 8 + 3980  # shares 3,980 and 20 of 4,000, padded to the wider
    assert found[0]["mismatch/ratio_q01"] == pytest.approx(1.010, abs=0.005)
    assert found[0]["mismatch/ratio_q99"] == pytest.approx(1.995, abs=0.005)
    assert found[0]["mismatch/kl"] == pytest.approx(
        (sum((1 + i / 39_799) - 1 - math.log1p(i / 39_799) for i in range(39_800)) + 200 * (3 - math.log(4)))
        / 40_000, rel=1e-9)  # fmt: skip
    # a rank with no scored token still takes part in both gathers
    found, sizes = _two_ranks([torch.full((2, 2), NAN), torch.zeros(1, 3)])
    assert found[0] == found[1] and found[0]["mismatch/ess"] == 1.0 and len(sizes[0]) == 2


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


def test_truncation_band_by_hand():
    from steadyrl.guards.mismatch import truncation_band

    assert truncation_band({"top_p": 0.95}, "1.16.0") == pytest.approx(math.log(0.95))
    assert truncation_band({"top_p": 0.95, "top_k": 20}, "1.16.2") == -math.inf
    assert truncation_band({"top_p": 1.0, "min_p": 0.05}, "1.15.0") == -math.inf
    assert truncation_band({"top_p": 1.0, "top_k": 0, "min_p": None}, "1.16.0") is None  # TRL's defaults: no bias
    assert truncation_band({"top_p": 0.9}, "1.17.0") is None and truncation_band({"top_p": 0.9}, None) is None


def test_an_in_sync_truncated_batchs_ess_is_one_and_a_stale_one_still_falls():
    # every token's log-ratio is the log of its position's kept mass (top_p 0.95: in [log 0.95, 0]); sequences of
    # 4 to 128 tokens. Raw, the ESS of exp(S) falls with length on a run whose weights are in sync
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 129, (64,), generator=g)
    kept = torch.log(0.95 + 0.05 * torch.rand(64, 128, generator=g, dtype=torch.float64))
    kept = kept.masked_fill(torch.arange(128) >= lengths[:, None], NAN)
    band = math.log(0.95)
    raw = measure(kept, "token_truncate", None, 3.0)["mismatch/ess"]
    in_sync = measure(kept, "token_truncate", None, 3.0, band=band)
    assert raw < 0.6 and in_sync["mismatch/ess"] == 1.0  # raw: 0.56
    assert in_sync["mismatch/kl"] == measure(kept, "token_truncate", None, 3.0)["mismatch/kl"]  # only the ESS moves
    # a stale sync: the policy moved, log-ratios spread both ways well past the band
    stale = kept + 0.3 * torch.randn(64, 128, generator=g, dtype=torch.float64)
    assert measure(stale, "token_truncate", None, 3.0, band=band)["mismatch/ess"] < 0.5
    # top_k: the band is unbounded below; a token the trainer finds likelier than vLLM did still counts
    assert measure(kept, "token_truncate", None, 3.0, band=-math.inf)["mismatch/ess"] == 1.0
    assert measure(stale, "token_truncate", None, 3.0, band=-math.inf)["mismatch/ess"] < 0.5


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_a_sequence_mode_with_truncated_sampling_is_refused_on_trl_1_16(tmp_path: Path, mode: str, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    base = write(tmp_path / "grpo.yaml", BASE)
    vllm = ["trainer.use_vllm=true", f"trainer.vllm_importance_sampling_mode={mode}"]
    with pytest.raises(ConfigError, match=rf"{mode} with top_p=0.9, TRL 1\.16.* kept probability mass .*trl#6789.*"
                       r"between 0\.9 and 1 .* product over its tokens .* token_truncate"):  # fmt: skip
        load_config(base, [*vllm, "trainer.top_p=0.9"])
    with pytest.raises(ConfigError, match=r"top_k=20, .* down to 0 \(top_k/min_p: unbounded\)"):
        load_config(base, [*vllm, "trainer.top_k=20"])
    load_config(base, [*vllm, "trainer.top_p=0.9", "trainer.vllm_importance_sampling_correction=false"])
    load_config(base, [*vllm, "trainer.top_p=1.0"])  # no truncation: no bias
    load_config(base, [f"trainer.vllm_importance_sampling_mode={mode}", "trainer.top_p=0.9"])  # no vLLM: none


def test_a_token_mode_with_truncated_sampling_is_stated_at_load(tmp_path: Path, monkeypatch, caplog):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    base = write(tmp_path / "grpo.yaml", BASE)
    load_config(base, ["trainer.use_vllm=true", "trainer.vllm_importance_sampling_mode=token_truncate",
                       "trainer.top_p=0.95"])  # fmt: skip
    assert "token_truncate with top_p=0.95" in caplog.text and "between 0.95 and 1" in caplog.text


def test_the_shipped_base_config_with_vllm_on_passes_the_truncation_check(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())
    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "configs/models/qwen2.5-0.5b.yaml", ["trainer.use_vllm=true", "trainer.bf16=false"])
    assert cfg.trainer["top_p"] < 1 and cfg.trainer["vllm_importance_sampling_mode"].startswith("token")


def test_the_doctor_names_the_truncation_bias_of_a_sequence_mode_run(tmp_path: Path):
    import json

    import yaml

    from steadyrl.evidence.doctor import diagnose, doctor_config_for
    from steadyrl.evidence.history import History

    rows = [{"step": s, "mismatch/ess": 0.3, "loss": 0.1} for s in range(1, 13)]
    trainer = {"use_vllm": True, "top_p": 0.9, "vllm_importance_sampling_mode": "sequence_mask"}
    (tmp_path / "resolved_config.yaml").write_text(yaml.safe_dump({"trainer": trainer}))
    (tmp_path / "environment.json").write_text(json.dumps({"packages": {"trl": "1.16.0"}}))
    config = doctor_config_for(tmp_path)
    assert config.truncation == "sequence_mask with top_p=0.9 on TRL 1.16.0"
    found = [f for f in diagnose(History(rows=rows), config) if f.mode == "off_policy_rollouts"]
    assert len(found) == 1 and "kept probability mass" in found[0].summary and "not a sync fault" in found[0].summary
    assert any("token_truncate" in c for c in found[0].changes)
    # top_p alone in a token mode is bounded (stated at load): no finding; nor on a TRL that ratios on the kept support
    for trainer_over, trl in (({"vllm_importance_sampling_mode": "token_mask"}, "1.16.0"), ({}, "1.17.0")):
        (tmp_path / "resolved_config.yaml").write_text(yaml.safe_dump({"trainer": {**trainer, **trainer_over}}))
        (tmp_path / "environment.json").write_text(json.dumps({"packages": {"trl": trl}}))
        assert doctor_config_for(tmp_path).truncation is None
