#!/usr/bin/env bash
# bench/device/gpu.py's e2e step on the H200 (issues 36, 39): eagle3-regenerate against vLLM's own
# LLM.generate on the first target (bench/throughput/regenerate.py, the job's defaults; REGEN_SAMPLES=0
# skips it), then for each target in MODELS (plan --models; smollm2, qwen25_coder_1_5b, ...)
# `make e2e`'s chain at a real scale: SAMPLES regenerated prompts (tools/make_prompts.py
# --large), extracted (bf16, and fp8 with FP8=1), trained with speculators 0.9.0 on the GPU,
# the learning curve on the first CURVE samples, each drafter served by vLLM 0.16's EAGLE-3
# on HELDOUT held-out prompts. Every part resumes, so the driver's `call e2e run` continues.
# The driver sets PYTHONPATH (bench/device/gpu_sites.py PATHS["cli"]), EAGLE3_TRAIN_PYTHON, GPU_STAGE,
# RESULTS, BUDGET_S, GPU_HOME and MODELS. ENGINE (the engine overrides, default the kit's:
# Triton attention, native ops, eager: it cannot take CUDA graphs) and ACCEPTANCE_ENGINE
# (vllm) let the same step run on the CPU build as its rehearsal (docs/gpu.md); TRAIN_ARGS
# (space-separated train overrides, e.g. train.epochs=1) shortens its training there.
# CI's drafter check is this step on the CPU (tests/test_gpu_rehearsal.py): MAX_TOKENS (128),
# CONTROL=1 (the off-by-one control chain), REGENERATED=DIR with REGENERATED_SHA256 (train on
# a committed, hash-pinned regeneration instead of regenerating the prompts) and E2E_ARGS
# (more of dev/e2e.py's options, space-separated: thresholds, --jobs).
set -uo pipefail
shopt -s nullglob
t0=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - t0))); }
stamp() { echo "$1 $2 s" >> "$RESULTS/times.txt"; }
read -r -a models <<< "${MODELS:-smollm2}"
model_dir() {  # the checkpoint of target $1 from its staged GGUF, built once
  local f=$GPU_STAGE/model-dir.$1 t=$SECONDS
  if [[ ! -f $f ]]; then
    python3 -c "
import sys; from pathlib import Path; from eagle3_extract.models.real import build_from_gguf
print(build_from_gguf(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])))" "$1" \
      "$GPU_STAGE/$1.gguf" "$GPU_HOME/real" > "$f.tmp" || return 3
    mv "$f.tmp" "$f"
    stamp "model($1)" $((SECONDS - t))
  fi
  cat "$f"
}
kit_json=${REGEN_VLLM_ARGS-'{"attention_config": {"backend": "TRITON_ATTN"}, "compilation_config": {"custom_ops": ["none"]}}'}
kit_engine="+engine.vllm_args.attention_config={backend:TRITON_ATTN} \
+engine.vllm_args.compilation_config={custom_ops:[none]} engine.enforce_eager=true"
read -r -a engine <<< "${ENGINE-$kit_engine}"
regen_kit=(); [[ -n $kit_json ]] && regen_kit=(--vllm-args "$kit_json")
if [[ ! -f $RESULTS/regen.json ]] && [[ ${REGEN_SAMPLES:-2048} != 0 ]]; then
  model=$(model_dir "${models[0]}") || exit 3
  t=$SECONDS
  timeout $(($(left) - 30)) python3 bench/throughput/regenerate.py --model "$model" \
    --samples "${REGEN_SAMPLES:-2048}" --max-tokens 128 --enforce-eager true --repeats 1 \
    --gpu-memory-utilization 0.5 "${regen_kit[@]}" --out "$RESULTS/regen.json" \
    > "$RESULTS/regen.log" 2>&1
  echo "== regen bench rc=$? in $((SECONDS - t)) s"; grep -v '^(Worker' "$RESULTS/regen.log" | tail -6
  stamp regen-bench $((SECONDS - t))
fi
if [[ -n ${REGENERATED:-} ]]; then
  answers=(--regenerated "$REGENERATED" --regenerated-sha256 "${REGENERATED_SHA256:?REGENERATED needs its sha256}")
else
  prompts=$GPU_STAGE/prompts-large.jsonl
  [[ -f $prompts ]] || python3 tools/make_prompts.py --large "$prompts" > /dev/null || exit 3
  answers=(--prompts "$prompts")
fi
fp8=(); [[ ${FP8:-0} == 1 ]] && fp8=(--fp8)
control=(--no-control); [[ ${CONTROL:-0} == 1 ]] && control=()
read -r -a e2e_extra <<< "${E2E_ARGS:-}"
curve=(); [[ -n ${CURVE-480,2000,5000} ]] && curve=(--curve "${CURVE-480,2000,5000}")
engine_args=(); for a in "${engine[@]}"; do engine_args+=(--engine-arg "$a"); done
train_args=(); read -r -a train_overrides <<< "${TRAIN_ARGS:-}"
for a in "${train_overrides[@]}"; do train_args+=(--train-arg "$a"); done
rc=0
for m in "${models[@]}"; do
  model=$(model_dir "$m") || exit 3
  out=$GPU_HOME/e2e-$m res=$RESULTS/$m
  mkdir -p "$res"
  echo "== chain $m: ${SAMPLES:-20000} samples, curve ${CURVE-480,2000,5000}, $(left) s left"
  t=$SECONDS
  timeout --signal=TERM --kill-after=20 $(($(left) - 30)) \
    python3 -m eagle3_extract.dev.e2e --model "$m" --out "$out" \
    "${answers[@]}" --samples "${SAMPLES:-20000}" "${curve[@]}" "${fp8[@]}" \
    --heldout "${HELDOUT:-160}" --max-tokens "${MAX_TOKENS:-128}" "${control[@]}" \
    --train "${TRAIN:-gpu}" "${e2e_extra[@]}" \
    --model-arg "model.path=$model" --model-arg model.gpu_memory_utilization=0.5 \
    "${engine_args[@]}" "${train_args[@]}" --acceptance-arg "engine=${ACCEPTANCE_ENGINE:-vllm}" \
    >> "$res/e2e.log" 2>&1
  rc=$?
  stamp "chain($m,rc=$rc)" $((SECONDS - t))
  grep -a "^e2e:" "$res/e2e.log" | tail -14
  # what came out: the verdict, the curve, each step's manifest / record (small files only)
  cp "$out"/e2e.json "$out"/learning-curve.png "$res/" 2> /dev/null
  for d in "$out"/*/; do
    name=$(basename "$d"); mkdir -p "$res/$name"
    for f in manifest.json acceptance.json acceptance.png run.json drafter/eagle3-train.json; do
      [[ -f $d/$f ]] && cp "$d/$f" "$res/$name/"
    done
    [[ -f $d/train.log ]] && tail -c 20000 "$d/train.log" > "$res/$name/train.log"
  done
  [[ $rc == 0 ]] || exit $rc
done
exit $rc
