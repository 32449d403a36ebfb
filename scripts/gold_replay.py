"""False alarms of the reward-hacking watch on finished runs: its rule (``steadyrl.guards.gold_watch.replay``, the same
code the live watch runs) over each run's ``metrics.jsonl``, at the shipped ``guards.quatro.gold`` defaults.

The rule reads only logged rows (the periodic eval's ``eval/accuracy`` and TRL's ``reward``), so a run made without
the watch is judged exactly as the watch would have judged it while it trained, up to its first action (a replay
cannot roll back). Runs laid out as ``bench_precision.py`` writes them: ``RUNS/<scenario>/<variant>-s<seed>/``.
Per run: ``evals``, ``falling`` (evals counted towards a divergence), ``alarms`` (confirmed divergences: on a healthy
run each is a false alarm), ``first_alarm_step`` and ``run_commit`` (the commit the run itself was made at).

    python scripts/gold_replay.py /tmp/runs --scenarios healthy-demo healthy-lr3e-5 healthy-lr3e-4 \\
        --results docs/results/gold_false_alarms.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import experiments as X

from steadyrl.guards.gold_watch import GoldConfig, eval_points, replay

RUN = re.compile(r"^(?P<variant>[\w-]+)-s(?P<seed>\d+)$")
METRICS = ("evals", "falling", "alarms", "first_alarm_step", "run_commit")


def judge(folder: Path, config: GoldConfig) -> dict[str, Any]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    verdicts = replay(rows, config)
    alarms = [step for step, verdict in verdicts if verdict == "diverged"]
    environment = folder / "environment.json"
    commit = json.loads(environment.read_text()).get("steadyrl_commit") if environment.is_file() else None
    return {
        "evals": len(eval_points(rows)),
        "falling": sum(verdict == "falling" for _, verdict in verdicts),
        "alarms": len(alarms),
        "first_alarm_step": alarms[0] if alarms else None,
        "run_commit": commit,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, help="the bench's --out folder")
    ap.add_argument("--scenarios", nargs="+", required=True)
    ap.add_argument("--results", default=None)
    ap.add_argument("--merge", action="store_true")
    args = ap.parse_args()
    config = GoldConfig()
    cells, lines = [], ["| scenario | variant | runs | evals per run | false alarms | evals counted as falling |"]
    lines.append("|---|---|---|---|---|---|")
    for scenario in args.scenarios:
        found: dict[str, dict[int, dict[str, Any]]] = {}
        for folder in sorted((args.runs / scenario).iterdir()):
            match = RUN.match(folder.name)
            if match and (folder / "metrics.jsonl").is_file():
                found.setdefault(match["variant"], {})[int(match["seed"])] = judge(folder, config)
        for variant, runs in sorted(found.items()):
            seeds = sorted(runs)
            summaries = [runs[s] for s in seeds]
            cells.append(X.cell(scenario, variant, seeds, summaries, METRICS, died=lambda r: False))
            evals = sorted({r["evals"] for r in summaries})
            alarms = sum(r["alarms"] > 0 for r in summaries)
            falling = sum(r["falling"] for r in summaries)
            lines.append(f"| {scenario} | {variant} | {len(seeds)} | {evals} | {alarms} | {falling} |")
    table = "\n".join(lines)
    print(table)
    if args.results:
        doc = X.results_doc(
            "gold_false_alarms",
            cells,
            command=X.script_command("gold_replay.py"),
            sha=X.commit(),
            model="tiny-llama-0.9m (SFT checkpoint)",
            steps="per run",
            gold_config={k: getattr(config, k) for k in ("drop", "confirm", "reward_slack")},
            table=table,
        )
        X.write_results(args.results, doc, merge=args.merge)


if __name__ == "__main__":
    main()
