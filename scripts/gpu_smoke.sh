#!/usr/bin/env bash
# GPU smoke test for a person with a CUDA machine (not run in CI, which has no GPU).
# Builds the tiny model locally (no downloads), then runs a short bf16 GRPO under DeepSpeed ZeRO-2 on all
# visible GPUs, then (when vllm is installed) the same with vLLM colocate rollouts. Prints peak GPU memory.
# Usage: bash scripts/gpu_smoke.sh        (in an environment with CUDA torch and `pip install -e .[deepspeed]`)
set -euo pipefail
cd "$(dirname "$0")/.."
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$ngpu" -ge 1 ] || { echo "gpu_smoke: no CUDA GPU visible" >&2; exit 1; }
out=${OUT_DIR:-runs/gpu-smoke}
rm -rf "$out"
python -c "from steadyrl.tasks import build_tiny_model; build_tiny_model('$out/model')"
common=(configs/tiny/grpo.yaml "model.path=$out/model" model.dtype=bfloat16 trainer.bf16=true
        trainer.max_steps=10 trainer.save_steps=5 trainer.logging_steps=1 eval.max_samples=64
        "callbacks=[steadyrl.callbacks.memory:PeakMemory]")
accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes "$ngpu" \
  -m steadyrl train "${common[@]}" "trainer.output_dir=$out/zero2"
if python -c "import vllm" 2>/dev/null; then
  accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes "$ngpu" \
    -m steadyrl train "${common[@]}" "trainer.output_dir=$out/vllm" trainer.use_vllm=true \
    trainer.vllm_mode=colocate trainer.vllm_gpu_memory_utilization=0.3
else
  echo "gpu_smoke: vllm not installed, skipped the vLLM colocate run"
fi
echo "gpu_smoke: OK"
