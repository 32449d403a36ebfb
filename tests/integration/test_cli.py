"""The real CLI on the tiny model: validate, train, resolved config, final model, eval, auto-resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def steadyrl(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "steadyrl", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_validate_reports_unknown_key_with_suggestion():
    proc = steadyrl("validate", "configs/tiny/grpo.yaml", "trainer.learnig_rate=1e-5")
    assert proc.returncode == 1
    assert "unknown key 'learnig_rate'" in proc.stderr and "Did you mean 'learning_rate'" in proc.stderr
    ok = steadyrl("validate", "configs/tiny/grpo.yaml", "trainer.learning_rate=1e-6")
    assert ok.returncode == 0
    assert yaml.safe_load(ok.stdout)["trainer"]["learning_rate"] == 1e-6


def test_train_writes_config_model_eval_and_resumes(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        "configs/tiny/grpo.yaml",
        f"model.path={tiny_model_dir}",
        f"trainer.output_dir={out}",
        "trainer.max_steps=2",
        "trainer.save_steps=2",
        "trainer.per_device_train_batch_size=8",
        "trainer.num_generations=4",
        "trainer.max_completion_length=4",
        "eval.max_samples=16",
    ]
    first = steadyrl(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert yaml.safe_load((out / "resolved_config.yaml").read_text())["trainer"]["max_steps"] == 2
    assert (out / "final" / "model.safetensors").is_file() and (out / "final" / "tokenizer.json").is_file()
    result = json.loads((out / "eval_results.json").read_text())
    assert result["metric"] == "exact_match" and 0.0 <= result["accuracy"] <= 1.0
    assert f"eval exact_match after GRPO: {result['accuracy']:.3f}" in first.stdout
    assert "no complete checkpoint, starting fresh" in first.stderr

    # resume_from_checkpoint: auto picks checkpoint-2 and trains on to step 4
    second = steadyrl(*args[:-6], "trainer.max_steps=4", *args[-5:])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resume_from_checkpoint=auto: {out / 'checkpoint-2'}" in second.stderr
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4


def test_missing_resume_path_is_a_clear_error(tmp_path):
    proc = steadyrl("train", "configs/tiny/grpo.yaml", f"trainer.resume_from_checkpoint={tmp_path / 'nope'}")
    assert proc.returncode == 1 and "does not exist" in proc.stderr


def test_compare_overlays_two_real_runs(tiny_model_dir, tmp_path, capsys):
    """Two tiny GRPO runs (plain, and GEPO on) compared: a PNG per logged metric and a table row per run."""
    common = [f"model.path={tiny_model_dir}", "trainer.max_steps=3", "trainer.logging_steps=1",
              "trainer.per_device_train_batch_size=8", "trainer.num_generations=4",
              "trainer.max_completion_length=4", 'trainer.save_strategy="no"', "eval.max_samples=8",
              "eval.every=2"]  # fmt: skip
    runs = {"plain": [], "gepo": ["guards.gepo.enabled=true"]}
    for name, flags in runs.items():
        proc = steadyrl("train", "configs/tiny/grpo.yaml", *common, *flags, f"trainer.output_dir={tmp_path / name}")
        assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "cmp"
    proc = steadyrl("compare", str(tmp_path / "plain"), str(tmp_path / "gepo"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (out / "compare.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in table] == ["| run", "| plain", "| gepo"]
    assert all(row.split(" | ")[1:3] == ["3", "yes"] for row in table[1:])
    for png in ("reward.png", "eval_accuracy.png", "grad_norm.png"):
        assert (out / png).stat().st_size > 1000 and f"]({png})" in report
    assert (out / "gepo_adv_std.png").is_file()  # logged by one run only: still drawn
    assert not (out / "quatro_kl_coef.png").exists()  # logged by neither

    # the refusals, in process (the CLI path itself ran above)
    from steadyrl.cli import main

    assert main(["compare", str(tmp_path / "plain"), str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "no training logs in" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "plain"), "--out", str(out)]) == 2
    assert "at least two runs" in capsys.readouterr().err


def test_progress_line_on_a_terminal_and_none_when_piped(tiny_model_dir, tmp_path):
    import pty

    args = [sys.executable, "-m", "steadyrl", "train", "configs/tiny/grpo.yaml", f"model.path={tiny_model_dir}",
            "trainer.max_steps=2", "trainer.logging_steps=1", "trainer.per_device_train_batch_size=8",
            "trainer.num_generations=4", "trainer.max_completion_length=4", 'trainer.save_strategy="no"',
            "eval.max_samples=8", "eval.every=0", "guards.gepo.enabled=true"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("STEADYRL_PROGRESS", None)
    leader, follower = pty.openpty()
    proc = subprocess.Popen([*args, f"trainer.output_dir={tmp_path / 'tty'}"], cwd=REPO, env=env, stdin=follower,
                            stdout=follower, stderr=follower)  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=600) == 0
    shown = b"".join(chunks).decode(errors="replace")
    assert "step 1/2 (50%) | " in shown and "step 2/2 (100%) | " in shown and "skipped 0" in shown

    piped = subprocess.run([*args, f"trainer.output_dir={tmp_path / 'pipe'}"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert "step 1/2 (50%)" not in piped.stderr + piped.stdout


def test_preflight_calibrates_drills_two_faults_and_writes_a_config_that_validates(tiny_model_dir, tmp_path):
    out = tmp_path / "pf"
    layers = [f"guards.{layer}.enabled=true" for layer in ("gepo", "opefo", "quatro", "grade", "quatro.kl")]
    small = ["trainer.per_device_train_batch_size=8", "trainer.num_generations=4", "trainer.max_completion_length=4"]
    proc = steadyrl("preflight", "configs/tiny/grpo.yaml", f"model.path={tiny_model_dir}", "trainer.beta=0.04",
                    *layers, *small, "--out", str(out), "--steps", "6", "--drill-steps", "5")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {d["name"]: d["held"] for d in report["drills"]} == {"nan_loss": True, "inf_exp_avg_sq": True}
    assert "[preflight] storage plan" in proc.stdout and "checkpoint" in proc.stdout and "MB (x 2 kept)" in proc.stdout
    assert "guards.quatro.kl.target" in report["proposed"]  # the KL controller is on here (off by default)
    # the random model earns reward 0 everywhere: no group has a signal, so the spike margin is not measured and the
    # report says why (tests/unit/test_preflight.py checks the calibration itself)
    assert (
        any("the spike margin was not measured" in n for n in report["notes"])
        or "largest grad norm / spike baseline (calm run)" in report["measured"]
    )
    # the baseline observed: the layers logged what they would do, and nothing was skipped or rolled back
    baseline = [json.loads(line) for line in (out / "runs/baseline/metrics.jsonl").read_text().splitlines()]
    assert any("quatro/would_kl_coef" in row for row in baseline)
    assert all(row.get("gepo/skipped_steps", 0) == 0 and row.get("opefo/rollbacks", 0) == 0 for row in baseline)
    tree = yaml.safe_load((out / "preflight.yaml").read_text())
    assert tree["extends"] == str(REPO / "configs/tiny/grpo.yaml") and tree["trainer"]["beta"] == 0.04
    check = steadyrl("validate", str(out / "preflight.yaml"))
    assert check.returncode == 0, check.stderr
    resolved = yaml.safe_load(check.stdout)
    assert resolved["guards"]["quatro"]["kl"]["target"] == report["proposed"]["guards.quatro.kl.target"]
    assert "| nan_loss | yes |" in (out / "report.md").read_text()
