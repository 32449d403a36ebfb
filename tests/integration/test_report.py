"""steadyrl report: PNGs and report.md from a real tiny GRPO run, from a run that died, and from synthetic logs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from steadyrl.callbacks.metrics_log import MetricsLog
from steadyrl.cli import main
from steadyrl.evidence import load_history
from steadyrl.evidence.report import PANELS, write_report
from steadyrl.guards.spike import SpikeGuard
from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.layers import GuardParts
from tests.integration.helpers import byte_mean, grpo_args, small_dataset

ALL_PANELS = {p.name for p in PANELS}
GRPO_PANELS = {"reward", "entropy", "grad_norm", "length"}  # TRL's own metrics; beta=0 logs no KL


def train(model_dir, out, reward_funcs, max_steps):
    trainer = SteadyGRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward_funcs,
        args=grpo_args(out, max_steps=max_steps),
        train_dataset=small_dataset(),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        guards=GuardParts(step_guards=[SpikeGuard()]),
    )
    trainer.add_callback(MetricsLog(out))
    trainer.train()


def images(report_md: str) -> set[str]:
    return set(re.findall(r"!\[[^\]]*\]\(([^)]+)\.png\)", report_md))


def assert_pngs(folder, names):
    for name in names:
        data = (folder / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, name


@pytest.mark.slow
def test_report_of_a_real_run_and_of_one_that_died(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    train(tiny_model_dir, out, [byte_mean], max_steps=4)
    history = load_history(out)
    assert history.source == out / "metrics.jsonl" and history.finished
    assert history.series("reward")[0].tolist() == [1, 2, 3, 4]
    assert {"loss", "grad_norm", "entropy", "completions/mean_length", "gepo/skipped_steps"} <= history.metrics

    report = write_report(out)
    assert report == out / "report" / "report.md"
    text = report.read_text()
    assert images(text) == GRPO_PANELS
    assert_pngs(out / "report", GRPO_PANELS)
    assert not any((out / "report" / f"{name}.png").exists() for name in ALL_PANELS - GRPO_PANELS)
    assert "_Skipped: none of `kl` or `quatro/kl_mean` or `quatro/kl_coef` was logged._" in text
    assert "| status | finished at step 4 |" in text and "| skipped optimizer steps (GEPO) | 0 |" in text

    calls = []

    def dies_at_third_call(completions, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("reward server went away")
        return byte_mean(completions)

    dead = tmp_path / "dead"
    with pytest.raises(RuntimeError, match="reward server went away"):
        train(tiny_model_dir, dead, [dies_at_third_call], max_steps=4)
    history = load_history(dead)
    assert not history.finished and history.series("loss")[0].tolist() == [1, 2]

    assert main(["report", str(dead)]) == 0
    text = (dead / "report" / "report.md").read_text()
    assert "| status | no final row: still running or died at step 2 |" in text
    assert images(text) == GRPO_PANELS
    assert_pngs(dead / "report", GRPO_PANELS)


def synthetic_rows(n: int = 60) -> list[dict]:
    """Every metric the report plots, with a NaN/inf stretch, GEPO skips, OPEFO rollbacks and QUATRO filters."""
    rng = np.random.default_rng(0)
    rows = []
    for t in range(1, n + 1):
        bad = 30 <= t <= 32
        row = {
            "step": t,
            "loss": float("nan") if bad else float(rng.normal(0, 0.1)),
            "grad_norm": float("inf") if t == 31 else (0.0 if t == 5 else float(np.exp(rng.normal()))),
            "reward": float(0.1 + t / n + rng.normal(0, 0.05)),
            "reward_std": 0.2,
            "rewards/exact/mean": float(t / n),
            "rewards/exact/std": 0.1,
            "rewards/length/mean": 0.1,
            "rewards/length/std": 0.0,
            "entropy": float(1.0 - 0.5 * t / n),
            "kl": float("nan") if bad else float(0.01 * t / n),
            "quatro/kl_coef": 0.04,
            "quatro/kl_mean": float(0.01 * t / n),
            "quatro/kl_target": 0.02,
            "quatro/entropy": float(1.0 - 0.5 * t / n),
            "quatro/entropy_floor": 0.8,
            "quatro/entropy_bonus": float(0.01 * (t > 40)),
            "quatro/floor_active": float(t > 40),
            "quatro/filtered/zscore": float(rng.poisson(1)),
            "quatro/filtered/repetition": float(rng.poisson(2)),
            "quatro/replay_frac": 0.3,
            "grade/raw_std": 2.0,
            "grade/scaled_std": 1.0,
            "grade/clip_frac_low": 0.01,
            "grade/clip_frac_high": 0.02,
            "gepo/skipped_steps": int(t >= 31) + int(t >= 45),
            "opefo/rollbacks": int(t >= 33),
            "completions/mean_length": float(30 + t / 3),
            "completions/min_length": 5.0,
            "completions/max_length": 64.0,
            "completions/clipped_ratio": 0.1,
            "sampling/sampling_logp_difference/mean": float(0.003 + 0.002 * (t % 3)),
            "sampling/sampling_logp_difference/max": float(0.05 + 0.01 * (t % 5)),
        }
        rows.append(row)
        if t % 10 == 0:
            rows.append({"step": t, "eval/accuracy": float(t / n / 2), "eval/reward": 0.5, "eval/mean_length": 40.0})
    return rows


def test_report_draws_every_panel_and_survives_nonfinite_values(tmp_path):
    lines = [json.dumps({k: (str(v) if not np.isfinite(v) else v) for k, v in row.items()}) for row in synthetic_rows()]
    lines.append(json.dumps({"step": 33, "event": "rollback", "cause": "nonfinite loss"}))  # the counter's rollback
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "report").mkdir()

    text = write_report(tmp_path).read_text()
    assert images(text) == ALL_PANELS and "_Skipped" not in text
    assert_pngs(tmp_path / "report", ALL_PANELS)
    assert "| skipped optimizer steps (GEPO) | 2 (steps 31, 45) |" in text
    assert "| rollbacks (OPEFO) | 1 (steps 33) |" in text
    assert "| loss | " in text and re.search(r"\| loss \|[^\n]*\| 3 \|\n", text)  # three non-finite losses
    assert "## Diagnosis (`steadyrl doctor`)" in text and "[hard_crash]" in text
