"""Exact resume: N straight steps == k steps, checkpoint, resume, N-k steps (CPU fp32, torch.equal)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.checkpoints import COMPLETE_MARKER, find_resume_checkpoint
from steadyrl.trainers.layers import GuardParts
from tests.integration.helpers import (
    assert_same_weights,
    byte_mean,
    grpo_args,
    small_dataset,
    tiny_grpo_trainer,
    weights,
)

pytestmark = pytest.mark.slow

LOGGED = ("reward", "loss", "grad_norm", "learning_rate")


def _trainer(model_dir: Path, out: Path, **args) -> SteadyGRPOTrainer:
    return tiny_grpo_trainer(model_dir, out, **args)


def _logs_from(history: list[dict], first_step: int) -> dict[str, list[float]]:
    rows = [r for r in history if r.get("step", 0) > first_step and "loss" in r]
    return {k: [r[k] for r in rows if k in r] for k in LOGGED}


@pytest.mark.parametrize(
    ("label", "args", "resume_step"),
    [
        ("one rollout per step", dict(max_steps=4, save_steps=2), 2),
        # steps_per_generation=2: one rollout serves two optimizer steps; resuming at step 3 lands mid-window
        ("resume inside a generation window", dict(max_steps=4, save_steps=3, steps_per_generation=2), 3),
    ],
)
def test_resume_is_exact(tiny_model_dir, tmp_path, label, args, resume_step):
    common = dict(save_strategy="steps", beta=0.04, **args)
    straight = _trainer(tiny_model_dir, tmp_path / "straight", **common)
    straight.train()
    checkpoint = tmp_path / "straight" / f"checkpoint-{resume_step}"
    assert (checkpoint / COMPLETE_MARKER).is_file()

    resumed = _trainer(tiny_model_dir, tmp_path / "resumed", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert resumed.state.global_step == straight.state.global_step == 4
    assert_same_weights(weights(resumed.model), weights(straight.model))
    expected = _logs_from(straight.state.log_history, resume_step)
    assert expected["loss"], "the straight run logged steps after the checkpoint"
    assert _logs_from(resumed.state.log_history, resume_step) == expected
    # the optimizer state was restored, not restarted: Adam's step count continues from the checkpoint
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=False)["state"]
    assert all(int(s["step"]) == resume_step for s in saved.values())
    final = resumed.optimizer.state_dict()["state"]
    assert all(int(s["step"]) == 4 for s in final.values())


def test_resume_with_another_batch_layout_drops_the_saved_rollouts(tiny_model_dir, tmp_path, caplog):
    """Saved mid-window with 2 micro-batches per generation, resumed with 4: TRL would serve micro-batch
    ``_step % 4 = 3`` of a 2-long buffer (IndexError); the buffer is dropped and generated afresh instead."""
    common = dict(save_strategy="steps", save_steps=3, max_steps=5)
    _trainer(tiny_model_dir, tmp_path / "first", steps_per_generation=2, **common).train()
    checkpoint = tmp_path / "first" / "checkpoint-3"
    resumed = _trainer(tiny_model_dir, tmp_path / "resumed", steps_per_generation=4, **common)
    with caplog.at_level("WARNING", logger="steadyrl.trainers.trl_state"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 5
    assert all(torch.isfinite(v).all() for v in weights(resumed.model).values())
    assert "rollouts not yet trained on are 2 micro-batch(es) of 8 rows and this run has steps_per_generation=4" in (
        caplog.text
    )
    assert len(resumed._buffered_inputs) == 4  # generated with this run's layout


def _fake_checkpoints(root):
    """checkpoint-2 and -4 complete, checkpoint-6 incomplete (no completion marker)."""
    for step, complete in ((2, True), (4, True), (6, False)):
        folder = root / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text("{}")
        if complete:
            (folder / COMPLETE_MARKER).write_text("{}")


def test_auto_resume_skips_incomplete_checkpoints(tmp_path):
    _fake_checkpoints(tmp_path)
    (tmp_path / "checkpoint-x").mkdir()
    assert find_resume_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert find_resume_checkpoint(tmp_path / "missing") is None


class CountingRewards:
    """A stateful reward processor: counts the rewards it has seen (its state must survive resume)."""

    def __init__(self):
        self.seen = 0

    def __call__(self, rewards, prompts, num_generations):
        self.seen += rewards.numel()
        return rewards

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def test_guard_state_is_saved_and_restored(tiny_model_dir, tmp_path):
    def make(out, processor):
        return SteadyGRPOTrainer(
            model=str(tiny_model_dir),
            reward_funcs=[byte_mean],
            args=grpo_args(out, max_steps=4, save_steps=2, save_strategy="steps"),
            train_dataset=small_dataset(),
            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
            guards=GuardParts(reward_processor=processor),
        )

    straight = CountingRewards()
    make(tmp_path / "a", straight).train()
    assert straight.seen == 4 * 8  # 4 generation batches of 8 completions
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "steadyrl_state.pt", weights_only=False)
    assert saved["guards"]["reward_processor"] == {"seen": 16}

    resumed = CountingRewards()
    trainer = make(tmp_path / "b", resumed)
    trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert resumed.seen == straight.seen  # 16 restored + 16 seen after the resume
    final = _final_weights(tmp_path / "a")  # tied lm_head is not stored separately
    current = weights(trainer.model)
    assert_same_weights({k: current[k] for k in final}, final)


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "checkpoint-4" / "model.safetensors"))


def test_rotation_counts_complete_checkpoints_only(tmp_path):
    """save_total_limit=1 with a newer but incomplete folder: the newest *complete* checkpoint survives."""
    from steadyrl.trainers.checkpoints import rotate_complete_checkpoints

    _fake_checkpoints(tmp_path)
    rotate_complete_checkpoints(tmp_path, save_total_limit=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert find_resume_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_resume_is_exact_with_every_stateful_guard(tiny_model_dir, tmp_path):
    """GEPO's spike guard and advantages, GRADE with KL compensation; one rollout per 2 steps, resumed at step 3,
    inside the window of the rollout generated at step 3. That rollout's KL factor of beta (0.5: GRADE whitened it)
    is used again at step 4, so it must come back from the checkpoint; the spike guard's EMA and counters too."""
    from steadyrl.guards.reward_scaler import GradeConfig, GradeScaler
    from steadyrl.guards.robust_advantage import GEPOAdvantage
    from steadyrl.guards.spike import SpikeConfig, SpikeGuard

    def guards():
        return {
            "advantage_fn": GEPOAdvantage(),
            "step_guards": [SpikeGuard(SpikeConfig(warmup_steps=1))],
            "reward_processor": GradeScaler(GradeConfig(warmup=2, clip_start=2, quantile_every=1)),
            "kl_compensation": (0.5, 2.0),
        }

    common = dict(max_steps=4, save_steps=3, save_strategy="steps", steps_per_generation=2, beta=0.04)
    straight = tiny_grpo_trainer(tiny_model_dir, tmp_path / "straight", guards(), **common)
    straight.train()
    assert straight.beta_factors["grade"] != 1.0, "GRADE must compensate beta in this test"
    resumed = tiny_grpo_trainer(tiny_model_dir, tmp_path / "resumed", guards(), **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-3"))

    assert resumed.beta_factors == straight.beta_factors and resumed.beta == straight.beta
    assert resumed.parts.step_guards[0].state_dict() == straight.parts.step_guards[0].state_dict()
    assert resumed.parts.reward_processor.state_dict() == straight.parts.reward_processor.state_dict()
    assert straight.parts.step_guards[0].accepted == 4 and straight.parts.step_guards[0].baseline is not None
    assert_same_weights(weights(resumed.model), weights(straight.model))
    assert _logs_from(resumed.state.log_history, 3) == _logs_from(straight.state.log_history, 3)
