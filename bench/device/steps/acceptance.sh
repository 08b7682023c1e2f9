#!/usr/bin/env bash
# bench/device/gpu.py's acceptance step (docs/QUALITY.md): vLLM 0.16's own EAGLE-3 speculative
# decoding (the H200 kit) and, with HF=1, our loop on the same GPU, for the drafters an e2e
# run trained here (`python3 bench/device/gpu.py plan acceptance --drafters outputs/e2e/smollm2`
# stages them without their embeddings), on the plan's first target (MODELS).
set -uo pipefail
read -r -a models <<< "${MODELS:-smollm2}"
m=${models[0]}
model_dir=$GPU_STAGE/model-dir.$m
if [[ ! -f $model_dir ]]; then
  python3 -c "
import sys; from pathlib import Path; from eagle3_extract.models.real import build_from_gguf
print(build_from_gguf(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))" "$m" \
    "$GPU_STAGE/$m.gguf" "$GPU_HOME/real" > "$model_dir.tmp" || exit 3
  mv "$model_dir.tmp" "$model_dir"
fi
model=$(cat "$model_dir")
common=("model=$m" "model.path=$model" "dataset.max_samples=${HELDOUT:-160}"
        acceptance.max_tokens=128)
kit=('+engine.vllm_args.attention_config={backend:TRITON_ATTN}'
     '+engine.vllm_args.compilation_config={custom_ops:[none]}'
     model.gpu_memory_utilization=0.5)
for kind in real control; do
  [[ -d $GPU_STAGE/drafters/$kind ]] || continue
  timeout 240 python3 -m eagle3_extract.drafter.acceptance "${common[@]}" \
    "drafter.dir=$GPU_STAGE/drafters/$kind" engine=vllm "${kit[@]}" \
    "output.dir=$RESULTS/vllm-$kind" > "$RESULTS/vllm-$kind.log" 2>&1
  echo "vllm $kind rc=$?"; grep -a eagle3-acceptance "$RESULTS/vllm-$kind.log" | tail -3
done
if [[ ${HF:-0} == 1 ]]; then
  timeout 500 python3 -m eagle3_extract.drafter.acceptance "${common[@]}" \
    "drafter.dir=$GPU_STAGE/drafters/real" engine=hf acceptance.hf_dtype=bfloat16 \
    "output.dir=$RESULTS/hf-real" > "$RESULTS/hf-real.log" 2>&1
  echo "hf real rc=$?"; grep -a eagle3-acceptance "$RESULTS/hf-real.log" | tail -3
fi
