"""scripts/experiments.py, the bench scripts' runner, driven with a fake ``train`` program (a few lines of python that
write metrics.jsonl and eval_results.json): a run that dies, one that hangs past its timeout, collect-only, merge,
and the paired statistics, all against hand-computed numbers."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _experiments() -> Any:
    spec = importlib.util.spec_from_file_location("experiments", SCRIPTS / "experiments.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["experiments"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


X = _experiments()

# argv: OUT ACCURACY STEPS [die_at=K | hang | child]. One metrics row per step (loss = step / 10); exit 3 after
# step K with die_at; with hang, sleep forever after step 1; with child, start a grandchild that writes its pid and
# sleeps (a timeout must kill it too).
FAKE_TRAIN = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    out, accuracy, steps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    os.makedirs(out, exist_ok=True)
    print("seed env", os.environ.get("FAKE_SEED"), "threads", os.environ["OMP_NUM_THREADS"], flush=True)
    if mode == "child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(os.path.join(out, "child.pid"), "w").write(str(child.pid))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "loss": step / 10}) + "\\n")
            f.flush()
            if mode == "die_at=%d" % step:
                print("RuntimeError: boom", flush=True)
                sys.exit(3)
            if mode in ("hang", "child"):
                time.sleep(600)
    json.dump({"accuracy": accuracy}, open(os.path.join(out, "eval_results.json"), "w"))
    """
)


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    return path


def _job(fake: Path, root: Path, variant: str, seed: int, accuracy: float, *mode: str, steps: int = 4) -> Any:
    out = root / f"{variant}-s{seed}"
    cmd = (sys.executable, str(fake), str(out), str(accuracy), str(steps), *mode)
    return X.Job(variant, "clean", seed, out, cmd, (("FAKE_SEED", str(seed)),))


def test_runs_read_back_and_a_dead_run_keeps_its_last_step(fake: Path, tmp_path: Path) -> None:
    jobs = [_job(fake, tmp_path, "plain", 0, 0.5), _job(fake, tmp_path, "gepo", 0, 0.7, "die_at=2")]
    results = X.run_jobs(jobs, timeout=60)
    assert list(results) == [("plain", "clean", 0), ("gepo", "clean", 0)]  # the order of the jobs
    ok, dead = results[("plain", "clean", 0)], results[("gepo", "clean", 0)]
    assert (ok.status, ok.returncode, ok.last_step, ok.eval, ok.timed_out) == ("ok", 0, 4, {"accuracy": 0.5}, False)
    assert ok.history.series("loss")[1].tolist() == [0.1, 0.2, 0.3, 0.4]
    assert (dead.status, dead.returncode, dead.last_step, dead.eval) == ("died", 3, 2, None)
    assert "RuntimeError: boom" in (tmp_path / "gepo-s0" / "log.txt").read_text()
    # the child's environment: OMP_NUM_THREADS=1 and the job's own variables
    assert "seed env 0 threads 1" in dead.log
    assert json.loads((tmp_path / "gepo-s0" / "run.json").read_text())["returncode"] == 3
    assert (tmp_path / "plain-s0" / "command.txt").read_text().startswith("OMP_NUM_THREADS=1 FAKE_SEED=0 ")


def test_a_rerun_starts_its_folder_afresh(fake: Path, tmp_path: Path) -> None:
    """metrics.jsonl appends: without emptying the folder the second run would read 8 rows."""
    job = _job(fake, tmp_path, "plain", 0, 0.5)
    X.run_jobs([job], timeout=60)
    again = X.run_jobs([job], timeout=60)[job.key]
    assert again.history.series("loss")[0].tolist() == [1, 2, 3, 4]


def test_timeout_kills_the_process_group_and_counts_as_died(fake: Path, tmp_path: Path) -> None:
    job = _job(fake, tmp_path, "plain", 0, 0.5, "child")
    start = time.time()
    run = X.run_jobs([job], timeout=3)[job.key]
    assert time.time() - start < 30
    assert (run.status, run.returncode, run.timed_out, run.last_step) == ("died", -1, True, 1)
    assert (job.out / "log.txt").read_text().startswith("timeout after 3 s\n")
    child = int((job.out / "child.pid").read_text())
    for _ in range(50):  # the grandchild went with its group (reaped by init shortly after)
        if not Path(f"/proc/{child}").exists() or "State:\tZ" in Path(f"/proc/{child}/status").read_text():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"grandchild {child} outlived the timeout")
    summary = X.run_jobs([job], X.summary, collect_only=True)[job.key]
    assert summary == {"status": "died", "returncode": -1, "timed_out": True, "wall_s": summary["wall_s"],
                       "last_step": 1, "accuracy": None}  # fmt: skip


