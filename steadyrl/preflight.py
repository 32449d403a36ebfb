"""``steadyrl preflight CONFIG [overrides]``: calibrate the guard layers on the user's own model before a real run.

A baseline of ``--steps`` with every layer in ``mode: observe``; ``calibrate`` proposes values from its logs; then
``--drill-steps`` of the calibrated config per fault drill (layers acting, a ``steadyrl.faults`` fault at step 3).

Writes ``OUT/preflight.yaml`` (``extends:`` the user's config; validated first), ``OUT/report.md``, ``OUT/report.json``
and the runs under ``OUT/runs``. Exit 0 when every drill held, 1 when one did not, 2 when the baseline failed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from steadyrl import metrics as M
from steadyrl.config import load_config
from steadyrl.evidence.history import History, HistoryNotFoundError, load_history
from steadyrl.experiments import Outcome, launch, train_command
from steadyrl.faults import FAULT_STEP_ENV, FAULT_VALUE_ENV, read_fault_log
from steadyrl.guards.kl_controller import TARGET_MIN, KLConfig
from steadyrl.guards.spike import ZERO_NORM, SpikeConfig, SpikeGuard

LAYERS = ("gepo", "opefo", "quatro", "grade")
DRILL_STEP = 3
SHORT_RUN = ("trainer.logging_steps=1", 'trainer.save_strategy="no"', "trainer.resume_from_checkpoint=null",  # all runs
             "trainer.report_to=[]", "eval.enabled=false")  # fmt: skip
SPIKE_MARGIN = 3.0  # the spike guard's min_ratio should sit this far above a calm run's largest norm / baseline
CUMULATIVE_WOULD = (M.GEPO_WOULD_SKIP_PREFIX, M.GEPO_WOULD_STOP, M.GEPO_WOULD_DROP_MICRO_BATCHES,  # running totals
                    M.OPEFO_WOULD_ROLLBACK, M.OPEFO_WOULD_REPAIR, M.OPEFO_WOULD_FLOOR_ENTRIES,
                    M.OPEFO_WOULD_FEED_BACK)  # fmt: skip
SETTINGS_WOULD = (M.QUATRO_KL_COEF_WOULD, M.QUATRO_ENTROPY_BONUS_WOULD, M.QUATRO_CLIP_SCALE_WOULD,  # last value
                  M.QUATRO_FLOOR_ACTIVE_WOULD, M.QUATRO_PG_SCALE_WOULD, M.QUATRO_MOMENT_SCALE_WOULD,
                  M.GRADE_KL_FACTOR_WOULD)  # fmt: skip
ENTROPY_MARGIN = 0.9  # proposed floor_ratio = this x (late / early baseline entropy), when below the default


@dataclass
class Drill:
    name: str
    callback: str
    env: dict[str, str]
    overrides: tuple[str, ...]
    needs: str  # the layer that has to hold it
    held: bool | None = None
    detail: str = ""
    change: str = ""


@dataclass
class Preflight:
    config: str
    overrides: list[str]
    out: Path
    steps: int = 20
    drill_steps: int = 6
    timeout_s: float = 3600.0
    log: Any = field(default=print)

    def _train(self, name: str, extra: list[str], env: dict[str, str] | None = None) -> tuple[Outcome, Path]:
        run_dir = self.out / "runs" / name
        cmd = train_command(self.config, *self.overrides, *SHORT_RUN, f"trainer.output_dir={run_dir}", *extra)
        return launch(cmd, run_dir, env={**os.environ, **(env or {})}, timeout=self.timeout_s, cwd=None), run_dir

    def run(self) -> int:
        cfg = load_config(self.config, self.overrides)  # a config error stops here, before any run
        self.out.mkdir(parents=True, exist_ok=True)
        from steadyrl.storage import describe

        self.log(f"[preflight] storage plan (one process; a launch on N adds the per-rank parts): {describe(cfg)}")
        observe = [f"guards.{layer}.{key}" for layer in LAYERS for key in ("enabled=true", "mode=observe")]
        notes: list[str] = []
        if float(cfg.trainer.get("beta", 0.0)) <= 0:
            observe.append("guards.quatro.kl.enabled=false")
            notes.append("trainer.beta is 0: no KL term, so no KL to calibrate (the adaptive KL needs beta > 0)")
        self.log(f"[preflight] baseline: {self.steps} steps, every layer observing ...")
        base, base_dir = self._train("baseline", [*observe, f"trainer.max_steps={self.steps}"])
        if (rc := base.returncode) != 0:
            self.log(f"[preflight] the baseline run failed (exit {rc}); its log: {base_dir / 'log.txt'}")
            self._write_report({"baseline": {"returncode": rc, "log": str(base_dir / "log.txt")}}, {}, [], notes)
            return 2
        measured, proposed = calibrate(load_history(base_dir), cfg, notes)
        self.log(f"[preflight] baseline done in {base.wall_s:.0f} s; proposed: {json.dumps(proposed)}")
        calibrated = self._write_config(proposed)
        opefo_fast = ("guards.opefo.rollback.check_interval=1", "guards.opefo.rollback.snapshot_interval=2")
        drills = [
            Drill("nan_loss", "NanLossAtStep", {}, (), "gepo or opefo"),
            Drill("inf_exp_avg_sq", "InfExpAvgSqAtStep", {FAULT_VALUE_ENV: "inf"},
                  opefo_fast if cfg.guards.opefo.enabled else (), "opefo"),
        ]  # fmt: skip
        for drill in drills:
            self.log(f"[preflight] drill {drill.name}: {self.drill_steps} steps, fault at step {DRILL_STEP} ...")
            extra = [*(f"{k}={json.dumps(v)}" for k, v in proposed.items()), *drill.overrides,
                     f"trainer.max_steps={self.drill_steps}",
                     f"callbacks=['steadyrl.faults:{drill.callback}']"]  # fmt: skip
            env = {FAULT_STEP_ENV: str(DRILL_STEP), **drill.env}
            run, run_dir = self._train(f"drill-{drill.name}", extra, env)
            judge(drill, run.returncode, run_dir, cfg)
            self.log(f"[preflight] drill {drill.name}: {'held' if drill.held else 'NOT held'} ({drill.detail})")
        measured = {"baseline": {"returncode": 0, "wall_s": base.wall_s}, **measured}
        report = self._write_report(measured, proposed, drills, notes)
        self.log(report)
        self.log(f"[preflight] calibrated config: {calibrated}")
        return 0 if all(d.held for d in drills) else 1

    def _write_config(self, proposed: dict[str, Any]) -> Path:
        tree: dict[str, Any] = {"extends": str(Path(self.config).resolve())}
        for item in self.overrides:
            key, _, value = item.partition("=")
            _set(tree, key, yaml.safe_load(value))
        for key, value in proposed.items():
            _set(tree, key, value)
        path = self.out / "preflight.yaml"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(f"# written by `steadyrl preflight` on {time.strftime('%Y-%m-%d')}: the config below, the "
                       "command-line\n# overrides and the values calibrated on this model's baseline (see report.md "
                       "next to this file)\n" + yaml.safe_dump(tree, sort_keys=False))  # fmt: skip
        load_config(str(tmp), [])  # it must validate before it replaces anything
        tmp.replace(path)
        return path

    def _write_report(self, measured: dict[str, Any], proposed: dict[str, Any], drills: list[Drill],
                      notes: list[str]) -> str:  # fmt: skip
        lines = [f"# steadyrl preflight: {self.config}", ""]
        if self.overrides:
            lines += [f"overrides: `{' '.join(self.overrides)}`", ""]
        lines += [f"baseline: {self.steps} steps with every layer in observe mode (training is plain TRL's)", "",
                  "| measured on the baseline | value |", "|---|---|",
                  *(f"| {k} | {_fmt(v)} |" for k, v in measured.items() if k != "baseline"),
                  "", "| calibrated key | value |", "|---|---|"]  # fmt: skip
        lines += [f"| `{k}` | {_fmt(v)} |" for k, v in proposed.items()] or ["| (none) | |"]
        if drills:
            head = f"| drill (fault at step {DRILL_STEP}, layers acting) | held | what happened |"
            lines += ["", head, "|---|---|---|"]
            lines += [f"| {d.name} | {'yes' if d.held else 'NO'} | {d.detail} |" for d in drills]
            if changes := [f"- {d.name}: {d.change}" for d in drills if not d.held and d.change]:
                lines += ["", "what to change:", *changes]
        if notes:
            lines += ["", "notes:", *(f"- {n}" for n in notes)]
        text = "\n".join(lines) + "\n"
        (self.out / "report.md").write_text(text)
        doc = {"config": self.config, "overrides": self.overrides, "measured": measured, "proposed": proposed,
               "drills": [{"name": d.name, "held": d.held, "detail": d.detail, "change": d.change} for d in drills],
               "notes": notes}  # fmt: skip
        (self.out / "report.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        return text


def calm_spike_margin(norms: list[float], config: SpikeConfig) -> tuple[float, float]:
    """(largest norm / the spike guard's baseline, largest robust z of log norm) as the guard would have seen a calm
    run's ``norms`` with a ratio floor too high to skip any: how close the run came to the spike test."""
    probe = SpikeGuard(dataclasses.replace(config, min_ratio=1e30, max_ratio=math.inf))
    ratio, z = 0.0, -math.inf
    for step, norm in enumerate(norms):
        if probe.baseline is not None:
            ratio = max(ratio, norm / probe.baseline)
        probe.decide(torch.tensor(norm), step)
        if math.isfinite(probe.last_z):
            z = max(z, probe.last_z)
    return ratio, z


def calibrate(history: History, cfg: Any, notes: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(measured values, proposed ``dotted.key: value``) from a baseline run's history."""
    measured: dict[str, Any] = {"steps logged": history.last_step}
    proposed: dict[str, Any] = {}
    kl = history.finite(M.KL)[1]
    if len(kl) >= 2 and float(cfg.trainer.get("beta", 0.0)) > 0:
        tail = kl[len(kl) // 2 :]
        measured["per-token KL (first / last logged)"] = f"{kl[0]:.3g} / {kl[-1]:.3g}"
        measured["per-token KL, second-half mean"] = float(tail.mean())
        target = max(KLConfig().target_ratio * float(tail.mean()), TARGET_MIN)
        proposed["guards.quatro.kl.target"] = float(f"{target:.3g}")
    norms = history.finite(M.GRAD_NORM)[1]
    norms = norms[norms > ZERO_NORM]
    if len(norms) >= 3:
        ratio, z = calm_spike_margin(norms.tolist(), cfg.guards.gepo.spike.to_config())
        measured["grad norm (median / max)"] = f"{np.median(norms):.3g} / {norms.max():.3g}"
        measured["largest grad norm / spike baseline (calm run)"] = float(f"{ratio:.3g}")
        measured["largest robust z of log grad norm (calm run)"] = float(f"{z:.3g}") if math.isfinite(z) else None
        if SPIKE_MARGIN * ratio > cfg.guards.gepo.spike.min_ratio:
            proposed["guards.gepo.spike.min_ratio"] = float(f"{SPIKE_MARGIN * ratio:.3g}")
            notes.append(f"a calm step reached {ratio:.3g} x the spike guard's baseline: min_ratio "
                         f"{cfg.guards.gepo.spike.min_ratio:g} leaves less than {SPIKE_MARGIN:g}x margin")  # fmt: skip
    else:
        notes.append(f"only {len(norms)} baseline step(s) had a non-zero gradient (groups without reward variance "
                     "carry no signal): the spike margin was not measured; run a longer baseline (--steps) or "
                     "check the reward")  # fmt: skip
    entropy = history.finite(M.ENTROPY)[1]
    if len(entropy) >= 4:
        w = max(1, len(entropy) // 4)
        early, late = float(entropy[:w].mean()), float(entropy[-w:].mean())
        measured["token entropy (first / last quarter)"] = f"{early:.3g} / {late:.3g}"
        default = cfg.guards.quatro.entropy.floor_ratio
        if early > 0 and late / early < default:
            proposed["guards.quatro.entropy.floor_ratio"] = float(f"{max(0.1, ENTROPY_MARGIN * late / early):.2g}")
            notes.append(f"entropy fell to {late / early:.0%} of its start within the baseline: at floor_ratio "
                         f"{default} the entropy floor would switch on at once; the proposed ratio leaves it for a "
                         "collapse beyond this")  # fmt: skip
    clipped = history.finite(M.COMPLETIONS_CLIPPED_RATIO)[1]
    lengths = history.finite(M.COMPLETIONS_MEAN_LENGTH)[1]
    if len(lengths):
        measured["completion length (mean of step means)"] = float(lengths.mean())
    if len(clipped):
        measured["share of completions cut at max_completion_length"] = float(clipped.mean())
        if clipped.mean() > 0.3:
            notes.append(f"{clipped.mean():.0%} of completions hit trainer.max_completion_length="
                         f"{cfg.trainer.get('max_completion_length')}: raise it, or reward shorter answers; cut "
                         "completions carry no final answer for a verifier to score")  # fmt: skip
    for name in sorted(m for m in history.metrics if "/would_" in m):  # what the observing layers would have done
        values = history.finite(name)[1]
        if not len(values):
            continue
        if name.startswith(CUMULATIVE_WOULD):
            measured[f"{name} (run total)"] = float(values[-1])
        elif name in SETTINGS_WOULD:
            measured[f"{name} (last step)"] = float(values[-1])
        else:
            measured[f"{name} (mean per step)"] = float(values.mean())
    g = cfg.guards
    off = {  # a value for a guard the config leaves off would be an ignored key (a config error): not proposed
        "guards.quatro.kl.target": not (g.quatro.enabled and g.quatro.kl.enabled),
        "guards.gepo.spike.min_ratio": not g.gepo.enabled,
        "guards.quatro.entropy.floor_ratio": not (g.quatro.enabled and g.quatro.entropy.enabled),
    }
    for key in [k for k in proposed if off.get(k)]:
        notes.append(f"{key} measured at {proposed.pop(key)} but not proposed: that guard is off in this config")
    return measured, proposed


def judge(drill: Drill, rc: int, run_dir: Path, cfg: Any) -> None:
    """Fill ``drill.held`` / ``detail`` / ``change`` from the drill run's exit code, fault log and metrics."""
    faults = read_fault_log(run_dir)
    fired = any(row["fault"] != "train_end" for row in faults)
    end = [row for row in faults if row["fault"] == "train_end"]
    try:
        history: History | None = load_history(run_dir)
    except HistoryNotFoundError:
        history = None

    def last(name: str) -> float:
        values = history.finite(name)[1] if history is not None else np.array([])
        return float(values[-1]) if len(values) else 0.0

    skipped, rollbacks, repairs = last(M.GEPO_SKIPPED_STEPS), last(M.OPEFO_ROLLBACKS), last(M.OPEFO_REPAIRS)
    left = end[-1].get("nonfinite_state_entries") if end else None
    if not fired:
        drill.held, drill.detail = False, f"the fault did not fire (exit {rc}); see {run_dir / 'log.txt'}"
        return
    if rc != 0:
        drill.held, drill.detail = False, f"the run died (exit {rc}, last step {history.last_step if history else 0})"
    elif drill.name == "inf_exp_avg_sq":
        drill.held = rollbacks + repairs >= 1 and not left  # repaired in place or rolled back, none left
        drill.detail = (f"{repairs:.0f} in-place repair(s), {rollbacks:.0f} rollback(s), {left or 0} non-finite "
                        "optimizer-state entries at the end")  # fmt: skip
    else:  # finished: the NaN micro-batch must have been caught (a skip or a rollback), not trained on
        drill.held = skipped >= 1 or rollbacks >= 1
        drill.detail = f"finished; {skipped:.0f} step(s) skipped, {rollbacks:.0f} rollback(s)"
    if not drill.held:
        on = ", ".join(layer for layer in LAYERS if getattr(cfg.guards, layer).enabled) or "none"
        layer = "opefo" if drill.name == "inf_exp_avg_sq" else "gepo"
        drill.change = f"needs {drill.needs} (on in this config: {on}): set guards.{layer}.enabled=true"


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    functools.reduce(lambda node, key: node.setdefault(key, {}), parents, tree)[leaf] = value


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else str(value)


def main(config: str, overrides: list[str], out: str, steps: int, drill_steps: int) -> int:
    return Preflight(config, overrides, Path(out), steps=steps, drill_steps=drill_steps).run()
