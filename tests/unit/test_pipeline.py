"""The rewards -> advantages pipeline: tensor in, tensor out, hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from steadyrl.guards.advantages import group_normalized_advantages
from steadyrl.guards.robust_advantage import GEPOAdvantage
from steadyrl.metrics import (
    GEPO_ADV_MAX_ABS,
    GEPO_ADV_STD,
    GEPO_NONFINITE_REWARDS,
    GEPO_ROBUST_GROUPS,
    GEPO_WOULD_ROBUST_GROUPS,
)
from steadyrl.trainers.advantage_pipeline import (
    AdvantagePipeline,
    RewardBatch,
    SequenceRewardPipeline,
    weighted_rewards,
)

NAN, INF = float("nan"), float("inf")


def _batch(rewards: list[list[float]], g: int, keep: list[bool] | None = None, weights=(1.0,)) -> RewardBatch:
    keep_t = None if keep is None else torch.tensor(keep)
    n = len(rewards)
    return RewardBatch(torch.tensor(rewards), [f"p{i // g}" for i in range(n)], g, torch.tensor(weights), keep_t)


def test_weighted_rewards_nan_only_where_every_function_is_unscorable_and_inf_counts_as_nan() -> None:
    got = weighted_rewards(torch.tensor([[1.0, NAN], [NAN, NAN], [INF, 2.0], [2.0, 4.0]]), torch.tensor([1.0, 0.5]))
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2] == 1.0 and got[3] == 4.0


def test_default_is_trls_group_normalisation() -> None:
    pipeline = AdvantagePipeline()
    scaled = pipeline.scale(_batch([[0.0], [1.0], [2.0], [4.0]], g=2))
    assert scaled.kl_factor is None and scaled.metrics == {GEPO_NONFINITE_REWARDS: 0.0}
    advantages, metrics = pipeline.advantages(scaled.rewards, None, 2)
    # group [0, 1]: mean 0.5, unbiased std sqrt(0.5); group [2, 4]: mean 3, std sqrt(2)
    s1, s2 = math.sqrt(0.5) + 1e-4, math.sqrt(2.0) + 1e-4
    want = torch.tensor([-0.5 / s1, 0.5 / s1, -1.0 / s2, 1.0 / s2])
    torch.testing.assert_close(advantages, want)
    assert metrics[GEPO_ADV_MAX_ABS] == pytest.approx(1.0 / s2)
    assert metrics[GEPO_ADV_STD] == pytest.approx(float(want.std()))


def test_filtered_rows_leave_their_group_and_get_zero() -> None:
    pipeline = AdvantagePipeline(scale_rewards="none")
    batch = _batch([[0.0], [1.0], [9.0], [3.0]], g=4, keep=[True, True, False, True])
    scaled = pipeline.scale(batch)
    assert math.isnan(scaled.rewards[2])  # dropped: unscorable for the reward processor
    advantages, _ = pipeline.advantages(scaled.rewards, batch.keep, 4)
    assert advantages.tolist() == pytest.approx([-4 / 3, -1 / 3, 0.0, 5 / 3])  # centred on mean(0, 1, 3)


class _Doubler:
    """A reward processor: x2, reports one metric and a KL factor."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def __call__(self, rewards: torch.Tensor, prompts: list, num_generations: int) -> torch.Tensor:
        self.seen.append(list(prompts))
        return rewards * 2

    def metrics(self) -> dict[str, float]:
        return {"grade/scaled_std": 1.5}

    def kl_compensation(self, lo: float, hi: float) -> float:
        return min(max(3.0, lo), hi)


def test_reward_processor_metrics_and_kl_factor_come_out_in_order() -> None:
    processor = _Doubler()
    pipeline = AdvantagePipeline(processor, GEPOAdvantage(3.0), kl_compensation=(0.5, 2.0))
    scaled = pipeline.scale(_batch([[1.0, NAN], [INF, 2.0]], g=2, weights=(1.0, 1.0)))
    assert processor.seen == [["p0", "p0"]]
    assert scaled.rewards.tolist() == [2.0, 4.0]
    assert list(scaled.metrics) == [GEPO_NONFINITE_REWARDS, "grade/scaled_std"]
    assert scaled.metrics[GEPO_NONFINITE_REWARDS] == 2.0  # one NaN, one inf
    assert scaled.kl_factor == 2.0  # clamped to hi
    advantages, _ = pipeline.advantages(scaled.rewards, None, 2)
    assert advantages[0] < 0 < advantages[1] and advantages.abs().max() < 3.0  # tanh soft clip bound


def test_gepo_takes_trls_scale_rewards_and_logs_its_robust_groups() -> None:
    gepo = GEPOAdvantage(3.0)
    pipeline = AdvantagePipeline(advantage_fn=gepo, scale_rewards="none")
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.0, 2.0, 3.0, 300.0])  # group 2: 297 / (1.4826 * 1) spreads out
    advantages, metrics = pipeline.advantages(rewards, None, 4)
    assert pipeline.advantage_fn.scale_rewards == "none" and gepo.scale_rewards == "group"  # a copy is bound
    assert advantages[:4].tolist() == [-0.625, 0.375, 0.375, -0.125]  # TRL's, centred only
    assert metrics[GEPO_ROBUST_GROUPS] == 1.0 and GEPO_WOULD_ROBUST_GROUPS not in metrics
    observing = AdvantagePipeline(advantage_fn=gepo, observe_advantages=True)
    trained, metrics = observing.advantages(rewards, None, 4)
    assert metrics[GEPO_WOULD_ROBUST_GROUPS] == 1.0 and GEPO_ROBUST_GROUPS not in metrics
    torch.testing.assert_close(trained, group_normalized_advantages(rewards.view(2, 4)).reshape(-1))


def test_kl_compensation_needs_a_reward_processor() -> None:
    with pytest.raises(ValueError, match="needs a reward processor"):
        AdvantagePipeline(kl_compensation=(0.5, 2.0))


def test_ppo_pipeline_marks_unscorable_and_dropped_rows_nan() -> None:
    """NaN: the row trains nothing (SteadyPPOTrainer gives it advantage 0 and no value-loss weight)."""
    pipeline = SequenceRewardPipeline()
    batch = _batch([[0.5], [NAN], [2.0]], g=1, keep=[True, True, False])
    scaled = pipeline.scale(batch)
    rewards, metrics = pipeline.advantages(scaled.rewards, batch.keep, 1)
    assert rewards[0].item() == 0.5 and rewards[1:].isnan().all() and metrics == {}