def test_collect_only_reads_the_folders_and_leaves_out_runs_never_made(fake: Path, tmp_path: Path) -> None:
    made = _job(fake, tmp_path, "plain", 0, 0.5)
    X.run_jobs([made], timeout=60)
    never = _job(fake, tmp_path, "plain", 1, 0.6)
    results = X.run_jobs([made, never], X.summary, collect_only=True)
    assert list(results) == [made.key] and results[made.key]["accuracy"] == 0.5
    assert not never.out.exists()  # nothing was started
    # reuse: the finished run is read back, the missing one is made
    results = X.run_jobs([made, never], X.summary, reuse=True, timeout=60)
    assert [r["accuracy"] for r in results.values()] == [0.5, 0.6]


def test_jobs_in_parallel_keep_the_order_of_the_matrix(fake: Path, tmp_path: Path) -> None:
    jobs = [_job(fake, tmp_path, v, s, 0.1 * s) for v in ("plain", "all") for s in range(3)]
    results = X.run_jobs(jobs, X.summary, workers=3, timeout=60)
    assert list(results) == [j.key for j in jobs]
    assert [r["accuracy"] for r in results.values()] == [0.0, 0.1, 0.2, 0.0, 0.1, 0.2]


def test_paired_difference_and_mean_std_by_hand() -> None:
    plain = {0: 0.91, 1: 0.90, 2: 0.85, 3: 0.70}
    guarded = {0: 0.90, 1: 0.88, 2: 0.86}  # seed 3 missing: the pairs are seeds 0-2
    mean, se, n = X.paired_difference(guarded, plain)
    # diffs -0.01, -0.02, +0.01: mean -0.006667, sample std 0.015275, s.e. 0.015275 / sqrt(3) = 0.008819
    assert (round(mean, 6), round(se, 6), n) == (-0.006667, 0.008819, 3)
    assert X.paired_difference({0: 0.5}, {0: 0.4}) is None
    # population std: values 0.5, 0.7 -> mean 0.6, std 0.1; None and NaN are left out
    assert X.mean_std([0.5, None, 0.7, math.nan]) == "0.600 ± 0.100"
    assert X.mean_std([None]) == "-" and X.mean_std([2.0], 1) == "2.0 ± 0.0"


def test_cells_list_per_seed_and_a_dead_run_has_no_accuracy() -> None:
    runs = [{"status": "ok", "accuracy": 0.5, "last_step": 4}, {"status": "died", "accuracy": 0.7, "last_step": 2}]
    cell = X.cell("clean", "gepo", [0, 1], runs, ("last_step",), note="why")
    assert cell == {"scenario": "clean", "variant": "gepo", "seeds": [0, 1], "note": "why", "died": [False, True],
                    "accuracy": [0.5, None], "metrics": {"last_step": [4, 2]}}  # fmt: skip


def _cell(scenario: str, variant: str, accuracy: float) -> dict[str, Any]:
    return {"scenario": scenario, "variant": variant, "seeds": [0], "died": [False], "accuracy": [accuracy]}


