"""Real multi-process launches on CPU: `accelerate launch -m steadyrl train` with DDP and DeepSpeed ZeRO-2."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import assert_same_weights

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def launch(
    accelerate_config: str,
    model_dir: Path,
    out: Path,
    *extra: str,
    num_processes: int = 2,
    config: str = "grpo.yaml",
    env_extra: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 900,
    accelerate_args: tuple[str, ...] = (),
    port: int | None = None,
):
    """``accelerate launch -m steadyrl train`` on the tiny config; returns each rank's RankDump and the process
    (``check``: the launch must exit 0; ``env_extra``: added to the environment; ``accelerate_args``: more flags
    for ``accelerate launch``; ``port``: the rendezvous port, free by default)."""
    if not any(e.startswith("callbacks=") for e in extra):
        extra = (*extra, "callbacks=[tests.integration.rank_dump:RankDump]")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / accelerate_config),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(port or _free_port()),
        *accelerate_args,
        "-m",
        "steadyrl",
        "train",
        str(REPO / "configs" / "tiny" / config),
        f"model.path={model_dir}",
        f"trainer.output_dir={out}",
        "trainer.max_steps=2",
        "trainer.per_device_train_batch_size=4",
        "trainer.num_generations=4",
        "trainer.max_completion_length=4",
        "trainer.save_steps=2",
        "trainer.logging_steps=1",
        "trainer.ddp_backend=gloo",
        "rewards=[{fn: 'tests.integration.helpers:byte_mean'}]",
        "eval.max_samples=8",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    env.update(env_extra or {})
    # its own session: a test that signals the process group reaches this launch and its workers, not pytest
    popen = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = popen.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a hung launch: kill the launcher and every worker, then fail
        for pid in [*_descendants(popen.pid), popen.pid]:  # torchrun's workers may sit outside its process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            stdout, stderr = popen.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        raise AssertionError(f"launch hung (killed after {timeout} s):\n{stdout[-3000:]}{stderr[-4000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, stdout, stderr)
    log = proc.stdout[-4000:] + proc.stderr[-6000:]
    if not check:
        return None, proc
    assert proc.returncode == 0, f"launch exited with {proc.returncode}:\n{log}"
    dumps = [torch.load(out / "rank_dump" / f"rank{r}.pt", weights_only=False) for r in range(num_processes)]
    return dumps, proc


def _check_ranks_agree(dumps, model_dir):
    from transformers import AutoModelForCausalLM

    assert [d["world_size"] for d in dumps] == [2, 2]
    assert [d["global_step"] for d in dumps] == [2, 2]
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])
    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in dumps[0]["weights"].items()), "weights must change"


def test_ddp_two_processes_with_quatro_filters_kl_entropy_and_replay(tiny_model_dir, tmp_path):
    """2 DDP processes with QUATRO on (filters, adaptive KL, entropy floor, replay), the repetition filter tuned to
    fire (any token twice): every rank filters the gathered generation batch, so both log the same
    ``quatro/filtered/*`` counts and KL coefficient and finish with equal weights; the checkpoint holds each rank's
    file and the eval runs. Replay is per rank (own buffer, seeded seed + rank, in its own rank file); its metrics are
    summed over ranks, so both log the same share."""
    out = tmp_path / "quatro"
    dumps, proc = launch(
        "multi_cpu.yaml",
        tiny_model_dir,
        out,
        "guards.quatro.enabled=true",
        "guards.quatro.kl.enabled=true",
        "trainer.beta=0.04",
        "trainer.max_completion_length=16",  # 4 random bytes rarely repeat one; 16 often do
        "guards.quatro.filters.repetition.n=1",
        "guards.quatro.filters.repetition.max_repeat_share=0.0",
        "guards.quatro.filters.max_drop_share=1.0",
        "guards.quatro.replay.enabled=true",
    )
    _check_ranks_agree(dumps, tiny_model_dir)
    assert (out / "checkpoint-2" / "steadyrl_complete.json").is_file() and (
        out / "checkpoint-2" / "steadyrl_rank1.pt"
    ).is_file()
    assert "eval byte_mean after GRPO" in proc.stdout
    rows = [[row for row in d["log_history"] if "loss" in row] for d in dumps]
    assert [len(r) for r in rows] == [2, 2]
    filtered = sorted(k for k in rows[0][0] if k.startswith("quatro/filtered/"))
    assert "quatro/filtered/repetition" in filtered
    for key in [*filtered, "quatro/kl_coef", "quatro/replay_frac"]:
        assert [row[key] for row in rows[0]] == [row[key] for row in rows[1]], key
    repetition = [row["quatro/filtered/repetition"] for row in rows[0]]
    assert sum(repetition) > 0 and all(c <= 8 for c in repetition), repetition  # 2 ranks x 4 completions a step
    # step 2 replays round_half_up(0.3 x 4) = 1 row on each rank whose buffer holds a signal row from step 1
    buffers = [
        torch.load(out / "checkpoint-2" / f"steadyrl_rank{r}.pt", weights_only=False)["guards"]["quatro"]["replay"]
        for r in range(2)
    ]
    assert [b["seed"] for b in buffers] == [0, 1] and [e["step"] for e in buffers[0]["entries"]] == [0, 1]
    expected = sum(min(1, len(b["entries"][0]["rows"])) for b in buffers) / 8
    assert expected > 0 and [row["quatro/replay_frac"] for row in rows[0]] == [0.0, expected]


@pytest.mark.parametrize("accelerate_config", ["multi_cpu.yaml", "zero2.yaml"], ids=["ddp", "zero2"])
def test_nan_on_one_rank_makes_every_rank_skip(tiny_model_dir, tmp_path, accelerate_config):
    """A NaN gradient on rank 1 only: the global norm (DDP all-reduce, or ZeRO-2's own all-reduced norm inside
    the engine's step) is NaN on both ranks, so both skip that step and the weights stay equal and finite."""
    if accelerate_config == "zero2.yaml":
        pytest.importorskip("deepspeed")
    dumps, proc = launch(
        accelerate_config,
        tiny_model_dir,
        tmp_path / "nan",
        "trainer.max_steps=3",
        "trainer.max_grad_norm=1.0",
        "trainer.lr_scheduler_type=linear",
        "trainer.warmup_steps=0",
        "guards.gepo.enabled=true",
        "callbacks=[tests.integration.rank_dump:RankDump, tests.integration.rank_dump:NanGradOnRank1]",
    )
    assert [d["global_step"] for d in dumps] == [3, 3]
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])
    assert all(torch.isfinite(v).all() for v in dumps[0]["weights"].values())
    # the NaN is injected while global_step == 1, i.e. in step 2 as the logs number steps
    assert proc.stderr.count("step 2: optimizer step skipped (nonfinite") == 2  # once per rank, at the NaN step
    assert "optimizer step skipped" not in proc.stderr.replace("step 2: optimizer step skipped", "")
    # the skipped step left the LR schedule alone on every rank: steps 0 and 1 log the same learning rate
    lrs = [d["lrs"] for d in dumps]
    assert lrs[0] == lrs[1] and lrs[0][1] == lrs[0][2] and lrs[0][2] > lrs[0][3]


@pytest.mark.parametrize("accelerate_config", ["multi_cpu.yaml", "zero2.yaml"], ids=["ddp", "zero2"])
def test_spike_on_one_rank_is_skipped_bit_identically(tiny_model_dir, tmp_path, accelerate_config):
    """A finite gradient spike (x1e6 on rank 1 in step 3, i.e. while global_step == 2). DDP: the all-reduced
    gradient carries it to both ranks and the step guard, deciding on the global pre-clip norm, vetoes the step on
    both. ZeRO-2: DeepSpeed alone would apply it (it only skips non-finite norms); the spike guard inside the
    engine's step vetoes it on both ranks. Either way every rank's weights and Adam moments stay bit-identical (and
    under ZeRO-2 the launch really runs DeepSpeed's ZeRO stage 2 optimizer on both ranks)."""
    if accelerate_config == "zero2.yaml":
        pytest.importorskip("deepspeed")
    dumps, proc = launch(
        accelerate_config,
        tiny_model_dir,
        tmp_path / "spike",
        "trainer.max_steps=4",
        "trainer.save_steps=4",
        "guards.gepo.enabled=true",
        "guards.gepo.spike.warmup_steps=2",
        "callbacks=[tests.integration.rank_dump:RankDump, tests.integration.rank_dump:SpikeGradOnRank1]",
    )
    assert proc.stderr.count("step 3: optimizer step skipped (spike") == 2, proc.stderr[-3000:]
    for d in dumps:
        before, after = d["per_step"][1], d["per_step"][2]  # after steps 1 and 2 (the skipped one)
        assert_same_weights(before["weights"], after["weights"])
        assert len(before["moments"]) == len(after["moments"]) > 0
        for m0, m1 in zip(before["moments"], after["moments"], strict=True):
            assert all(torch.equal(m0[k], m1[k]) for k in ("exp_avg", "exp_avg_sq"))
        assert any(not torch.equal(v, d["per_step"][3]["weights"][k]) for k, v in after["weights"].items())
        if accelerate_config == "zero2.yaml":
            assert "DeepSpeedZeroOptimizer" in d["optimizer_chain"] and d["zero_stage"] == 2, d["optimizer_chain"]
    assert [d["world_size"] for d in dumps] == [2, 2]
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])


def test_micro_batch_spike_on_one_rank_is_dropped_and_ranks_stay_equal(tiny_model_dir, tmp_path):
    """granularity: micro_batch under DDP: each backward stays local, rank 1 drops its spiking micro-batch (x1e6),
    the step all-reduces the 7 kept micro-batches of both ranks and is taken; both ranks end with equal weights."""
    dumps, proc = launch(
        "multi_cpu.yaml",
        tiny_model_dir,
        tmp_path / "micro",
        "trainer.max_steps=4",
        "trainer.save_steps=4",
        "trainer.per_device_train_batch_size=1",
        "trainer.gradient_accumulation_steps=4",
        "trainer.max_grad_norm=1.0",
        "guards.gepo.enabled=true",
        "guards.gepo.spike.warmup_steps=2",
        "guards.gepo.spike.granularity=micro_batch",
        "callbacks=[tests.integration.rank_dump:RankDump, tests.integration.rank_dump:MicroSpikeOnRank1]",
    )
    assert proc.stderr.count("step 3: micro-batch 3 dropped (spike") == 1, proc.stderr[-3000:]
    assert "optimizer step skipped" not in proc.stderr
    for d in dumps:
        assert all(torch.isfinite(v).all() for v in d["weights"].values())
        before, after = d["per_step"][1], d["per_step"][2]  # the step with the dropped micro-batch was taken
        assert any(not torch.equal(v, after["weights"][k]) for k, v in before["weights"].items())
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])


def _launch_with_a_bad_moment(accelerate_config, model_dir, out, fault):
    """4 steps on 2 ranks with OPEFO checking and snapshotting every step; ``fault``: a rank_dump callback that
    corrupts rank 1's Adam state after step 2."""
    if accelerate_config == "zero2.yaml":
        pytest.importorskip("deepspeed")
    return launch(
        accelerate_config,
        model_dir,
        out,
        "trainer.max_steps=4",
        "trainer.save_steps=4",
        "trainer.max_grad_norm=1.0",
        "guards.opefo.enabled=true",
        "guards.opefo.rollback.check_interval=1",
        "guards.opefo.rollback.snapshot_interval=1",
        "guards.opefo.rollback.storage=disk",
        f"callbacks=[tests.integration.rank_dump:RankDump, tests.integration.rank_dump:{fault}]",
    )


@pytest.mark.parametrize("accelerate_config", ["multi_cpu.yaml", "zero2.yaml"], ids=["ddp", "zero2"])
def test_nan_in_one_ranks_optimizer_state_rolls_back_every_rank(tiny_model_dir, tmp_path, accelerate_config):
    """NaN in rank 1's Adam state only (after step 2): rank 1's step-3 update is NaN, the all-reduced check finds
    it, both ranks restore their own part of the step-2 snapshot together and finish with equal, finite weights."""
    dumps, proc = _launch_with_a_bad_moment(accelerate_config, tiny_model_dir, tmp_path / "rb", "NanMomentOnRank1")
    assert [d["global_step"] for d in dumps] == [4, 4]
    assert proc.stderr.count("step 3: OPEFO rollback #1 to the snapshot of step 2 (cause: non-finite") == 2
    # one rollback restores everything (under ZeRO also the fp32 master partitions): no second one at step 4
    assert "OPEFO rollback #2" not in proc.stderr
    for d in dumps:  # after step 3 every rank is back at its step-2 state, and step 4 trains again
        assert_same_weights(d["per_step"][1]["weights"], d["per_step"][2]["weights"])
        assert any(not torch.equal(v, d["per_step"][3]["weights"][k]) for k, v in d["per_step"][2]["weights"].items())
        assert all(torch.isfinite(m["exp_avg_sq"]).all() for m in d["per_step"][-1]["moments"])
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])
    assert all(torch.isfinite(v).all() for v in dumps[0]["weights"].values())
    # the step-4 snapshot on disk: the weights once (the first rank); the Adam state once (DDP: its replicas) or each
    # rank its part (ZeRO: with its fp32 master partition); the rollback above broadcast the rest from the first rank
    held = [_snapshot_payload(tmp_path / "rb", rank) for rank in (0, 1)]
    zero = accelerate_config == "zero2.yaml"
    assert {"params", "optimizer", "guards"} <= set(held[0]) and ("fp32_partitions" in held[0]) == zero
    assert set(held[1]) == ({"guards", "optimizer", "fp32_partitions"} if zero else {"guards"})


def _snapshot_payload(out: Path, rank: int) -> dict:
    (path,) = (out / "opefo_snapshots" / f"rank{rank}").glob("snapshot-*.pt")
    return torch.load(path, weights_only=False)["payload"]


@pytest.mark.parametrize("accelerate_config", ["multi_cpu.yaml", "zero2.yaml"], ids=["ddp", "zero2"])
def test_inf_in_one_ranks_moments_is_repaired_under_zero_and_rolled_back_under_ddp(
    tiny_model_dir, tmp_path, accelerate_config
):
    """inf in rank 1's exp_avg_sq only, weights finite. Under ZeRO-2 each rank holds its own partition, so rank 1
    repairs its entry in place and both ranks go on with no rollback. Under DDP the replicas must stay equal and
    rank 0 has nothing to repair: both ranks roll back together, naming why."""
    dumps, proc = _launch_with_a_bad_moment(accelerate_config, tiny_model_dir, tmp_path / "repair", "InfMomentOnRank1")
    assert [d["global_step"] for d in dumps] == [4, 4]
    if accelerate_config == "zero2.yaml":
        assert proc.stderr.count("step 3: OPEFO repaired 1 non-finite Adam moment entry in place") == 2
        assert "OPEFO rollback" not in proc.stderr
        for d in dumps:  # step 3 was kept: no rollback to the step-2 state
            before, after = d["per_step"][1]["weights"], d["per_step"][2]["weights"]
            assert any(not torch.equal(v, after[k]) for k, v in before.items())
    else:
        assert proc.stderr.count("step 3: OPEFO rollback #1 to the snapshot of step 2") == 2
        assert "the ranks' optimizer replicas hold different numbers of non-finite entries" in proc.stderr
    for d in dumps:
        assert all(torch.isfinite(m["exp_avg_sq"]).all() for m in d["per_step"][-1]["moments"])
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])


def test_resume_on_another_number_of_processes_drops_per_rank_state_and_rolls_back_to_a_best_kept_by_one(
    tiny_model_dir, tmp_path
):
    """2 -> 1 -> 2 processes (DDP), each save in the middle of a generation window (4 steps per generation, saves
    every 3): each resume warns naming both counts, every rank drops its rollout buffer and per-rank guard state
    (without that, one rank reuses its buffered rollouts while the other generates, and generation hangs). The gold
    watch keeps its best at step 4 on 1 process; on 2 processes the eval falls at 8 and both ranks restore that best
    from the files one process wrote (the weights and the optimizer state once: before, rank 1 died with
    FileNotFoundError on gold_state_rank1.pt); the ranks end with equal weights at the step asked for."""
    from tests.integration.test_gold_watch import BEST_DIR, gold_rollbacks, gold_watch_overrides

    out = tmp_path / "resize"
    every_layer = (
        *gold_watch_overrides("gold_best_at_4"),
        "guards.gepo.enabled=true",
        "guards.opefo.enabled=true",
        "guards.quatro.replay.enabled=true",
        "trainer.steps_per_generation=4",
        "trainer.save_steps=3",
        "trainer.resume_from_checkpoint=auto",
    )
    launch("multi_cpu.yaml", tiny_model_dir, out, *every_layer, "trainer.max_steps=3", timeout=150)
    one, to_one = launch(
        "single.yaml", tiny_model_dir, out, *every_layer, "trainer.max_steps=6", num_processes=1, timeout=150
    )
    kept = json.loads((out / BEST_DIR / "gold.json").read_text())
    assert (kept["step"], kept["ranks"], kept["partitioned"]) == (4, 1, False)
    two, to_two = launch("multi_cpu.yaml", tiny_model_dir, out, *every_layer, "trainer.max_steps=9", timeout=150)
    assert one[0]["global_step"] == 6 and [d["global_step"] for d in two] == [9, 9]
    assert_same_weights(two[0]["weights"], two[1]["weights"])
    warning = "was written by {} processes and this run has {}: per-rank state is dropped"
    assert warning.format(2, 1) in to_one.stdout + to_one.stderr
    assert warning.format(1, 2) in to_two.stdout + to_two.stderr
    assert gold_rollbacks(out) == [(8, 4), (9, 4)], to_two.stderr[-3000:]  # the fall; the run's end on the best
