"""QUATRO rollout replay in real tiny GRPO runs: exact replayed share, off-policy importance ratios, interplay with
gradient accumulation, ``steps_per_generation`` and ``num_iterations``. (Exact resume with replay on, buffer
included: ``test_quatro.py::test_resume_is_exact_with_quatro_kl_entropy_filters_and_replay_on``.)"""

from __future__ import annotations

import pytest
import torch

from steadyrl.guards.quatro import QuatroConfig
from steadyrl.guards.replay import ReplayConfig
from steadyrl.trainers import SteadyGRPOTrainer
from steadyrl.trainers.rollout import REPLAY_STEP_KEY
from tests.integration.helpers import per_step, tiny_grpo_trainer

pytestmark = pytest.mark.slow


def _trainer(model_dir, out, replay: ReplayConfig, **args) -> SteadyGRPOTrainer:
    return tiny_grpo_trainer(model_dir, out, {"quatro": QuatroConfig(replay=replay)}, **args)


class LossRecorder:
    """Keeps (global_step, inputs, policy log-probs of the loss) of every training micro-batch, and lets a check run
    at that moment (same weights as the loss) through ``at_loss``."""

    def __init__(self, trainer, at_loss=None):
        self.rows: list[tuple[int, dict, torch.Tensor | None]] = []
        original = trainer.loss_station.record_replay

        def record(inputs, logps):
            self.rows.append((trainer.state.global_step, inputs, logps))
            if at_loss is not None:
                at_loss(inputs, logps)
            return original(inputs, logps)

        trainer.loss_station.record_replay = record


class GenerationRecorder:
    """Keeps every scored generation batch (after steadyrl's hook: with ``old_per_token_logps``) by global step."""

    def __init__(self, trainer):
        self.outputs: dict[int, dict[str, torch.Tensor]] = {}
        original = trainer._generate_and_score_completions

        def wrapped(inputs):
            out = original(inputs)
            self.outputs[trainer.state.global_step] = {
                k: v.detach().clone() for k, v in out.items() if torch.is_tensor(v)
            }
            return out

        trainer._generate_and_score_completions = wrapped


@pytest.mark.parametrize(
    "label, args",
    [
        # one generation = 2 micro-batches = 1 optimizer step; 4 generations
        ("accumulation", dict(gradient_accumulation_steps=2, max_steps=4)),
        # one generation = 2 micro-batches x 2 passes = 4 optimizer steps (TRL computes the old log-probs itself)
        ("iterations", dict(steps_per_generation=2, num_iterations=2, max_steps=8)),
    ],
)
def test_replayed_share_per_micro_batch_is_exact(tiny_model_dir, tmp_path, label, args):
    """replay_ratio 0.3125 x B 8 = 2.5 -> 3 replayed rows (half up) in every micro-batch once the buffer is warm (from
    the second generation on; the first has nothing to replay). Replayed rows come from earlier generations only;
    num_items_in_batch is recounted over the mixed rows; with num_iterations 2 both passes see the same mixed rows."""
    trainer = _trainer(tiny_model_dir, tmp_path / label, ReplayConfig(replay_ratio=0.3125), **args)
    losses = LossRecorder(trainer)
    trainer.train()
    per_generation = 2 * trainer.num_iterations  # loss micro-batches per generation
    generations = len(losses.rows) // per_generation
    assert len(losses.rows) == trainer.args.max_steps * trainer.args.gradient_accumulation_steps
    assert generations >= 2 and len(losses.rows) == generations * per_generation
    for g in range(generations):
        block = losses.rows[g * per_generation : (g + 1) * per_generation]
        generated_at = block[0][0]
        for _, inputs, _ in block:
            sampled = inputs[REPLAY_STEP_KEY]
            replayed = sampled >= 0
            assert inputs["completion_ids"].shape[0] == 8
            assert int(replayed.sum()) == (0 if g == 0 else 3), (label, g, sampled)
            assert torch.all(sampled[replayed] < generated_at), "a micro-batch replayed its own generation"
        one_pass = [inputs for _, inputs, _ in block[:2]]
        assert int(one_pass[0]["num_items_in_batch"]) == sum(int(b["completion_mask"].sum()) for b in one_pass)
        if trainer.num_iterations == 2:  # the second pass trains on the very same mixed micro-batches
            assert block[2][1] is block[0][1] and block[3][1] is block[1][1]
    warm_from = trainer.args.max_steps // generations  # optimizer steps of the first generation
    history = trainer.state.log_history
    assert per_step(history, "quatro/replay_frac") == [0.0] * warm_from + [3 / 8] * (trainer.args.max_steps - warm_from)
    # age: optimizer steps between sampling and the loss, averaged per micro-batch, then over the step's micro-batches
    expected_ages = []
    for step in range(warm_from, trainer.args.max_steps):
        per_micro = [
            sum(step - int(v) for v in inputs[REPLAY_STEP_KEY] if v >= 0) / 3
            for s, inputs, _ in losses.rows
            if s == step
        ]
        expected_ages.append(sum(per_micro) / len(per_micro))
    assert per_step(history, "quatro/replay_age_mean") == pytest.approx(expected_ages, rel=1e-12)
    assert min(expected_ages) >= 1


