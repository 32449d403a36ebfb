"""Fault injectors are reproducible and heavy-tailed."""

from __future__ import annotations

from types import SimpleNamespace

from steadyrl.faults import exact_match_cauchy


def test_cauchy_reward_is_reproducible_per_seed_and_step():
    comps, answers = ["5", "6"] * 500, ["5"] * 1000
    step3 = SimpleNamespace(global_step=3)
    a = exact_match_cauchy(comps, answers, scale=1.0, seed=7, trainer_state=step3)
    assert a == exact_match_cauchy(comps, answers, scale=1.0, seed=7, trainer_state=step3)
    assert a != exact_match_cauchy(comps, answers, scale=1.0, seed=7, trainer_state=SimpleNamespace(global_step=4))
    assert a != exact_match_cauchy(comps, answers, scale=1.0, seed=8, trainer_state=step3)
    noise = sorted(abs(r - (c == "5")) for r, c in zip(a, comps, strict=True))
    assert noise[len(noise) // 2] < 2.0 < noise[-1] and noise[-1] > 50  # median |noise| ~1, but extreme tails


def test_zero_scale_is_exact_match():
    assert exact_match_cauchy(["5", "6"], ["5", "5"], scale=0.0) == [1.0, 0.0]
