"""The interventions ledger: every action of a guard layer that changes training, counted per optimizer step.

``Ledger.see`` reads the metrics the stations log during a step; ``Ledger.close`` ends the step: each kind in
``KINDS`` whose rule held counts one step, and ``steadyrl/interventions/<kind>`` is logged as 1 or 0 (so a logged row
holds the share of the steps since the previous row). A layer in observe mode is read under its ``would`` names and
counted under ``steadyrl/would_interventions/<kind>``. Rows the filters drop outside zero-variance groups are also
counted against all rows. The counts live in the step gate's counters (saved in every checkpoint, never rolled
back); ``summary`` turns them, or a finished run's metrics.jsonl (``from_history``), into the per-run table that
``steadyrl doctor``, ``steadyrl report`` and ``OUTPUT_DIR/interventions.json`` show.
"""

from __future__ import annotations

import json
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from steadyrl import metrics as M
from steadyrl.storage import write_report

BETA_TOLERANCE = 0.2  # beta more than this far from trainer.beta (relative) is an intervention
SUMMARY_FILE = "interventions.json"
_ROW_REASONS = ("zscore", "length", "parrot", "repetition")  # filter reasons that are interventions (not zero_variance)


@dataclass(frozen=True)
class Rule:
    """``rose``: a cumulative counter grew this step; ``above`` / ``below``: a value logged this step passed ``bound``;
    ``off``: a value is more than ``bound`` (relative) away from trainer.beta."""

    test: str
    names: tuple[str, ...]
    bound: float = 0.0


@dataclass(frozen=True)
class Kind:
    layer: str
    act: Rule
    would: Rule | None = None  # the rule in observe mode (None: act's names, which observe mode logs as well)


def _filtered(prefix: str) -> tuple[str, ...]:
    return tuple(prefix + reason for reason in _ROW_REASONS)


KINDS: dict[str, Kind] = {
    "skipped_step": Kind("gepo", Rule("rose", (M.GEPO_SKIPPED_STEPS,)), Rule("rose", (M.GEPO_WOULD_SKIP,))),
    "dropped_micro_batch": Kind(
        "gepo", Rule("rose", (M.GEPO_DROPPED_MICRO_BATCHES,)), Rule("rose", (M.GEPO_WOULD_DROP_MICRO_BATCHES,))
    ),
    "nonfinite_masked": Kind(  # non-finite rewards, log-probs, ratios or losses replaced (finite checks act always)
        "gepo",
        Rule(
            "above",
            (M.GEPO_NONFINITE_REWARDS, M.GEPO_NONFINITE_LOGPROBS, M.GEPO_NONFINITE_RATIOS, M.GEPO_NONFINITE_LOSS),
        ),
    ),
    "robust_advantage": Kind(
        "gepo", Rule("above", (M.GEPO_ROBUST_GROUPS,)), Rule("above", (M.GEPO_WOULD_ROBUST_GROUPS,))
    ),
    "rollback": Kind("opefo", Rule("rose", (M.OPEFO_ROLLBACKS,)), Rule("rose", (M.OPEFO_WOULD_ROLLBACK,))),
    "state_repair": Kind("opefo", Rule("rose", (M.OPEFO_REPAIRS,)), Rule("rose", (M.OPEFO_WOULD_REPAIR,))),
    "lr_cut": Kind("opefo", Rule("above", (M.OPEFO_RECOVERY_ACTIVE,))),
    "floor_raise": Kind(
        "opefo", Rule("above", (M.OPEFO_FLOOR_TRIGGERED,)), Rule("rose", (M.OPEFO_WOULD_FLOOR_ENTRIES,))
    ),
    "error_feedback": Kind("opefo", Rule("above", (M.OPEFO_EF_WEIGHT,)), Rule("rose", (M.OPEFO_WOULD_FEED_BACK,))),
    "beta_moved": Kind(
        "quatro",
        Rule("off", (M.QUATRO_BETA, M.GRADE_BETA), BETA_TOLERANCE),
        Rule("off", (M.QUATRO_KL_COEF_WOULD,), BETA_TOLERANCE),
    ),
    "brake": Kind(
        "quatro",
        Rule("below", (M.QUATRO_PG_SCALE, M.QUATRO_MOMENT_SCALE), 1.0),
        Rule("below", (M.QUATRO_PG_SCALE_WOULD, M.QUATRO_MOMENT_SCALE_WOULD), 1.0),
    ),
    "entropy_bonus": Kind(
        "quatro", Rule("above", (M.QUATRO_ENTROPY_BONUS,)), Rule("above", (M.QUATRO_ENTROPY_BONUS_WOULD,))
    ),
    "clip_narrowed": Kind(
        "quatro", Rule("above", (M.QUATRO_FLOOR_ACTIVE,)), Rule("above", (M.QUATRO_FLOOR_ACTIVE_WOULD,))
    ),
    "filtered_rows": Kind(
        "quatro",
        Rule("above", _filtered(M.QUATRO_FILTERED_PREFIX)),
        Rule("above", _filtered(M.QUATRO_WOULD_FILTER_PREFIX)),
    ),
    "replay": Kind("quatro", Rule("above", (M.QUATRO_REPLAY_FRAC,))),
    "gold_rollback": Kind(
        "quatro", Rule("rose", (M.QUATRO_GOLD_ROLLBACKS,)), Rule("rose", (M.QUATRO_WOULD_GOLD_ROLLBACKS,))
    ),
    "gold_tightened": Kind("quatro", Rule("below", (M.QUATRO_GOLD_LR_FACTOR,), 1.0)),  # every step after one
    "reward_clip": Kind("grade", Rule("above", (M.GRADE_CLIP_FRAC_LOW, M.GRADE_CLIP_FRAC_HIGH))),
}
LAYERS = ("gepo", "opefo", "quatro", "grade")
_ROWS, _DROPPED, _STEPS = "ledger_rows/seen", "ledger_rows/dropped", "ledger/steps"


