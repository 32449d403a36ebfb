"""configs/slurm/steadyrl.sbatch with stand-ins for srun, scontrol and accelerate: the launch line each node runs
(the flags tests/integration/test_multinode.py launches on loopback) and the requeue after a preemption."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "configs" / "slurm" / "steadyrl.sbatch"
STUBS = {
    # srun runs its command once per node, as Slurm would with --ntasks-per-node=1
    "srun": 'while [[ "$1" == --* ]]; do shift; done\n'
    'if [ -n "${FAKE_HANG:-}" ]; then\n'  # a long run: wait for the relayed SIGTERM, exit as torchrun does (1)
    '  trap \'echo "srun: SIGTERM relayed" >> "$LOG"; exit 1\' TERM; echo started >> "$LOG"\n'
    "  while :; do sleep 0.1; done\n"
    "fi\n"
    'rc=0; for n in 0 1; do SLURM_NODEID=$n "$@" || rc=$?; done; exit $rc',
    "scontrol": 'if [ "$1" = show ]; then printf "gpu-a\\ngpu-b\\n"; else echo "scontrol $*" >> "$LOG"; fi',
    "accelerate": 'echo "node $SLURM_NODEID: accelerate $*" >> "$LOG"; exit "${FAKE_RC:-0}"',
}


def _env(tmp_path: Path, rc: int, **extra: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "LOG": str(tmp_path / "log"),
        "FAKE_RC": str(rc),
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        **extra,
    }
    return env


def _run(tmp_path: Path, rc: int, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = _env(tmp_path, rc)
    proc = subprocess.run(["bash", str(SBATCH), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return proc, _log(tmp_path)


def _log(tmp_path: Path) -> list[str]:
    log = tmp_path / "log"
    return log.read_text().splitlines() if log.exists() else []


def test_each_node_launches_with_its_rank_and_the_first_node_as_rendezvous(tmp_path):
    proc, log = _run(tmp_path, 0, "configs/models/qwen2.5-14b.yaml", "trainer.learning_rate=1e-6")
    assert proc.returncode == 0, proc.stderr
    common = (
        "accelerate launch --config_file configs/accelerate/zero2_multinode.yaml --num_machines 2 --machine_rank {}"
        " --num_processes 16 --main_process_ip gpu-a --main_process_port 29500 --rdzv_backend c10d"
        " -m steadyrl train configs/models/qwen2.5-14b.yaml trainer.learning_rate=1e-6"
    )
    assert log == [f"node 0: {common.format(0)}", f"node 1: {common.format(1)}"]
    assert "rendezvous at gpu-a:29500" in proc.stdout
    assert (REPO / "configs/accelerate/zero2_multinode.yaml").is_file()


@pytest.mark.parametrize(("rc", "requeued"), [(75, True), (1, False)])
def test_a_preempted_run_is_requeued_and_a_failed_one_is_not(tmp_path, rc, requeued):
    proc, log = _run(tmp_path, rc, "configs/models/qwen2.5-7b.yaml")
    assert proc.returncode == rc
    assert ("scontrol requeue 4242" in log) is requeued


def test_no_config_is_a_usage_error(tmp_path):
    proc, log = _run(tmp_path, 0)
    assert proc.returncode == 2 and "usage: sbatch configs/slurm/steadyrl.sbatch CONFIG.yaml" in proc.stderr
    assert log == []


def test_the_time_limit_signal_reaches_srun_and_the_job_is_requeued(tmp_path):
    """Slurm's SIGTERM before the time limit (--signal=B:TERM@300) goes to the batch script; it relays it to srun,
    waits for srun to end (torchrun exits 1 after its workers stopped with a checkpoint) and requeues the job."""
    env = _env(tmp_path, 0, FAKE_HANG="1")
    proc = subprocess.Popen(["bash", str(SBATCH), "configs/models/qwen2.5-7b.yaml"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    for _ in range(100):
        if "started" in _log(tmp_path):
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, err
    assert _log(tmp_path) == ["started", "srun: SIGTERM relayed", "scontrol requeue 4242"]
    assert "preempted (SIGTERM), requeueing job 4242" in out
