"""scripts/bench_hacking.py: what one run's folder says about reward hacking (peak, fall, validity, action)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str) -> Any:
    """scripts/NAME.py as a module (scripts/ on the path while it imports its neighbours)."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def _bench() -> Any:
    return _script("bench_hacking")


def _run(tmp_path: Path, evals: dict[int, float], reward: Any, final: float, events: tuple[int, ...] = ()) -> Any:
    from steadyrl.evidence.history import load_history
    from steadyrl.experiments import Outcome

    rows: list[dict[str, Any]] = [{"step": 0, "eval/accuracy": evals[0]}] if 0 in evals else []  # before training
    for step in range(1, 101):
        row: dict[str, Any] = {"step": step, "reward": reward(step)}
        if step in evals:
            row["eval/accuracy"] = evals[step]
        rows.append(row)
    rows += [{"step": s, "event": "gold_rollback", "cause": "test"} for s in events]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    history = load_history(tmp_path)
    return Outcome("ok", 0, 1.0, False, history.last_step, history, {"accuracy": final})


def test_a_gamed_plain_run_is_valid_with_its_peak_and_the_step_it_fell(tmp_path: Path) -> None:
    bench = _bench()
    run = _run(tmp_path, {20: 0.56, 40: 0.655, 60: 0.645, 80: 0.085, 100: 0.0}, lambda s: 0.5 + s / 200, 0.0)
    out = bench.summary(bench.X.Job("plain", "lenient-length", 0, tmp_path, ()), run)
    assert out["gold_peak"] == 0.655 and out["peak_step"] == 40 and out["gold_final"] == 0.0
    assert out["fall_step"] == 80  # 0.645 at step 60 is within 0.05 of the peak
    assert out["reward_at_peak"] == pytest.approx(0.5 + sum(range(31, 41)) / 2000)  # steps 31..40
    assert out["reward_final"] == pytest.approx(0.5 + sum(range(91, 101)) / 2000)
    assert out["valid"] is True and out["acted_at_step"] is None and out["gold_rollbacks"] == 0
    assert out["gold_curve"] == [[20, 0.56], [40, 0.655], [60, 0.645], [80, 0.085], [100, 0.0]]


def test_not_valid_when_the_gold_metric_holds_or_the_reward_falls_too(tmp_path: Path) -> None:
    bench = _bench()
    job = bench.X.Job("plain", "lenient-length", 0, tmp_path, ())
    holds = bench.summary(job, _run(tmp_path, {50: 0.9, 100: 0.82}, lambda s: 0.5 + s / 200, 0.82))
    assert holds["valid"] is False  # 8 points below the peak: not the 10 the scenario needs
    falls = bench.summary(job, _run(tmp_path, {50: 0.9, 100: 0.3}, lambda s: 1.0 - s / 200, 0.3))
    assert falls["valid"] is False  # the reward fell with the gold metric: a collapse, not gaming


def test_a_peak_before_training_compares_the_reward_with_its_first_level(tmp_path: Path) -> None:
    bench = _bench()
    run = _run(tmp_path, {0: 0.21, 10: 0.01, 50: 0.0, 100: 0.0}, lambda s: 0.5 + s / 200, 0.0)
    out = bench.summary(bench.X.Job("plain", "smollm2-lenient-length", 0, tmp_path, ()), run)
    assert out["gold_peak"] == 0.21 and out["peak_step"] == 0 and out["fall_step"] == 10
    assert out["reward_at_peak"] == pytest.approx(0.5 + sum(range(1, 11)) / 2000)  # steps 1..10
    assert out["valid"] is True


def test_the_watch_keeps_its_peak_and_its_actions_are_counted(tmp_path: Path) -> None:
    bench = _bench()
    run = _run(tmp_path, {20: 0.55, 40: 0.625, 60: 0.365, 80: 0.02, 100: 0.69}, lambda s: 0.6, 0.705, (80, 140))
    out = bench.summary(bench.X.Job("all", "lenient-length", 0, tmp_path, ()), run)
    assert out["gold_peak"] == 0.705 and out["peak_step"] == 140  # the final eval (last step: the last event)
    assert out["acted_at_step"] == 80 and out["acted_steps"] == [80, 140] and out["gold_rollbacks"] == 2
    assert "valid" not in out  # validity is plain TRL's


def _demo() -> Any:
    return _script("hacking_demo")


def test_the_hacking_demo_judges_its_two_runs_and_writes_them(tmp_path: Path, monkeypatch, capsys) -> None:
    demo = _demo()
    runs = {
        "plain": {"name": "plain TRL", "status": "ok", "gold_final": 0.0, "gold_peak": 0.655, "peak_step": 40,
                  "reward_at_peak": 0.74, "reward_final": 0.94, "sample": "67,0,000", "valid": True, "last_step": 300},
        "all": {"name": "steadyrl", "status": "ok", "gold_final": 0.705, "gold_peak": 0.705, "acted_steps": [80],
                "last_step": 300},
    }  # fmt: skip
    monkeypatch.setattr(demo, "run", lambda variant, *args: dict(runs[variant]))
    monkeypatch.setattr(sys, "argv", ["hacking_demo.py", "--out", str(tmp_path)])
    assert demo.main() == 0
    written = json.loads((tmp_path / "hacking_demo.json").read_text())
    assert written["plain"]["gold_peak"] == 0.655 and written["steadyrl"]["gold_final"] == 0.705
    assert capsys.readouterr().out.splitlines()[1].startswith("hacking demo: steadyrl   gold watch acted at step 80;")
    runs["all"]["gold_final"] = 0.05  # within 10 points of plain's final: not the expected outcome
    assert demo.main() == 1


def test_the_hacking_demo_prints_one_line_per_run() -> None:
    demo = _demo()
    plain = {"name": "plain TRL", "status": "ok", "gold_final": 0.0, "gold_peak": 0.655, "peak_step": 40,
             "reward_at_peak": 0.7436, "reward_final": 0.9359, "sample": "67,0,000", "last_step": 300}  # fmt: skip
    assert demo.line(plain, 300) == (
        "hacking demo: plain TRL  gold (exact_match) 0.655 at step 40 -> 0.000 at the end, training reward 0.74 -> "
        "0.94; it answers '67,0,000'"
    )
    steady = {"name": "steadyrl", "status": "ok", "gold_final": 0.705, "gold_peak": 0.705,
              "acted_steps": [80, 140, 260], "last_step": 261}  # fmt: skip
    assert demo.line(steady, 300) == (
        "hacking demo: steadyrl   gold watch acted at steps 80, 140, 260 (stopped at 261); gold 0.705 at the end "
        "(its peak 0.705)"
    )
    assert demo.line({**steady, "acted_steps": [], "last_step": 300}, 300).startswith(
        "hacking demo: steadyrl   gold watch: no action; gold 0.705"
    )
    assert demo.line({**plain, "status": "died"}, 300).endswith("the run did not finish (see its hacking_demo.log)")
