"""Merge results files of one benchmark (RESULTS.md format) into one: each later file's cells replace the same
(scenario, variant) cells of the ones before, and every cell keeps the command, commit, date, machine and packages of
the run that made it (``experiments.merge_results``). ``--add-seeds``: a later file's cell joins the one before seed by
seed instead (other seeds of the same runs, e.g. a second seed run in another session), and the cell lists each
run's seeds with its command and commit under ``runs``.

    python scripts/merge_results.py docs/results/precision_recall.json /tmp/a.json /tmp/b.json
    python scripts/merge_results.py --add-seeds docs/results/precision_recall.json /tmp/seed1.json
    python scripts/merge_results.py --mixed-steps docs/results/precision_recall.json /tmp/long.json   # 1,000 steps
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import experiments as X


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", type=Path, help="the file to merge into (its cells come first)")
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--add-seeds", action="store_true", help="join cells seed by seed (their seeds must differ)")
    ap.add_argument(
        "--mixed-steps", action="store_true", help="cells of another run length join too (each keeps its own steps)"
    )
    args = ap.parse_args()
    for path in args.files:
        doc = json.loads(path.read_text())
        benchmark = json.loads(args.target.read_text())["benchmark"] if args.target.is_file() else doc["benchmark"]
        if doc["benchmark"] != benchmark:
            raise SystemExit(f"{path} is benchmark {doc['benchmark']!r}, {args.target} is {benchmark!r}")
        same = () if args.mixed_steps else ("steps",)
        X.write_results(args.target, doc, merge=True, add_seeds=args.add_seeds, same=same)
    print(f"{args.target}: {len(json.loads(args.target.read_text())['cells'])} cells")


if __name__ == "__main__":
    main()