def _count_key(kind: str, observing: bool) -> str:
    return f"ledger/{'would_' if observing else ''}{kind}"


class Ledger:
    """Per-step intervention flags for one trainer. ``counters``: where the run's counts live (the step gate's,
    checkpointed); ``beta0``: trainer.beta; ``observe``: the layers in observe mode."""

    def __init__(self, counters: MutableMapping[str, float], beta0: float, observe: frozenset[str] = frozenset()):
        self.counters, self.beta0, self.observe = counters, float(beta0), observe
        self.ended_on: dict[str, Any] | None = None  # set at train end by a guard that restored a kept policy
        self._step: dict[str, list[float]] = {}

    def see(self, name: str, value: float) -> None:
        """A metric a station logged during the current step."""
        self._step.setdefault(name, []).append(float(value))

    def close(self) -> dict[str, float]:
        """End the step: count every kind that acted; returns the per-step metrics to log (one 0/1 per kind of an
        enabled layer, i.e. one whose metrics were seen this run)."""
        seen, self._step = self._step, {}
        c = self.counters
        c[_STEPS] = c.get(_STEPS, 0.0) + 1
        out: dict[str, float] = {}
        for kind, spec in KINDS.items():
            observing = spec.layer in self.observe
            rule = spec.would if observing and spec.would is not None else spec.act
            present = [n for n in rule.names if n in seen]
            prev_keys = {n: f"ledger_last/{n}" for n in present} if rule.test == "rose" else {}
            if not present and _count_key(kind, observing) not in c:
                continue  # this layer or mechanism is off (or has logged nothing yet)
            fired = any(self._fired(rule, seen[n], c.get(prev_keys.get(n, ""), 0.0)) for n in present)
            for n, key in prev_keys.items():
                c[key] = seen[n][-1]
            key = _count_key(kind, observing)
            c[key] = c.get(key, 0.0) + float(fired)
            out[(M.ledger_would if observing else M.ledger)(kind)] = float(fired)
        names = (*_filtered(M.QUATRO_FILTERED_PREFIX), *_filtered(M.QUATRO_WOULD_FILTER_PREFIX))
        dropped = sum(v for n in names for v in seen.get(n, []) if math.isfinite(v))
        rows = sum(v for v in seen.get(M.QUATRO_ROWS, []) if math.isfinite(v))
        if rows:
            c[_ROWS], c[_DROPPED] = c.get(_ROWS, 0.0) + rows, c.get(_DROPPED, 0.0) + dropped
        return out

    def _fired(self, rule: Rule, values: list[float], last: float) -> bool:
        finite = [v for v in values if math.isfinite(v)]
        if not finite:
            return False
        if rule.test == "rose":  # ``last``: the counter at the previous step's end (checkpointed; 0 at the start)
            return finite[-1] > last
        if rule.test == "above":
            return max(finite) > rule.bound
        if rule.test == "below":
            return min(finite) < rule.bound
        if self.beta0 <= 0:
            return False
        return any(abs(v / self.beta0 - 1.0) > rule.bound + 1e-9 for v in finite)

    def summary(self) -> dict[str, Any]:
        """This run's counts as ``summary_from_counts`` shapes them, plus ``ended_on`` when a guard chose the policy
        the run ends on (the gold watch: its best)."""
        doc = summary_from_counts(dict(self.counters))
        if self.ended_on is not None:
            doc["ended_on"] = dict(self.ended_on)
        return doc

    def write(self, out: Path) -> bool:
        """``OUTPUT_DIR/interventions.json`` (the run's summary), whole or not at all (``storage.write_report``)."""
        return write_report(out / SUMMARY_FILE, json.dumps(self.summary(), indent=1, sort_keys=True) + "\n")


