"""Reliability at the edges (issue 15) through the real CLI on the tiny model: a flaky reward service, a damaged
checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from steadyrl.evidence.history import load_history
from steadyrl.metrics import reward_errors, reward_skipped
from tests.integration.test_cli import steadyrl

pytestmark = pytest.mark.slow


def _args(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "configs/tiny/grpo.yaml",
        f"model.path={model}",
        f"trainer.output_dir={out}",
        "trainer.per_device_train_batch_size=8",
        "trainer.num_generations=4",
        "trainer.max_completion_length=4",
        "trainer.logging_steps=1",
        "eval.enabled=false",
        *extra,
    ]


def test_flaky_reward_is_skipped_and_counted_then_stops_the_run(tiny_model_dir, tmp_path):
    flaky = "{name: flaky, fn: 'tests.integration.helpers:flaky_reward', on_error: skip, retries: 0"
    # call 2 fails: step 2 is scored unscorable and counted; the run finishes
    out = tmp_path / "skip"
    proc = steadyrl(
        *_args(tiny_model_dir, out, "trainer.max_steps=3", f"rewards=[{flaky}, kwargs: {{fail_calls: [2]}}}}]")
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in load_history(out).rows if "loss" in r]
    assert [r[reward_errors("flaky")] for r in rows] == [0.0, 1.0, 0.0]
    assert [r[reward_skipped("flaky")] for r in rows] == [0.0, 1.0, 0.0]

    # every call from the 3rd on fails: two skipped calls in a row stop the run, naming the last checkpoint
    out = tmp_path / "stop"
    rewards = f"rewards=[{flaky}, max_consecutive_errors: 2, kwargs: {{fail_from: 3}}}}]"
    proc = steadyrl(*_args(tiny_model_dir, out, "trainer.max_steps=6", "trainer.save_steps=1", rewards))
    assert proc.returncode == 1
    assert (
        "steadyrl: stopped: reward 'flaky' failed 2 calls in a row (on_error: skip, max_consecutive_errors: 2); "
        f"last error: ConnectionError: reward server dropped call 4. Last complete checkpoint: {out / 'checkpoint-3'} "
        "(trainer.resume_from_checkpoint: auto resumes from it)."
    ) in proc.stderr


def test_an_async_judge_is_awaited_its_hung_call_cancelled_and_skipped_and_it_scores_the_eval(tiny_model_dir, tmp_path):
    # an ``async def`` reward (before: "returned coroutine", the run stopped after the model loaded); call 2 never
    # answers: cancelled after its 1 s timeout, step 2 scored unscorable; the final eval awaits it as well
    judge = "{name: judge, fn: 'tests.integration.helpers:async_judge', on_error: skip, retries: 0, timeout: 1"
    out = tmp_path / "judge"
    extra = ("trainer.max_steps=3", f"rewards=[{judge}, kwargs: {{hang_calls: [2]}}}}]", "eval.enabled=true")
    proc = steadyrl(*_args(tiny_model_dir, out, *extra, "eval.max_samples=8"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in load_history(out).rows if "loss" in r]
    assert [r[reward_skipped("judge")] for r in rows] == [0.0, 1.0, 0.0]
    assert "RewardTimeout: no answer within 1 s (reward 'judge' on rank 0; the call was cancelled)" in proc.stderr
    results = json.loads((out / "eval_results.json").read_text())
    assert results["metric"] == "judge" and isinstance(results["accuracy"], float) and results["accuracy"] > 0


def test_truncated_newest_checkpoint_is_refused_by_path_and_skipped_by_auto(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    first = steadyrl(*_args(tiny_model_dir, out, "trainer.max_steps=4", "trainer.save_steps=2"))
    assert first.returncode == 0, first.stderr[-3000:]
    weights = out / "checkpoint-4" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size // 2)  # a copy cut short; the completion marker is intact
    damage = f"{weights} has {size // 2} bytes, the completion marker recorded {size} (truncated or overwritten)"

    explicit = steadyrl(
        *_args(tiny_model_dir, out, "trainer.max_steps=6", f"trainer.resume_from_checkpoint={out / 'checkpoint-4'}")
    )
    assert explicit.returncode == 1
    assert (
        f"steadyrl: config error: trainer.resume_from_checkpoint: {out / 'checkpoint-4'} is damaged: {damage}."
        in explicit.stderr
    )

    auto = steadyrl(*_args(tiny_model_dir, out, "trainer.max_steps=6", "trainer.save_steps=2"))
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert f"checkpoint {out / 'checkpoint-4'} is damaged, falling back to an older one: {damage}" in auto.stderr
    assert f"resume_from_checkpoint=auto: {out / 'checkpoint-2'}" in auto.stderr
    from steadyrl.trainers.checkpoints import verify_checkpoint

    assert [verify_checkpoint(out / f"checkpoint-{s}") for s in (2, 4, 6)] == [None, None, None]  # 4 saved afresh


def test_empty_first_prompt_is_refused_then_skipped(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "", "answer": "0"}] + [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"data.path={data}", "data.eval_split=null", "data.builtin={}", "trainer.max_steps=2"]  # a file, no task

    refused = steadyrl(*_args(tiny_model_dir, tmp_path / "a", *args))
    assert refused.returncode == 1
    assert (
        f"steadyrl: config error: {data}: row 0, column 'prompt': empty prompt (''). Fix the data, or set "
        "data.on_bad_row: skip to drop such rows at load"
    ) in refused.stderr

    skipped = steadyrl(*_args(tiny_model_dir, tmp_path / "b", *args, "data.on_bad_row=skip"))
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert f"dropped 1 of 17 rows of {data} (empty prompt: 1); first: row 0, empty prompt ('')" in skipped.stderr
    assert json.loads((tmp_path / "b" / "checkpoint-2" / "trainer_state.json").read_text())["global_step"] == 2
