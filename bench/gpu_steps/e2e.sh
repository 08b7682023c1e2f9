#!/usr/bin/env bash
# bench/gpu.py's e2e step on the H200 (issue 36): eagle3-regenerate against vLLM's own
# LLM.generate on the real SmolLM2-135M-Instruct (bench/regenerate.py, the job's defaults),
# then `make e2e`'s chain at a real scale: SAMPLES regenerated prompts (tools/make_prompts.py
# --large), extracted (bf16, and fp8 with FP8=1), trained with speculators 0.9.0 on the GPU,
# the learning curve on the first CURVE samples, each drafter served by vLLM 0.16's EAGLE-3
# on HELDOUT held-out prompts. Every part resumes, so the driver's `call e2e run` continues.
# The driver sets PYTHONPATH (bench/gpu_sites.py PATHS["cli"]), EAGLE3_TRAIN_PYTHON, GPU_STAGE,
# RESULTS, BUDGET_S and GPU_HOME. ENGINE (the engine overrides, default the kit's: Triton
# attention, native ops, eager: it cannot take CUDA graphs) and ACCEPTANCE_ENGINE (vllm) let
# the same step run on the CPU build as its rehearsal (docs/gpu.md).
set -uo pipefail
shopt -s nullglob
t0=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - t0))); }
stamp() { echo "$1 $2 s" >> "$RESULTS/times.txt"; }
model_dir=$GPU_STAGE/model-dir
if [[ ! -f $model_dir ]]; then
  python3 -c "
import sys; from pathlib import Path; from eagle3_extract.models.smollm2 import build_smollm2
print(build_smollm2(root=Path(sys.argv[1]), gguf=Path(sys.argv[2])))" "$GPU_HOME/real" \
    "$GPU_STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" > "$model_dir.tmp" || exit 3
  mv "$model_dir.tmp" "$model_dir"
  stamp model $((SECONDS - t0))
fi
model=$(cat "$model_dir")
kit_json=${REGEN_VLLM_ARGS-'{"attention_config": {"backend": "TRITON_ATTN"}, "compilation_config": {"custom_ops": ["none"]}}'}
kit_engine="+engine.vllm_args.attention_config={backend:TRITON_ATTN} \
+engine.vllm_args.compilation_config={custom_ops:[none]} engine.enforce_eager=true"
read -r -a engine <<< "${ENGINE-$kit_engine}"
regen_kit=(); [[ -n $kit_json ]] && regen_kit=(--vllm-args "$kit_json")
if [[ ! -f $RESULTS/regen.json ]] && [[ ${REGEN_SAMPLES:-2048} != 0 ]]; then
  t=$SECONDS
  timeout $(($(left) - 30)) python3 bench/regenerate.py --model "$model" \
    --samples "${REGEN_SAMPLES:-2048}" --max-tokens 128 --enforce-eager true --repeats 1 \
    --gpu-memory-utilization 0.5 "${regen_kit[@]}" --out "$RESULTS/regen.json" \
    > "$RESULTS/regen.log" 2>&1
  echo "== regen bench rc=$? in $((SECONDS - t)) s"; grep -v '^(Worker' "$RESULTS/regen.log" | tail -6
  stamp regen-bench $((SECONDS - t))
fi
prompts=$GPU_STAGE/prompts-large.jsonl
[[ -f $prompts ]] || python3 tools/make_prompts.py --large "$prompts" > /dev/null || exit 3
fp8=(); [[ ${FP8:-0} == 1 ]] && fp8=(--fp8)
curve=(); [[ -n ${CURVE-480,2000,5000} ]] && curve=(--curve "${CURVE-480,2000,5000}")
engine_args=(); for a in "${engine[@]}"; do engine_args+=(--engine-arg "$a"); done
echo "== chain: ${SAMPLES:-20000} samples, curve ${CURVE-480,2000,5000}, $(left) s left"
t=$SECONDS
timeout --signal=TERM --kill-after=20 $(($(left) - 30)) \
  python3 -m eagle3_extract.dev.e2e --model smollm2 --out "$GPU_HOME/e2e" \
  --prompts "$prompts" --samples "${SAMPLES:-20000}" "${curve[@]}" "${fp8[@]}" \
  --heldout "${HELDOUT:-160}" --max-tokens 128 --no-control --train "${TRAIN:-gpu}" \
  --model-arg "model.path=$model" --model-arg model.gpu_memory_utilization=0.5 \
  "${engine_args[@]}" --acceptance-arg "engine=${ACCEPTANCE_ENGINE:-vllm}" \
  >> "$RESULTS/e2e.log" 2>&1
rc=$?
stamp "chain(rc=$rc)" $((SECONDS - t))
grep -a "^e2e:" "$RESULTS/e2e.log" | tail -14
# what came out: the verdict, the curve, each step's manifest / record (small files only)
cp "$GPU_HOME/e2e"/e2e.json "$GPU_HOME/e2e"/learning-curve.png "$RESULTS/" 2> /dev/null
for d in "$GPU_HOME/e2e"/*/; do
  name=$(basename "$d"); mkdir -p "$RESULTS/$name"
  for f in manifest.json acceptance.json acceptance.png run.json drafter/eagle3-train.json; do
    [[ -f $d/$f ]] && cp "$d/$f" "$RESULTS/$name/"
  done
  [[ -f $d/train.log ]] && tail -c 20000 "$d/train.log" > "$RESULTS/$name/train.log"
done
exit $rc
