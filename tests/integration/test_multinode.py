"""Two machines on loopback: ``accelerate launch --num_machines 2 --machine_rank {0,1} --main_process_ip 127.0.0.1``
(c10d rendezvous, gloo), one process per "machine", with the shipped multi-node templates (DDP and DeepSpeed
ZeRO-2) and every guard layer on. A NaN gradient on machine 1 only: both machines skip the same step, log the same
guard decisions and end with equal weights; a resume from the run's checkpoint on the same topology is exact."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.integration.helpers import assert_same_weights
from tests.integration.test_launch import _free_port, launch

pytestmark = pytest.mark.slow

EVERY_LAYER = (
    "guards.gepo.enabled=true",
    "guards.opefo.enabled=true",
    "guards.quatro.enabled=true",
    "guards.quatro.replay.enabled=true",
    "guards.quatro.kl.enabled=true",
    "guards.grade.enabled=true",
    "trainer.beta=0.04",
    "trainer.max_grad_norm=1.0",
    "trainer.max_steps=4",
    "trainer.save_steps=2",
    "trainer.save_total_limit=null",
)
FAULT = "callbacks=[tests.integration.rank_dump:RankDump, tests.integration.rank_dump:NanGradOnRank1]"
# the guard decisions every machine must log alike (their values at each step), with every kind of the ledger
AGREE = ("loss", "grad_norm", "gepo/skipped_steps", "quatro/kl_coef", "quatro/replay_frac", "grade/scaled_mean")


def two_machines(accelerate_config: str, model_dir: Path, out: Path, *extra: str) -> tuple[list[dict], list[str]]:
    """Launch machine 0 and machine 1 of a 2-machine job on this host at once; returns each global rank's RankDump
    and each machine's stderr. Both launchers must exit 0."""
    port = _free_port()

    def machine(rank: int):
        flags = ("--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1")
        return launch(
            accelerate_config, model_dir, out, *extra, accelerate_args=flags, port=port, check=False, timeout=420
        )[1]

    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(machine, (0, 1)))
    for rank, proc in enumerate(procs):
        log = proc.stdout[-3000:] + proc.stderr[-5000:]
        assert proc.returncode == 0, f"machine {rank} exited {proc.returncode}:\n{log}"
    dumps = [torch.load(out / "rank_dump" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return dumps, [p.stderr for p in procs]


@pytest.mark.parametrize("accelerate_config", ["ddp_multinode.yaml", "zero2_multinode.yaml"], ids=["ddp", "zero2"])
def test_two_machines_skip_the_same_step_and_resume_exactly(tiny_model_dir, tmp_path, accelerate_config):
    if accelerate_config.startswith("zero2"):
        pytest.importorskip("deepspeed")
    straight, errs = two_machines(accelerate_config, tiny_model_dir, tmp_path / "straight", *EVERY_LAYER, FAULT)
    assert [d["world_size"] for d in straight] == [2, 2] and [d["global_step"] for d in straight] == [4, 4]
    # the NaN is injected on machine 1 (global rank 1) while global_step == 1: step 2 as the logs number steps
    for err in errs:  # one rank per machine: each machine's log says it once, and nothing else is skipped
        assert err.count("step 2: optimizer step skipped (nonfinite") == 1, err[-3000:]
        assert "optimizer step skipped" not in err.replace("step 2: optimizer step skipped", "")
    rows = [[r for r in d["log_history"] if "loss" in r] for d in straight]
    assert [len(r) for r in rows] == [4, 4]
    ledger = sorted(k for k in rows[0][0] if k.startswith("steadyrl/interventions/"))
    assert len(ledger) >= 10, ledger
    for key in (*AGREE, *ledger):
        assert all(key in r for r in rows[0]), key
        values = [repr([r.get(key) for r in ranks]) for ranks in rows]  # repr: the skipped step's norm is NaN
        assert values[0] == values[1], (key, values)
    assert [r.get("gepo/skipped_steps") for r in rows[0]] == [0, 1, 1, 1]
    assert [r.get("steadyrl/interventions/skipped_step") for r in rows[0]] == [0, 1, 0, 0]
    assert_same_weights(straight[0]["weights"], straight[1]["weights"])
    assert all(torch.isfinite(v).all() for v in straight[0]["weights"].values())
    assert any(not torch.equal(a, b) for a, b in zip(straight[0]["per_step"][0]["weights"].values(),
                                                     straight[0]["weights"].values(), strict=True))  # fmt: skip

    checkpoint = tmp_path / "straight" / "checkpoint-2"
    assert (checkpoint / "steadyrl_complete.json").is_file() and (checkpoint / "steadyrl_rank1.pt").is_file()
    resumed, _ = two_machines(
        accelerate_config, tiny_model_dir, tmp_path / "resumed", *EVERY_LAYER, FAULT,
        f"trainer.resume_from_checkpoint={checkpoint}",
    )  # fmt: skip
    assert [d["global_step"] for d in resumed] == [4, 4]
    for before, after in zip(straight, resumed, strict=True):  # every rank: the same weights as the straight run
        assert_same_weights(before["weights"], after["weights"])
        logged = [[r for r in d["log_history"] if "loss" in r and r["step"] > 2] for d in (before, after)]
        assert [[r[k] for k in ("loss", "grad_norm")] for r in logged[0]] == [
            [r[k] for k in ("loss", "grad_norm")] for r in logged[1]
        ]
