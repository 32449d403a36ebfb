"""Preemption: SIGTERM mid-run writes a complete checkpoint, exits with the preemption code and a resume line; the
``auto`` resume ends with weights ``torch.equal`` to a straight run. One process, 2-process DDP and ZeRO-2 on CPU;
a second signal exits at once and leaves the last complete checkpoint as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from steadyrl.trainers.checkpoints import COMPLETE_MARKER, verify_checkpoint
from tests.integration.helpers import assert_same_weights
from tests.integration.test_launch import launch

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SIGNAL = "callbacks=[tests.integration.rank_dump:RankDump, tests.integration.rank_dump:SignalAtStep]"
PREEMPTED = 75  # preemption.exit_code's default


def _train(model_dir: Path, out: Path, *extra: str, signal: str | None = None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "steadyrl", "train", str(REPO / "configs/tiny/grpo.yaml"), f"model.path={model_dir}",
        f"trainer.output_dir={out}", "trainer.max_steps=4", "trainer.save_steps=2",
        "trainer.per_device_train_batch_size=8", "trainer.num_generations=4", "trainer.max_completion_length=4",
        "trainer.logging_steps=1", "rewards=[{fn: 'tests.integration.helpers:byte_mean'}]", "eval.enabled=false",
        "trainer.resume_from_checkpoint=auto", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if signal is not None:
        env["STEADYRL_TEST_SIGNAL"] = signal
        cmd.append("callbacks=[tests.integration.rank_dump:SignalAtStep]")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _weights(checkpoint: Path) -> dict:
    return load_file(checkpoint / "model.safetensors")


def _assert_preempted_at(out: Path, step: int, stderr: str) -> None:
    assert (out / f"checkpoint-{step}" / COMPLETE_MARKER).is_file(), stderr[-3000:]
    assert verify_checkpoint(out / f"checkpoint-{step}") is None
    assert not (out / f"checkpoint-{step + 1}").exists() and not (out / "final").exists()
    assert json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())["global_step"] == step


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(tiny_model_dir, tmp_path):
    straight = _train(tiny_model_dir, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]

    out = tmp_path / "preempted"
    stopped = _train(tiny_model_dir, out, "trainer.save_steps=10", signal="1:self")
    assert stopped.returncode == PREEMPTED, stopped.stderr[-3000:]
    _assert_preempted_at(out, 1, stopped.stderr)  # save_steps=10: the only checkpoint is the preemption's
    assert "received SIGTERM: finishing the current step" in stopped.stderr
    expected = f"steadyrl: preempted by SIGTERM after step 1: checkpoint written to {out / 'checkpoint-1'}"
    assert expected in stopped.stderr
    assert "Resume with the same launch and: steadyrl train" in stopped.stderr
    assert stopped.stderr.rstrip().endswith("trainer.resume_from_checkpoint=auto")

    resumed = _train(tiny_model_dir, out, "trainer.save_steps=10")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume_from_checkpoint=auto: {out / 'checkpoint-1'}" in resumed.stderr
    assert_same_weights(_weights(tmp_path / "straight" / "checkpoint-4"), _weights(out / "checkpoint-4"))
    assert_same_weights(_weights(out / "checkpoint-4"), load_file(out / "final" / "model.safetensors"))


def test_second_signal_exits_at_once_and_leaves_the_last_checkpoint(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # SIGTERM at the end of step 3, another 1 s later (past the 0.2 s relay window): exit at once, before the
    # checkpoint of step 3 is written; checkpoint-2 stays complete and verifies
    killed = _train(tiny_model_dir, out, "trainer.save_steps=1", "preemption.relay_window_s=0.2", signal="3:self:1")
    assert killed.returncode == 128 + 15, killed.stderr[-3000:]
    assert "second signal (SIGTERM): exiting at once" in killed.stderr
    assert verify_checkpoint(out / "checkpoint-2") is None and (out / "checkpoint-2" / COMPLETE_MARKER).is_file()
    assert not (out / "checkpoint-3").exists()


def test_preemption_disabled_keeps_the_default_signal_handling(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    killed = _train(tiny_model_dir, out, "preemption.enabled=false", signal="1:self")
    assert killed.returncode == -15, killed.stderr[-3000:]
    assert not list(out.glob("checkpoint-*"))


def test_sigterm_under_two_processes_stops_every_rank_at_one_step(tiny_model_dir, tmp_path):
    """DeepSpeed ZeRO-2 on 2 processes, SIGTERM to the launcher and both workers at once (Slurm): each worker gets
    the signal directly and then torchrun's relayed copy, which the relay window must absorb (a launcher-only signal,
    as Kubernetes sends, is the relayed copy alone). Both ranks stop after the same step with one collective
    checkpoint, and the ``auto`` resume ends bit-identical to a straight run, rank by rank. (One launch config to
    keep CI short: the path is the same under DDP, whose resume the other launch tests cover.)"""
    pytest.importorskip("deepspeed")
    accelerate_config, target = "zero2.yaml", "all"
    args = ("trainer.max_steps=4", "trainer.save_steps=10")
    straight, _ = launch(accelerate_config, tiny_model_dir, tmp_path / "straight", *args)

    out = tmp_path / "preempted"
    _, stopped = launch(accelerate_config, tiny_model_dir, out, *args, SIGNAL,
                        env_extra={"STEADYRL_TEST_SIGNAL": f"2:{target}"}, check=False)  # fmt: skip
    assert stopped.returncode != 0, stopped.stderr[-3000:]  # torchrun's own status: it was signalled too
    assert stopped.stderr.count("preemption: stopping after step 2 with a checkpoint") == 2, stopped.stderr[-4000:]
    assert stopped.stderr.count("steadyrl: preempted by SIGTERM after step 2") == 1  # the main process says it
    assert "exiting at once" not in stopped.stderr
    _assert_preempted_at(out, 2, stopped.stderr)
    assert (out / "checkpoint-2" / "steadyrl_rank1.pt").is_file()

    resumed, _ = launch(accelerate_config, tiny_model_dir, out, *args)
    assert [d["global_step"] for d in resumed] == [4, 4]
    for rank in range(2):
        assert_same_weights(straight[rank]["weights"], resumed[rank]["weights"])
