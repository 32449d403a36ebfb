"""PeriodicEval in a real GRPO run: eval rows at the right steps, training rows and weights unchanged, 2 ranks."""

from __future__ import annotations

import datetime
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from steadyrl.callbacks.metrics_log import MetricsLog
from steadyrl.callbacks.periodic_eval import PeriodicEval, trainer_log_fn
from steadyrl.tasks import arithmetic_dataset
from steadyrl.tasks.arithmetic import exact_match
from steadyrl.trainers.grpo import SteadyGRPOTrainer
from tests.integration.helpers import assert_same_weights, byte_mean, grpo_args, small_dataset, weights
from tests.integration.spawn import spawn_or_fail

pytestmark = pytest.mark.slow

TIMING = ("runtime", "per_second", "time")  # wall-clock keys differ between any two runs


def rng_hungry(completions: list[Any], **_: Any) -> list[float]:
    """A reward that draws from torch's and Python's RNG, as a sampled or dropout-using reward model would."""
    torch.rand(1000)
    random.random()
    return [0.0] * len(completions)


def eval_rewards() -> dict[str, Any]:
    return {"exact_match": exact_match, "byte_mean": byte_mean, "rng_hungry": rng_hungry}


def _train(model_dir: Path, out: Path, every: int | None):
    tok = AutoTokenizer.from_pretrained(model_dir)
    # logging_steps=3: the eval after step 2 falls inside the logging interval 1-3, where GRPOTrainer.log would
    # have taken the buffered training metrics of steps 1-2 into the eval row.
    trainer = SteadyGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[byte_mean],
        args=grpo_args(out, max_steps=4, logging_steps=3),
        train_dataset=small_dataset(),
        processing_class=tok,
        callbacks=[MetricsLog(out)],
    )
    if every is not None:
        eval_ds = arithmetic_dataset("eval", max_operand=9, eval_size=10)
        trainer.add_callback(
            PeriodicEval(
                eval_ds, eval_rewards(), tok, every=every, metric="exact_match", max_new_tokens=4, batch_size=8,
                max_samples=None, log_fn=trainer_log_fn(trainer),
            )
        )  # fmt: skip
    trainer.train()
    return trainer


def _training_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in row.items() if not any(t in k for t in TIMING)}
        for row in history
        if not any(k.startswith("eval/") for k in row)
    ]


def test_eval_rows_every_2_steps_and_training_untouched(tiny_model_dir, tmp_path):
    plain = _train(tiny_model_dir, tmp_path / "plain", every=None)
    evald = _train(tiny_model_dir, tmp_path / "eval", every=2)

    history = evald.state.log_history
    eval_rows = [row for row in history if "eval/accuracy" in row]
    assert [row["step"] for row in eval_rows] == [2, 4]
    for row in eval_rows:
        assert 0.0 <= row["eval/accuracy"] <= 1.0 and row["eval/reward"] == row["eval/accuracy"]
        assert row["eval/reward/exact_match"] == row["eval/accuracy"]
        assert 0.0 < row["eval/reward/byte_mean"] <= 1.0 and row["eval/reward/rng_hungry"] == 0.0
        assert 0.0 < row["eval/mean_length"] <= 4 and row["eval/num_samples"] == 10
        assert "epoch" in row  # Trainer.log's row: step and epoch added
    # Each eval row comes after the training rows of its step: at the last step, after the run's summary row
    # (which, with max_steps not a multiple of logging_steps, carries step 4's training metrics).
    order = [(row["step"], "eval" if "eval/accuracy" in row else "train") for row in history]
    assert order == [(2, "eval"), (3, "train"), (4, "train"), (4, "eval")]

    # Training rows, rewards included, are exactly those of the run without eval; so are the final weights.
    train_rows = _training_rows(history)
    assert [row["step"] for row in train_rows if "reward" in row] == [3, 4]
    assert train_rows == _training_rows(plain.state.log_history)
    assert_same_weights(weights(evald.model), weights(plain.model))
    assert evald.model.training

    # on_log saw the rows: MetricsLog wrote them to metrics.jsonl.
    lines = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines if "eval/accuracy" in row] == [2, 4]


def _rank_worker(rank: int, tmp: str, model_dir: str) -> None:
    import torch.distributed as dist

    # a collective that waits past 120 s raises (with gloo's message) instead of running into the test's deadline
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120)
    )
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(AutoModelForCausalLM.from_pretrained(model_dir))
        tok = AutoTokenizer.from_pretrained(model_dir)
        rows: list[dict[str, float]] = []
        state = type("State", (), {"global_step": 2, "is_world_process_zero": rank == 0, "log_history": []})()
        eval_ds = arithmetic_dataset("eval", max_operand=9, eval_size=7)  # shards of 4 and 3 rows
        PeriodicEval(eval_ds, eval_rewards(), tok, every=2, max_new_tokens=4, batch_size=4, log_fn=rows.append).run(
            model, state
        )
        one_row = eval_ds.select([0])  # rank 1's shard is empty
        PeriodicEval(one_row, eval_rewards(), tok, every=2, max_new_tokens=4, batch_size=4, log_fn=rows.append).run(
            model, state
        )
        torch.save(rows, f"{tmp}/rank{rank}.pt")
        dist.barrier()  # a rank that tears gloo down while its peer still finishes the last collective hangs it
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_agree_with_one_process(tiny_model_dir, tmp_path):
    def attempt_dir(attempt: int) -> Path:
        (tmp_path / f"try{attempt}").mkdir()
        return tmp_path / f"try{attempt}"

    # a few seconds normally; a hang runs once more in fresh paths (gloo's rare teardown race) before it fails
    done = spawn_or_fail(
        _rank_worker, lambda attempt: (str(attempt_dir(attempt)), str(tiny_model_dir)), timeout=150.0, retries=1
    )
    rank0, rank1 = (torch.load(tmp_path / f"try{done}" / f"rank{r}.pt") for r in range(2))
    assert repr(rank0) == repr(rank1)  # every rank logs the same numbers (as text: a one-row eval's se is NaN)

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    eval_ds = arithmetic_dataset("eval", max_operand=9, eval_size=7)
    for row, ds in zip(rank0, (eval_ds, eval_ds.select([0])), strict=True):
        single, _ = PeriodicEval(ds, eval_rewards(), tok, every=2, max_new_tokens=4, batch_size=4).evaluate(model)
        assert row["eval/num_samples"] == len(ds)
        assert row == pytest.approx(single, rel=1e-12, nan_ok=True)
