#!/usr/bin/env bash
# The whole test suite after `bash scripts/setup.sh dev`: the main suite in .venv while .venv-vllm (vLLM's CPU
# build) installs in the background, then the real-vLLM tests in .venv-vllm. Exit status: the first failure.
# Usage: bash scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
setup_log=${TMPDIR:-/tmp}/steadyrl-vllm-setup.$$.log
bash scripts/test_vllm_cpu.sh --setup > "$setup_log" 2>&1 &
setup=$!
status=0
.venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=25 || status=$?
if ! wait "$setup"; then
  echo "building .venv-vllm failed; the end of its log ($setup_log):" >&2
  tail -30 "$setup_log" >&2
  exit 1
fi
grep -v "^WARNING: Location" "$setup_log" | tail -3 || true
[ "$status" -eq 0 ] || exit "$status"
bash scripts/test_vllm_cpu.sh --tests