def test_merge_replaces_only_this_runs_cells_each_keeping_its_command_and_commit(tmp_path: Path) -> None:
    base = {"date": "d", "machine": "m", "packages": {}, "steps": 20}
    old = {**base, "command": "first", "commit": "aaa",
           "cells": [_cell("clean", "plain", 0.5), _cell("clean", "gepo", 0.6), _cell("nan", "gepo", 0.4)]}  # fmt: skip
    path = tmp_path / "r.json"
    path.write_text(json.dumps(old))
    new = {**base, "command": "second", "commit": "bbb-dirty",
           "cells": [_cell("clean", "gepo", 0.65), _cell("inf", "gepo", 0.3)]}  # fmt: skip
    merged = X.write_results(path, new, merge=True)
    assert json.loads(path.read_text()) == merged
    got = [(c["scenario"], c["variant"], c["accuracy"][0], c["command"], c["commit"]) for c in merged["cells"]]
    assert got == [("clean", "plain", 0.5, "first", "aaa"), ("clean", "gepo", 0.65, "second", "bbb-dirty"),
                   ("nan", "gepo", 0.4, "first", "aaa"), ("inf", "gepo", 0.3, "second", "bbb-dirty")]  # fmt: skip
    assert merged["command"] == merged["commit"] == "per cell" and merged["steps"] == 20
    # merging again keeps each cell's own record, and refuses runs of another length
    again = X.merge_results(json.loads(path.read_text()), {**new, "command": "third", "cells": []})
    assert [c["command"] for c in again["cells"]] == ["first", "second", "first", "second"]
    with pytest.raises(SystemExit, match="the file's runs have 20 steps, this run 6"):
        X.merge_results(old, {**new, "steps": 6})
    mixed = X.merge_results(old, {**new, "steps": 6}, same=())  # bench_overhead: steps per cell
    assert [c["steps"] for c in mixed["cells"]] == [20, 6, 20, 6] and mixed["steps"] == "per cell"
    # without --merge the file is replaced
    assert X.write_results(path, new)["cells"] == new["cells"] and json.loads(path.read_text())["commit"] == "bbb-dirty"


def test_merge_keeps_each_files_settings_with_its_cells() -> None:
    # gold_false_alarms: replays at the rule before the noise model, then the simulator at today's rule
    base = {"date": "d", "machine": "m", "packages": {}, "steps": "per run", "every": 10}
    old = {**base, "command": "replay", "commit": "aaa", "gold_config": {"drop": 0.05}, "table": "old",
           "cells": [_cell("healthy", "all", None)]}  # fmt: skip
    new = {**base, "command": "sim", "commit": "bbb", "gold_config": {"drop": 0.05, "z": 4.0}, "table": "new",
           "cells": [_cell("plateau", "shipped", None)]}  # fmt: skip
    merged = X.merge_results(old, new)
    assert [c["gold_config"] for c in merged["cells"]] == [{"drop": 0.05}, {"drop": 0.05, "z": 4.0}]
    assert merged["gold_config"] == "per cell" and merged["every"] == 10 and merged["table"] == "new"
    # merged again, each cell keeps the settings it came with
    again = X.merge_results(merged, {**new, "cells": [_cell("plateau", "shipped", None)]})
    assert [c["gold_config"] for c in again["cells"]] == [{"drop": 0.05}, {"drop": 0.05, "z": 4.0}]


def test_add_seeds_joins_a_cell_seed_by_seed_and_each_run_keeps_its_commit() -> None:
    """--add-seeds: a second seed run at another commit joins its cell (per-seed lists in seed order, a metric one
    run lacks is None there), the cell lists both runs and says "per run" where they differ; a third run joins too;
    a seed already there, another model or another setting is refused; cells only in one file pass through."""
    base = {"date": "d", "machine": "m", "packages": {}, "steps": "config", "model": "smol"}

    def fault(seeds: list[int], accuracy: list[float], **metrics: list[Any]) -> dict[str, Any]:
        return {"scenario": "fault-nan_loss-3", "variant": "all", "seeds": seeds, "died": [False] * len(seeds),
                "accuracy": accuracy, "metrics": metrics}  # fmt: skip

    old = {**base, "command": "first", "commit": "aaa", "cells": [fault([0], [0.5], caught=[True], fed=[4])]}
    new = {**base, "command": "second", "commit": "bbb", "date": "e",
           "cells": [fault([1], [0.6], caught=[True], steps_to_action=[0]), _cell("clean", "plain", 0.7)]}  # fmt: skip
    merged = X.merge_results(old, new, add_seeds=True)
    cell, other = merged["cells"]
    assert cell["seeds"] == [0, 1] and cell["accuracy"] == [0.5, 0.6] and cell["died"] == [False, False]
    assert cell["metrics"] == {"caught": [True, True], "fed": [4, None], "steps_to_action": [None, 0]}
    assert [(r["seeds"], r["command"], r["commit"], r["date"]) for r in cell["runs"]] == [
        ([0], "first", "aaa", "d"), ([1], "second", "bbb", "e")]  # fmt: skip
    assert cell["commit"] == cell["command"] == cell["date"] == "per run" and cell["machine"] == "m"
    assert other["seeds"] == [0] and other["commit"] == "bbb" and "runs" not in other
    assert merged["commit"] == "per cell" and merged["machine"] == "m"
    third = X.merge_results(merged, {**new, "command": "third", "cells": [fault([2], [0.7], caught=[False])]},
                            add_seeds=True)  # fmt: skip
    assert third["cells"][0]["seeds"] == [0, 1, 2] and third["cells"][0]["metrics"]["caught"] == [True, True, False]
    assert [r["command"] for r in third["cells"][0]["runs"]] == ["first", "second", "third"]
    # without --add-seeds the cell is replaced, as before
    assert X.merge_results(old, new)["cells"][0]["seeds"] == [1]
    with pytest.raises(SystemExit, match=r"fault-nan_loss-3/all already holds seed\(s\) \[1\]"):
        X.merge_results(merged, new, add_seeds=True)
    with pytest.raises(SystemExit, match="holds runs of 'smol', this run is 'tiny'"):
        X.merge_results(old, {**new, "model": "tiny"}, add_seeds=True)
    with pytest.raises(SystemExit, match="has note=None, this run 'lr 1e-5'"):
        X.merge_results(old, {**new, "cells": [fault([1], [0.6]) | {"note": "lr 1e-5"}]}, add_seeds=True)