def test_replayed_row_importance_ratio_is_exp_current_minus_stored(tiny_model_dir, tmp_path):
    """Each replayed row keeps its sampling policy's log-probs, reference log-probs and advantage (compared with the
    generation batch it came from); the loss's ratio for it equals exp(current - stored), with current computed here
    by a plain forward of the model at the moment of the loss, in float64 from its logits (to 1e-6 relative, i.e. the
    log-ratio to 1e-6: TRL's float32 log-probs are exact to about one ulp, 4.8e-7 at |log p| ~ 5.5), and is not 1
    (the policy moved)."""
    trainer = _trainer(tiny_model_dir, tmp_path / "ratio", ReplayConfig(replay_ratio=0.5), max_steps=4, beta=0.04)
    assert trainer.args.gradient_accumulation_steps == 1 and trainer.num_iterations == 1
    generations = GenerationRecorder(trainer)
    checked: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ratio the loss used, ratio from the plain forward)

    def independent(inputs, logps):
        rows = inputs[REPLAY_STEP_KEY] >= 0
        if not rows.any():
            return
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        width = inputs["completion_ids"].shape[1]
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1].double()
        current = torch.log_softmax(logits / trainer.temperature, dim=-1)
        current = current.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        tokens = inputs["completion_mask"].bool() & rows.unsqueeze(1)
        stored = inputs["old_per_token_logps"].double()
        checked.append((torch.exp(logps.double() - stored)[tokens], torch.exp(current - stored)[tokens]))

    losses = LossRecorder(trainer, at_loss=independent)
    trainer.train()
    assert len(checked) == 3  # steps 2..4 replay (step 1 has an empty buffer)
    for used, plain in checked:
        assert torch.allclose(used, plain, rtol=1e-6, atol=0), (used / plain - 1).abs().max()
        assert (used - 1).abs().max() > 1e-3, "replayed rows must be off-policy here (the policy moved)"
    logged = per_step(trainer.state.log_history, "quatro/replay_ratio_mean")
    assert logged == pytest.approx([float(used.mean()) for used, _ in checked], rel=1e-9)

    # each replayed row is a row of an earlier generation batch, with that batch's stored tensors
    matched = 0
    for _, inputs, _ in losses.rows:
        for i in torch.nonzero(inputs[REPLAY_STEP_KEY] >= 0).flatten().tolist():
            source = generations.outputs[int(inputs[REPLAY_STEP_KEY][i])]
            n = int(inputs["completion_mask"][i].sum())
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()]
            candidates = [
                j
                for j in range(source["completion_ids"].shape[0])
                if torch.equal(source["prompt_ids"][j][source["prompt_mask"][j].bool()], prompt)
                and int(source["completion_mask"][j].sum()) == n
                and torch.equal(source["completion_ids"][j][:n], inputs["completion_ids"][i][:n])
            ]
            assert any(
                all(
                    torch.equal(source[key][j][:n], inputs[key][i][:n])
                    for key in ("old_per_token_logps", "ref_per_token_logps")
                )
                and float(source["advantages"][j]) == float(inputs["advantages"][i])
                for j in candidates
            ), (i, candidates)
            matched += 1
    assert matched == 3 * 4  # 3 steps x round_half_up(0.5 x 8)
