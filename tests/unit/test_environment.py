"""environment.json: what a run was computed with, kept across resumes; the commit only from steadyrl's checkout."""

from __future__ import annotations

import json
import subprocess

import steadyrl.environment as env


def test_resumed_run_keeps_the_earlier_environment(tmp_path, monkeypatch) -> None:
    records = iter([{"steadyrl_commit": "a", "packages": {"trl": "1.16.0"}},
                    {"steadyrl_commit": "a", "packages": {"trl": "1.16.0"}},  # resumed, nothing changed
                    {"steadyrl_commit": "b", "packages": {"trl": "1.17.0"}}])  # fmt: skip
    monkeypatch.setattr(env, "environment", lambda: dict(next(records)))
    env.write_environment(tmp_path)
    env.write_environment(tmp_path)
    assert json.loads((tmp_path / "environment.json").read_text()) == {"steadyrl_commit": "a",
                                                                       "packages": {"trl": "1.16.0"}}  # fmt: skip
    env.write_environment(tmp_path)
    doc = json.loads((tmp_path / "environment.json").read_text())
    assert doc["packages"] == {"trl": "1.17.0"}
    assert doc["earlier"] == [{"steadyrl_commit": "a", "packages": {"trl": "1.16.0"}}]


def test_damaged_file_is_replaced(tmp_path, monkeypatch) -> None:
    (tmp_path / "environment.json").write_text('{"steadyrl_commit": "a", "pack')  # a run killed mid-write
    monkeypatch.setattr(env, "environment", lambda: {"steadyrl_commit": "b", "packages": {}})
    env.write_environment(tmp_path)
    assert json.loads((tmp_path / "environment.json").read_text()) == {"steadyrl_commit": "b", "packages": {}}


def test_commit_of_another_repository_is_not_reported(tmp_path, monkeypatch) -> None:
    assert env.source_commit() is not None  # the test suite runs from steadyrl's checkout
    site = tmp_path / "project" / ".venv" / "site-packages"  # an installed steadyrl inside a user's repository
    (site / "steadyrl").mkdir(parents=True)
    (site / "steadyrl" / "__init__.py").write_text("")
    subprocess.run(["git", "init", "-q", str(tmp_path / "project")], check=True)
    monkeypatch.setattr(env, "REPO", site)
    assert env.source_commit() is None
    assert env.package_versions()["steadyrl"] is not None and "torch" in env.package_versions()


def test_machine_names_the_cpu_kernels_torch_uses() -> None:
    import torch

    found = env.machine()
    assert found["torch_cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    assert found["arch"] and found["cpu"]
    assert set(env.environment()) == {"steadyrl_commit", "packages", "machine"}


def test_machine_line_for_results_files(monkeypatch) -> None:
    found = {"cpu": "AMD EPYC", "arch": "x86_64", "torch_cpu_kernels": "AVX512", "accelerator": None}
    monkeypatch.setattr(env, "machine", lambda: found)
    monkeypatch.setattr(env.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert env.machine_line() == "2-core AMD EPYC (x86_64, torch CPU kernels AVX512), no GPU, OMP_NUM_THREADS=1"
    monkeypatch.setattr(env, "machine", lambda: {**found, "accelerator": "NVIDIA H200"})
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert env.machine_line().endswith("), NVIDIA H200, OMP_NUM_THREADS=unset")
