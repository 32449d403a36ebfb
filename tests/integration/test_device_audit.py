"""Every guard path, run through ``steadyrl train`` in this process under ``HostTensorAudit``: no op mixes a
tensor steadyrl made without ``device=`` with a model or data tensor (the mix that raises on CUDA and passes on
the CPU; see device_audit.py). The runs cover every layer on with a NaN micro-batch (the skip), an inf Adam
moment (the repair), a checkpoint and a resume (guard state loaded back), the entropy floor's brake, and PPO with
its critic. Cut a ``.item()`` or a ``device=`` from a guard and this test names the line."""

from __future__ import annotations

import json

import pytest
import torch

from steadyrl.cli import main
from steadyrl.faults import FAULT_STEP_ENV, FAULT_VALUE_ENV
from steadyrl.guards import moment_floor, rollout_filters
from tests.integration.device_audit import HostTensorAudit, Mix

pytestmark = pytest.mark.slow

ON = [f"guards.{layer}.enabled=true" for layer in ("gepo", "grade", "opefo", "quatro")]
SMALL = ["trainer.per_device_train_batch_size=8", "trainer.num_generations=4", "trainer.max_completion_length=8",
         "trainer.logging_steps=1", "eval.enabled=false", "trainer.use_cpu=true", "trainer.bf16=false",
         "rewards=[{fn: 'steadyrl.faults:repetition_reward', weight: 1.0}]"]  # fmt: skip


def _train(audit: HostTensorAudit, config: str, *overrides: str) -> None:
    with audit:
        assert main(["train", config, *overrides]) == 0


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _steps(run) -> list[int]:
    return sorted({r["step"] for r in _rows(run) if "loss" in r})


def test_no_guard_path_mixes_a_host_tensor_with_a_device_tensor(tiny_model_dir, tmp_path, monkeypatch):
    # A tensor steadyrl cached in an earlier test was made outside any audit, so the audit would count it as a
    # device tensor and report a false mix (the n-gram filters' powers of the id base, cached per device).
    rollout_filters._powers.cache_clear()
    monkeypatch.setattr(moment_floor, "SAMPLE_SIZE", 1024)  # the floor's sampled percentile, each step (below)
    audit = HostTensorAudit()
    base = [f"model.path={tiny_model_dir}", *SMALL, *ON]
    # the paths the shipped config leaves off, too: replay, the filters' loss mask, and
    # two updates per generation (old log-probs, the replay importance ratio); bf16 weights, as on a GPU (the CPU
    # has no bf16 autocast here, so the weights and the optimizer state themselves are bf16)
    grpo = [*base, "guards.quatro.replay.enabled=true",
            "guards.quatro.filters.dropped_rows=exclude", "trainer.num_iterations=2",
            "guards.opefo.floor.interval=1",  # the floor each step
            "guards.gepo.advantage.outlier_z=0",  # GEPO's median/MAD rule on every group, not only on far outliers
            "model.dtype=bfloat16"]  # fmt: skip
    run = tmp_path / "grpo"
    monkeypatch.setenv(FAULT_STEP_ENV, "2")
    _train(audit, "configs/tiny/grpo-guarded.yaml", *grpo, f"trainer.output_dir={run}", "trainer.max_steps=4",
           "trainer.save_steps=2", "callbacks=[steadyrl.faults:NanLossAtStep]")  # fmt: skip
    assert _steps(run) == [1, 2, 3, 4]
    # resumed from step 4 (the guards' saved state comes back), an inf Adam moment at step 5, the brake on
    monkeypatch.setenv(FAULT_STEP_ENV, "5")
    monkeypatch.setenv(FAULT_VALUE_ENV, "inf")
    _train(audit, "configs/tiny/grpo-guarded.yaml", *grpo, f"trainer.output_dir={run}", "trainer.max_steps=7",
           "trainer.save_steps=2", "guards.quatro.entropy.pg_brake=1.0", "guards.opefo.rollback.check_interval=1",
           "callbacks=[steadyrl.faults:InfExpAvgSqAtStep]")  # fmt: skip
    assert _steps(run)[-3:] == [5, 6, 7]
    last = [r for r in _rows(run) if "loss" in r][-1]  # the paths ran: step 2 skipped, the inf repaired, the brake
    assert last["gepo/skipped_steps"] == 1 and last["opefo/repairs"] == 1 and "quatro/pg_scale" in last
    assert last["quatro/replay_frac"] > 0
    monkeypatch.delenv(FAULT_STEP_ENV)
    monkeypatch.delenv(FAULT_VALUE_ENV)
    ppo = tmp_path / "ppo"
    _train(audit, "configs/tiny/ppo.yaml", *base, f"trainer.output_dir={ppo}", "trainer.max_steps=2",
           'trainer.save_strategy="no"', "guards.gepo.advantage.enabled=false", "guards.quatro.kl.enabled=false",
           "guards.quatro.filters.zero_variance.enabled=false")  # fmt: skip
    assert _steps(ppo) == [1, 2]
    assert audit.host_made > 0  # the audit saw steadyrl's own host tensors (else it checked nothing)
    assert not audit.mixes, "\n".join(sorted(map(str, audit.mixes)))


def test_the_audit_names_a_host_bound_that_meets_device_advantages():
    """The bug the H200 run found, written out: a bound made with torch.tensor() and no device, clamping data."""
    from tests.integration import device_audit

    advantages = torch.tensor([0.5, -4.0, 4.0])  # made here, in a test: stands for a device tensor
    audit = HostTensorAudit()
    with audit:
        exec(compile("bound = torch.tensor(3.0)\nadvantages.clamp(-bound, bound)",
                     device_audit.PACKAGE + "/guards/robust_advantage.py", "exec"),
             {"torch": torch, "advantages": advantages})  # fmt: skip
    assert audit.mixes == {Mix("steadyrl/guards/robust_advantage.py:2", "clamp",
                               ("steadyrl/guards/robust_advantage.py:1",))}  # fmt: skip
    audit = HostTensorAudit()
    with audit:
        exec(compile("bound = torch.tensor(3.0, device=advantages.device)\nadvantages.clamp(-bound, bound)",
                     device_audit.PACKAGE + "/guards/robust_advantage.py", "exec"),
             {"torch": torch, "advantages": advantages})  # fmt: skip
    assert audit.host_made == 0 and not audit.mixes
