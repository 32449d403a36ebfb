#!/usr/bin/env bash
# GPU smoke test for a person with a CUDA machine (not run in CI, which has no GPU).
# Builds the tiny model locally (no downloads), then runs a short bf16 GRPO under DeepSpeed ZeRO-2 on all
# visible GPUs, then (when vllm is installed) GRPO and PPO with vLLM colocate rollouts, printing the vLLM-policy
# log-prob gap (near 0 when each weight sync reaches vLLM). Prints peak GPU memory.
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
  # PPO generates through the same TRL vLLM path (the sync sends the bare policy, never the critic)
  accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes "$ngpu" \
    -m steadyrl train configs/tiny/ppo.yaml "${common[@]:1}" "trainer.output_dir=$out/vllm-ppo" \
    trainer.use_vllm=true trainer.vllm_mode=colocate trainer.vllm_gpu_memory_utilization=0.3
  python - "$out" <<'PY'
import json, statistics, sys
for run in ("vllm", "vllm-ppo"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    gap = [r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r]
    print(f"gpu_smoke: {run}: vLLM-policy log-prob gap per token, median {statistics.median(gap):.4g}, max {max(gap):.4g}")
PY
else
  echo "gpu_smoke: vllm not installed, skipped the vLLM colocate run"
fi
echo "gpu_smoke: OK"
