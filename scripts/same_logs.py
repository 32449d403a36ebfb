"""Are two sets of runs the same run? Compares every logged value of matching run folders, timing aside.

For a refactor that must not change behaviour: train the same configs and seeds on the same machine before and
after, then

    python scripts/same_logs.py BEFORE_ROOT AFTER_ROOT [--renamed OLD=NEW ...]

Every folder under BEFORE_ROOT holding a ``metrics.jsonl`` is matched by relative path under AFTER_ROOT. Compared:
each ``metrics.jsonl`` row (metrics by step, events by step and kind) and ``eval_results.json``, value for value
(NaN equals NaN), leaving out wall-clock fields (``TIMING``). Keys logged on one side only are listed apart (a
removed option's metric, a renamed one; ``--renamed`` maps old names to new ones). Exit 1 when a value differs or a
run is missing; keys on one side only do not fail the comparison but are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "guard/seconds",
          "time", "wall_s", "seconds")  # fmt: skip


def _timing(key: str) -> bool:
    return key in TIMING or key.endswith(("_seconds", "/seconds", "_runtime", "per_second"))


def _rows(run: Path) -> dict[tuple[Any, ...], dict[str, Any]]:
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        key = (row.get("step"), row.get("event", row.get("kind", "metrics")), "train_runtime" in row)
        while key in out:  # two rows of one kind at one step (two events): keep both, in order
            key = (*key, len(out))
        out[key] = row
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare_run(before: Path, after: Path, renamed: dict[str, str]) -> tuple[list[str], set[str], set[str]]:
    """(differences, keys only before, keys only after) of one run."""
    diffs: list[str] = []
    only_before: set[str] = set()
    only_after: set[str] = set()
    a_rows, b_rows = _rows(before), _rows(after)
    for key in sorted(set(a_rows) | set(b_rows), key=str):
        if key not in a_rows or key not in b_rows:
            diffs.append(f"row {key} only {'after' if key not in a_rows else 'before'}")
            continue
        a = {renamed.get(k, k): v for k, v in a_rows[key].items() if not _timing(k)}
        b = {k: v for k, v in b_rows[key].items() if not _timing(k)}
        only_before |= set(a) - set(b)
        only_after |= set(b) - set(a)
        diffs += [f"step {key[0]} {k}: {a[k]!r} != {b[k]!r}" for k in sorted(set(a) & set(b)) if not _same(a[k], b[k])]
    for name in ("eval_results.json",):
        fa, fb = before / name, after / name
        if fa.is_file() != fb.is_file():
            diffs.append(f"{name} only {'before' if fa.is_file() else 'after'}")
        elif fa.is_file():
            ja, jb = json.loads(fa.read_text()), json.loads(fb.read_text())
            diffs += [f"{name} {k}: {ja.get(k)!r} != {jb.get(k)!r}" for k in sorted(set(ja) | set(jb))
                      if not _timing(k) and not _same(ja.get(k), jb.get(k))]  # fmt: skip
    return diffs, only_before, only_after


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--renamed", nargs="*", default=[], metavar="OLD=NEW", help="metric names renamed in between")
    args = ap.parse_args()
    renamed = dict(pair.split("=", 1) for pair in args.renamed)
    runs = sorted(p.parent.relative_to(args.before) for p in args.before.rglob("metrics.jsonl"))
    failed = False
    for rel in runs:
        if not (args.after / rel / "metrics.jsonl").is_file():
            print(f"{rel}: MISSING after")
            failed = True
            continue
        diffs, only_before, only_after = compare_run(args.before / rel, args.after / rel, renamed)
        rows = len(_rows(args.before / rel))
        print(f"{rel}: {rows} rows, {'identical' if not diffs else f'{len(diffs)} differences'}")
        for line in diffs[:20]:
            print(f"    {line}")
        if only_before or only_after:
            print(f"    keys only before: {sorted(only_before)}; only after: {sorted(only_after)}")
        failed |= bool(diffs)
    print(f"{len(runs)} runs compared: {'FAILED' if failed else 'every logged value identical'}")
    return 1 if failed or not runs else 0


if __name__ == "__main__":
    sys.exit(main())
