#!/usr/bin/env bash
# Issue 28's GPU chain on the H200: `make e2e` at a real scale, one command once staged.
# SmolLM2-135M-Instruct regenerates 20,000 prompts (tools/make_prompts.py --large) with
# vLLM 0.16 (the H200 kit), extracts them (bf16, and fp8), trains speculators 0.9.0's
# EAGLE-3 drafter on the GPU (the trainer's wheels in their own site, bench/h200_train.sh),
# for the learning curve also on the first 480 / 2,000 / 5,000, and serves each drafter with
# vLLM 0.16's EAGLE-3 on the same 160 held-out prompts: eagle3-e2e's e2e.json and
# learning-curve.png, each acceptance.json and acceptance.png.
#
# The model travels as its GGUF in pieces (64 MiB a call): staging, installs and pieces are
# bench/h200_acceptance.sh's, then this script, back to back while the machine is warm:
#   here:  bash bench/h200_acceptance.sh stage none && bash bench/h200_train.sh wheels
#   A:     carry .gpu-bundle/{whlA,install-on-device.sh} .gpu-stage/a      -> bash bench/h200_acceptance.sh A
#   B:     carry .gpu-bundle/{whlB,vllm016-py.zip,whlC,install-on-device.sh} .gpu-stage/b -> ... B
#   C:     carry .gpu-stage/c                                               -> ... C
#   run:   carry .gpu-stage/d .gpu-bundle/{whlC,whlT}                      -> bash bench/h200_e2e.sh
# `run` again continues where a call's time limit stopped it (every step of e2e resumes);
# BUDGET_S (default 570) is the call's limit, the chain stopped cleanly 30 s before it.
# SAMPLES, CURVE, HELDOUT, EPOCHS size it (defaults 20000, 480,2000,5000, 160, 4).
set -uo pipefail
OUT=${OUT:-/tmp/e2e-results}
mkdir -p "$OUT"
t0=$SECONDS
[[ -d /tmp/site/vllm ]] || { echo "steps A and B are gone (a cold machine): run them again" >&2; exit 3; }
if [[ ! -f /tmp/stage/model-dir ]]; then
  bash bench/h200_acceptance.sh model > "$OUT/model.log" 2>&1 \
    || { tail -5 "$OUT/model.log"; exit 3; }
fi
model=$(cat /tmp/stage/model-dir)
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
[[ -d /tmp/train-site/speculators ]] || pipi /tmp/train-site .gpu-bundle/whlT/*.whl || exit 3
printf '#!/bin/sh\nPYTHONPATH=/tmp/train-site exec python3 "$@"\n' > /tmp/train-python
chmod +x /tmp/train-python
# our CLI on the vLLM kit's site with whlC (hydra, the product's datasets 4); the trainer's
# site only on the trainer's own path (/tmp/train-python): on ours its datasets 5.1.0 met
# the kit's huggingface-hub 0.36.2 (ImportError: BucketNotFoundError)
pipi /tmp/site .gpu-bundle/whlC/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD/src VLLM_WORKER_MULTIPROC_METHOD=spawn \
  PYTHONUNBUFFERED=1 EAGLE3_TRAIN_PYTHON=/tmp/train-python EAGLE3_CACHE=/tmp/eagle3-cache
prompts=/tmp/stage/prompts-large.jsonl
[[ -f $prompts ]] || python3 tools/make_prompts.py --large "$prompts" || exit 3
echo "== ready in $((SECONDS - t0)) s: model $model, $(wc -l < "$prompts") prompts"
BUDGET_S=${BUDGET_S:-570}
# the vLLM kit: Triton attention, vLLM's native ops (its compiled ones are stubbed there);
# the trainer: eager loss (its fused Triton loss does not compile under torch 2.11, docs/train.md)
timeout --signal=TERM --kill-after=20 $((BUDGET_S - 30 - (SECONDS - t0))) \
  python3 -m eagle3_extract.dev.e2e --model smollm2 --out /tmp/e2e \
  --prompts "$prompts" --samples "${SAMPLES:-20000}" --curve "${CURVE:-480,2000,5000}" \
  --heldout "${HELDOUT:-160}" --max-tokens 128 --fp8 --no-control \
  --model-arg "model.path=$model" --model-arg model.gpu_memory_utilization=0.5 \
  --engine-arg '+engine.vllm_args.attention_config={backend:TRITON_ATTN}' \
  --engine-arg '+engine.vllm_args.compilation_config={custom_ops:[none]}' \
  --engine-arg engine.enforce_eager=true \
  --acceptance-arg engine=vllm --train-arg "train.epochs=${EPOCHS:-4}" \
  --train-arg 'train.extra_args=[--loss-implementation,eager]' > "$OUT/e2e.log" 2>&1
rc=$?
grep -a "^e2e:" "$OUT/e2e.log" | tail -14
for f in /tmp/e2e/e2e.json /tmp/e2e/learning-curve.png; do cp "$f" "$OUT/" 2> /dev/null; done
echo "== e2e rc=$rc in $((SECONDS - t0)) s (124: the call's budget; run again to continue)"