def summary_from_counts(counters: dict[str, float]) -> dict[str, Any]:
    """``{"steps", "kinds": {kind: {"layer", "steps", "share"}}, "would": {...}, "layers": {layer: largest share of
    one kind}, "filtered_rows": {"rows", "dropped", "share"}, "intervention_share_max"}`` (shares of steps)."""
    steps = int(counters.get(_STEPS, 0))
    doc: dict[str, Any] = {"steps": steps, "kinds": {}, "would": {}, "layers": {}}
    for kind, spec in KINDS.items():
        for observing, table in ((False, doc["kinds"]), (True, doc["would"])):
            key = _count_key(kind, observing)
            if key in counters:
                n = int(counters[key])
                table[kind] = {"layer": spec.layer, "steps": n, "share": n / steps if steps else 0.0}
    for row in doc["kinds"].values():
        doc["layers"][row["layer"]] = max(doc["layers"].get(row["layer"], 0.0), row["share"])
    rows = counters.get(_ROWS, 0.0)
    dropped = counters.get(_DROPPED, 0.0)
    doc["filtered_rows"] = {"rows": int(rows), "dropped": int(dropped), "share": dropped / rows if rows else 0.0}
    doc["intervention_share_max"] = max((r["share"] for r in doc["kinds"].values()), default=0.0)
    return doc


def from_history(history: Any) -> dict[str, Any]:
    """The same summary rebuilt from a run's logged rows: each row's 0/1 share x the steps since the row before it
    (``OUTPUT_DIR/interventions.json`` is exact; this is for runs without it, e.g. one that died)."""
    counters: dict[str, float] = {}
    last_step = 0
    steps_seen = 0
    for row in history.rows:
        step = int(row["step"])
        names = [k for k in row if k.startswith((M.LEDGER_PREFIX, M.LEDGER_WOULD_PREFIX))]
        if not names:
            continue
        window = max(step - last_step, 1)
        last_step = step
        steps_seen += window
        for name in names:
            value = row[name]
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue
            observing = name.startswith(M.LEDGER_WOULD_PREFIX)
            kind = name.removeprefix(M.LEDGER_WOULD_PREFIX if observing else M.LEDGER_PREFIX)
            key = _count_key(kind, observing)
            counters[key] = counters.get(key, 0.0) + round(value * window)
        rows = row.get(M.QUATRO_ROWS)
        if isinstance(rows, int | float) and math.isfinite(rows):
            dropped = sum(row.get(n, 0.0) for n in _filtered(M.QUATRO_FILTERED_PREFIX))
            counters[_ROWS] = counters.get(_ROWS, 0.0) + rows * window
            counters[_DROPPED] = counters.get(_DROPPED, 0.0) + dropped * window
    counters[_STEPS] = float(steps_seen)
    return summary_from_counts(counters)


def load_summary(run_dir: str | Path, history: Any = None) -> dict[str, Any] | None:
    """``RUN_DIR/interventions.json`` when the run wrote it, else rebuilt from ``history``; None without either."""
    path = Path(run_dir) / SUMMARY_FILE
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    if history is None:
        return None
    doc = from_history(history)
    return doc if doc["steps"] else None


def format_table(doc: dict[str, Any]) -> str:
    """Plain-text table: one line per kind that acted (or would have), with its share of steps."""
    lines = [f"interventions over {doc['steps']} steps (share of steps; 'would' = observe mode):"]
    acted = False
    for table, label in ((doc["kinds"], ""), (doc["would"], " (would)")):
        for kind, row in sorted(table.items(), key=lambda kv: (LAYERS.index(kv[1]["layer"]), kv[0])):
            if row["steps"]:
                acted = True
                lines.append(
                    f"  {row['layer']:<6} {kind + label:<28} {row['steps']:>6} steps  {100 * row['share']:6.2f} %"
                )
    rows = doc.get("filtered_rows", {})
    if rows.get("dropped"):
        acted = True
        lines.append(f"  quatro rows filtered outside zero-variance groups: {rows['dropped']} of {rows['rows']} "
                     f"({100 * rows['share']:.2f} %)")  # fmt: skip
    if not acted:
        lines.append("  none: no layer changed this run")
    return "\n".join(lines)
