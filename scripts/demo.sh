#!/usr/bin/env bash
# The embedded default, end to end on CPU: SFT a tiny byte-level LLaMA from scratch on 2-digit addition, GRPO
# from that checkpoint with every steadyrl layer at its shipped default (configs/tiny/grpo-guarded.yaml), then
# the fault demo: the same GRPO for 60 steps twice with one NaN micro-batch at step 12, plain TRL against
# steadyrl; then the hacking demo: a lenient verifier (the right answer anywhere pays, plus 0.02 per character) from
# an SFT model that sometimes hedged, plain TRL against steadyrl's gold watch. Prints greedy eval accuracy after SFT
# and after GRPO, the doctor's verdict, the fault outcomes and the hacking outcomes.
# Usage: bash scripts/demo.sh [--results docs/results/demo.json [--tag -default]]   (expects .venv from
# scripts/setup.sh; --results also writes the numbers it printed, with the commit it ran at, to that file; --tag
# suffixes its scenario names, e.g. for a run under ATEN_CPU_CAPABILITY=default merged beside the native one)
set -euo pipefail
cd "$(dirname "$0")/.."
results="" tag=""
if [ "${1:-}" = "--results" ]; then results=${2:?--results needs a path}; fi
if [ "${3:-}" = "--tag" ]; then tag=${4:?--tag needs a suffix}; fi
at_commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain 2>/dev/null || true)" ]; then at_commit="$at_commit-dirty"; fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false STEADYRL_PROGRESS=1
rm -rf runs/tiny-sft runs/tiny-grpo runs/fault-demo runs/tiny-sft-hedging runs/hacking-demo
mkdir -p runs
start=$(date +%s)
# each stage's full log goes to a file; its progress lines (step, speed, ETA, reward, guard events) to the terminal
stage() {  # stage NAME LOG steadyrl-args...
  local name=$1 log=$2
  shift 2
  echo "== $name"
  if ! steadyrl "$@" 2>&1 | tee "$log" | { grep --line-buffered -E '^step [0-9]+' | sed -u "s/^/   $name: /" || true; }; then
    tail -40 "$log"
    exit 1
  fi
}
stage sft runs/sft.log sft configs/tiny/sft.yaml
stage grpo runs/grpo.log train configs/tiny/grpo-guarded.yaml
mv runs/sft.log runs/tiny-sft/train.log && mv runs/grpo.log runs/tiny-grpo/train.log
echo "== fault demo: one NaN micro-batch at step 12 of 60, plain TRL against steadyrl"
python scripts/fault_demo.py --config configs/tiny/grpo-guarded.yaml --out runs/fault-demo \
  eval.max_samples=100 eval.every=0 || echo "(fault demo: unexpected outcome, see runs/fault-demo/*/fault_demo.log)"
echo "== hacking demo: GRPO against a lenient verifier, plain TRL against steadyrl (gold: exact_match, unseen by the reward)"
stage sft-hedging runs/sft-hedging.log sft configs/tiny/sft-hedging.yaml
mv runs/sft-hedging.log runs/tiny-sft-hedging/train.log
python scripts/hacking_demo.py --out runs/hacking-demo \
  || echo "(hacking demo: unexpected outcome, see runs/hacking-demo/*/hacking_demo.log)"
echo "logs: runs/tiny-sft/train.log, runs/tiny-grpo/train.log, runs/fault-demo/, runs/hacking-demo/"
steadyrl report runs/tiny-grpo > /dev/null && echo "plots: runs/tiny-grpo/report/report.md"
steadyrl doctor runs/tiny-grpo || true   # exit 1 means it found a problem; the demo still prints its result
python - <<'PY'
import json
sft_r = json.load(open("runs/tiny-sft/eval_results.json"))
grpo_r = json.load(open("runs/tiny-grpo/eval_results.json"))
sft, grpo = sft_r["accuracy"], grpo_r["accuracy"]
num = [r["rewards"].get("numeric_match", float("nan")) for r in (sft_r, grpo_r)]
print(f"right number in any format (numeric_match): SFT {num[0]:.2f}, GRPO {num[1]:.2f}")
print(f"accuracy after SFT: {sft:.2f}")
print(f"accuracy after GRPO: {grpo:.2f}")
PY
wall=$(( $(date +%s) - start ))
echo "wall time $wall s (the report and the doctor included)"
if [ -n "$results" ]; then
  python scripts/demo_results.py --out "$results" --wall-s "$wall" --commit "$at_commit" "--tag=$tag"
fi
