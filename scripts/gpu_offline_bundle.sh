#!/usr/bin/env bash
# Everything scripts/gpu_smoke.sh needs on an offline CUDA machine that already has torch, transformers, numpy,
# pandas and pyarrow (>= 24): Python 3.12 wheels in .whl/ (about 9 MB) and SmolLM2's config and tokenizer in
# .gpu_assets/smollm2-arch (about 3.5 MB, no weights). Run it here, after `bash scripts/setup.sh dev`, then copy both
# folders with the checkout. On the GPU machine (docs/gpu_smoke.md):
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD bash scripts/gpu_smoke.sh --real-model .gpu_assets/smollm2-arch
# Usage: bash scripts/gpu_offline_bundle.sh [python-version, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12}
venv=.venv/bin/python
rm -rf .whl && mkdir -p .whl
# the versions this checkout's tests ran with, so the GPU machine runs what CI tested
pins=$($venv - <<'PY'
import importlib.metadata as md
names = ["trl", "datasets", "dill", "multiprocess", "hjson", "pydantic", "pydantic_core", "annotated-types",
         "typing-inspection", "peft", "accelerate", "math-verify", "latex2sympy2_extended", "antlr4-python3-runtime",
         "fsspec", "typing_extensions"]
print(" ".join(f"{n}=={md.version(n)}" for n in names))
PY
)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# shellcheck disable=SC2086
$venv -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
  "${platforms[@]}" -d .whl $pins
# DeepSpeed is published as source only: its pure-Python wheel (ops are compiled on first use, none are needed here)
DS_BUILD_OPS=0 $venv -m pip wheel -q --no-deps --no-build-isolation -w .whl \
  "deepspeed==$($venv -c 'import importlib.metadata as m; print(m.version("deepspeed"))')"
$venv scripts/gpu_smoke.py --export-arch .gpu_assets/smollm2-arch
du -sh .whl .gpu_assets
