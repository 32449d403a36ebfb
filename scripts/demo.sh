#!/usr/bin/env bash
# The embedded default, end to end on CPU: SFT a tiny byte-level LLaMA from scratch on 2-digit addition,
# then GRPO from that checkpoint with the exact-match reward. Prints greedy eval accuracy after each.
# Usage: bash scripts/demo.sh        (expects .venv from scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf runs/tiny-sft runs/tiny-grpo
start=$(date +%s)
steadyrl sft configs/tiny/sft.yaml > runs-sft.log 2>&1 || { tail -40 runs-sft.log; exit 1; }
steadyrl train configs/tiny/grpo.yaml > runs-grpo.log 2>&1 || { tail -40 runs-grpo.log; exit 1; }
mkdir -p runs && mv runs-sft.log runs/tiny-sft/train.log && mv runs-grpo.log runs/tiny-grpo/train.log
echo "wall time $(( $(date +%s) - start )) s; logs: runs/tiny-sft/train.log, runs/tiny-grpo/train.log"
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
