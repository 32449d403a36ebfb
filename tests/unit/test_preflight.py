"""steadyrl preflight: calibration from a baseline's logs (hand-computed values), drill verdicts, the written config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from steadyrl.config import load_config
from steadyrl.evidence.history import History
from steadyrl.faults import FAULT_LOG
from steadyrl.preflight import Drill, Preflight, calibrate, judge

CONFIG = str(Path(__file__).resolve().parents[2] / "configs/tiny/grpo.yaml")


def _cfg(*overrides: str):
    return load_config(CONFIG, ["trainer.beta=0.04", *overrides])


def _rows(n: int = 20) -> list[dict]:
    rows = []
    for t in range(1, n + 1):
        rows.append(
            {
                "step": t,
                "kl": 0.001 * t,  # second half (steps 11..20): mean 0.0155
                "grad_norm": 0.0 if t == 5 else float(t),  # a zero-gradient step is left out of the percentile
                "entropy": 1.0 - 0.052 * (t - 1),  # first quarter mean 0.896, last quarter mean 0.116
                "completions/clipped_ratio": 0.5,
                "completions/mean_length": 30.0,
                "gepo/would_skipped_steps": float(t >= 15),
                "quatro/would_filtered/zero_variance": float(t % 2),  # per step: mean 0.5 over the baseline
            }
        )
    return rows


def test_calibration_by_hand():
    notes: list[str] = []
    on = _cfg("guards.gepo.enabled=true", "guards.quatro.enabled=true", "guards.quatro.kl.enabled=true")
    measured, proposed = calibrate(History(_rows()), on, notes)
    assert proposed["guards.quatro.kl.target"] == pytest.approx(0.155)  # 10 x 0.0155, three digits
    # the guard's baseline is the median of the norms before: 6 / median(1, 2, 3, 4) = 6 / sqrt(6) is the largest
    assert measured["largest grad norm / spike baseline (calm run)"] == 2.45
    assert "guards.gepo.spike.min_ratio" not in proposed  # 3 x 2.45 is far under the default 100
    # entropy: last / first quarter = 0.116 / 0.896 = 0.129 < 0.15 -> floor_ratio 0.9 x 0.129 = 0.12
    assert proposed["guards.quatro.entropy.floor_ratio"] == 0.12
    assert measured["quatro/would_filtered/zero_variance (mean per step)"] == 0.5
    assert measured["share of completions cut at max_completion_length"] == 0.5
    assert measured["gepo/would_skipped_steps (run total)"] == 1.0
    assert any("50% of completions hit trainer.max_completion_length" in n for n in notes)
    assert any("the entropy floor would switch on at once" in n for n in notes)


def test_no_value_is_proposed_for_a_guard_the_config_leaves_off():
    notes: list[str] = []
    _, proposed = calibrate(History(_rows()), _cfg("guards.gepo.enabled=true"), notes)  # QUATRO off
    assert list(proposed) == []
    assert any("guards.quatro.kl.target measured at 0.155 but not proposed" in n for n in notes)


def test_a_calm_run_near_the_spike_floor_gets_a_higher_min_ratio():
    rows = [{"step": t, "grad_norm": 60.0 if t == 12 else 1.0} for t in range(1, 21)]
    notes: list[str] = []
    measured, proposed = calibrate(History(rows), _cfg("guards.gepo.enabled=true"), notes)
    assert measured["largest grad norm / spike baseline (calm run)"] == 60.0
    assert proposed == {"guards.gepo.spike.min_ratio": 180.0}  # 3x margin over what the calm run reached
    assert any("leaves less than 3x margin" in n for n in notes)


def test_no_kl_target_without_a_kl_term_and_no_floor_change_when_entropy_holds():
    rows = [{**r, "entropy": 1.0} for r in _rows()]
    _, proposed = calibrate(History(rows), load_config(CONFIG, ["trainer.beta=0.0"]), [])
    assert "guards.quatro.kl.target" not in proposed and "guards.quatro.entropy.floor_ratio" not in proposed


def _run_dir(tmp_path: Path, faults: list[dict], rows: list[dict]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / FAULT_LOG).write_text("".join(json.dumps(f) + "\n" for f in faults))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_drill_verdicts(tmp_path):
    fired = [{"fault": "nan_loss", "step": 3}, {"fault": "train_end", "step": 6, "nonfinite_state_entries": 0}]
    nan = Drill("nan_loss", "NanLossAtStep", {}, (), "gepo or opefo")
    judge(nan, 0, _run_dir(tmp_path / "a", fired, [{"step": 6, "gepo/skipped_steps": 1.0}]), _cfg())
    assert nan.held and "1 step(s) skipped" in nan.detail
    trained_on = Drill("nan_loss", "NanLossAtStep", {}, (), "gepo or opefo")  # finished, but nothing caught it
    judge(trained_on, 0, _run_dir(tmp_path / "b", fired, [{"step": 6, "gepo/skipped_steps": 0.0}]), _cfg())
    assert not trained_on.held and trained_on.change.endswith("set guards.gepo.enabled=true")
    died = Drill("nan_loss", "NanLossAtStep", {}, (), "gepo or opefo")
    judge(died, 1, _run_dir(tmp_path / "c", fired[:1], [{"step": 3, "loss": 1.0}]), _cfg())
    assert not died.held and "the run died (exit 1, last step 3)" in died.detail
    kept_inf = [{"fault": "inf_exp_avg_sq", "step": 3}, {"fault": "train_end", "step": 6, "nonfinite_state_entries": 1}]
    inf = Drill("inf_exp_avg_sq", "InfExpAvgSqAtStep", {}, (), "opefo")
    judge(inf, 0, _run_dir(tmp_path / "d", kept_inf, [{"step": 6, "opefo/rollbacks": 0.0}]), _cfg())
    assert not inf.held and "1 non-finite optimizer-state entries" in inf.detail
    assert inf.change.endswith("set guards.opefo.enabled=true")
    never = Drill("nan_loss", "NanLossAtStep", {}, (), "gepo or opefo")
    judge(never, 0, _run_dir(tmp_path / "e", [], [{"step": 6}]), _cfg())
    assert not never.held and "the fault did not fire" in never.detail


def test_the_written_config_extends_the_users_and_validates(tmp_path):
    pre = Preflight(CONFIG, ["trainer.beta=0.04", "guards.gepo.enabled=true"], tmp_path)
    path = pre._write_config(
        {"guards.quatro.kl.enabled": True, "guards.quatro.kl.target": 0.155, "guards.gepo.spike.min_ratio": 420.0}
    )
    tree = yaml.safe_load(path.read_text())
    assert tree["extends"] == str(Path(CONFIG).resolve())
    assert tree["trainer"]["beta"] == 0.04 and tree["guards"]["gepo"]["enabled"] is True
    cfg = load_config(str(path), [])
    assert cfg.guards.quatro.kl.target == 0.155 and cfg.guards.gepo.spike.min_ratio == 420.0
    with pytest.raises(Exception, match="target"):  # an invalid value never lands in preflight.yaml
        pre._write_config({"guards.quatro.kl.target": -1.0})
    assert load_config(str(path), []).guards.quatro.kl.target == 0.155