def test_commit_is_the_short_sha_with_dirty_when_the_tree_has_changes(tmp_path: Path, monkeypatch) -> None:
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f").write_text("1")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(X, "REPO", repo)
    assert X.commit() == sha
    (repo / "f").write_text("2")
    assert X.commit() == sha + "-dirty"


def test_the_generic_cli_writes_paired_cells(fake: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """``experiments.py CONFIG --variant ...``: the fake program stands in for ``python -m steadyrl train``; it gets
    ``CONFIG OVERRIDES... trainer.output_dir=... trainer.seed=...`` and writes an accuracy of seed / 10 (+ 0.05 for
    the variant that sets its flag)."""
    program = tmp_path / "cli_train.py"
    program.write_text(textwrap.dedent("""
        import json, os, sys
        args = dict(a.split("=", 1) for a in sys.argv[2:])
        out, seed = args["trainer.output_dir"], int(args["trainer.seed"])
        os.makedirs(out, exist_ok=True)
        open(os.path.join(out, "metrics.jsonl"), "w").write(json.dumps({"step": 3, "loss": 1.0}) + "\\n")
        acc = seed / 10 + (0.05 if args.get("flag") == "on" else 0.0) + (0.02 * seed if args.get("flag") else 0.0)
        json.dump({"accuracy": acc}, open(os.path.join(out, "eval_results.json"), "w"))
    """))  # fmt: skip
    monkeypatch.setattr(X, "train_command", lambda config, *o: [sys.executable, str(program), str(config), *o])
    monkeypatch.setattr(X, "commit", lambda: "abc1234")
    results = tmp_path / "cli.json"
    X.main(["task.yaml", "--variant", "plain=", "--variant", "flag=flag=on", "--seeds", "3", "--out",
            str(tmp_path / "runs"), "--results", str(results), "--baseline", "plain", "--", "x=1"])  # fmt: skip
    doc = json.loads(results.read_text())
    assert doc["commit"] == "abc1234" and [c["variant"] for c in doc["cells"]] == ["plain", "flag"]
    assert doc["cells"][1]["accuracy"] == pytest.approx([0.05, 0.17, 0.29])
    # flag - plain per seed: 0.05, 0.07, 0.09 -> mean 0.07, sample std 0.02, s.e. 0.02 / sqrt(3) = 0.0115
    assert "| flag − plain (paired) | | | +0.070 ± 0.012 (3) |" in capsys.readouterr().out


def test_a_results_command_names_the_kernel_path_it_ran_under(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run under ``ATEN_CPU_CAPABILITY`` (another host's torch kernels) records it in its command, quoted as typed."""
    monkeypatch.setattr(sys, "argv", ["scripts/parrot_noise.py", "--tag", "-default", "--results", "a b.json"])
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert X.script_command("parrot_noise.py") == "python scripts/parrot_noise.py --tag -default --results 'a b.json'"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert X.script_command("parrot_noise.py").startswith("ATEN_CPU_CAPABILITY=default python scripts/parrot_noise.py")
