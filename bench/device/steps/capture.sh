#!/usr/bin/env bash
# bench/device/gpu.py's capture step: our capture with vLLM 0.16.0's own CUDA kernels on the H200
# (issue 25 (a) and (d); docs/engine.md, docs/BENCHMARKS.md): the vLLM kit
# (../shared/tools/h200-vllm016) with its op stub falling through to the kernel kit
# (tools/h200-kernels, built here from the carried csrc pack: `python3
# tools/h200-kernels/build.py pack ...`), vLLM's custom ops on (`custom_ops: [all]`, as the
# user's image runs eager), Triton attention.
#   (a) a Llama-3-8B shape cut to 4 layers, real random weights built on the device from
#       bench/throughput/configs/llama3_8b_l4.json (seeded, as tiny.py builds every test model):
#       eagle3-extract on the committed sample set, then eagle3-verify against HF
#       transformers and vLLM's own EAGLE-3 aux path, every layer id;
#       the full 32-layer 8B shape (dummy weights): the job's phases against plain prefill
#       on the same engine (bench/throughput/run.py), kernels on;
#   (d) what the capture holds on the card (the engine's capture_device_bytes, checked
#       against engine/memory.py's plan at start) and the CUDA context a process holds.
#   (b), (c) DeepseekV3 with Kimi-K2.5's dimensions, MLA on: bf16, then its routed experts
#       in compressed-tensors W4A16 through vLLM's Marlin MoE (STEPS="marlin kimi kimi-w4a16").
# The kit lands in $RESULTS/kit too (keep it as .kernels/kit); its .so is gzipped when over
# the 16 MiB a returned file may have.
set -uo pipefail
t0=$SECONDS
OUT=$RESULTS
if [[ ! -f /tmp/kit/build.json ]]; then
  python3 tools/h200-kernels/build.py "$GPU_STAGE/vllm016-csrc.tar.gz" "$OUT/kit" \
    > "$OUT/kit-build.log" 2>&1
  rc=$?; echo "== kit build rc=$rc in $((SECONDS - t0)) s"; tail -5 "$OUT/kit-build.log"
  ((rc == 0)) || { grep -m5 -i -B2 -A8 "error" "$OUT/kit-build.log" | head -60; exit 4; }
  rm -rf /tmp/kit && cp -r "$OUT/kit" /tmp/kit
  python3 tools/h200-kernels/test_ops.py /tmp/kit "$OUT/kit/ops.json" | tail -25
  so=$OUT/kit/vllm016_kit.so
  if (($(stat -c %s "$so") > 15 * 1024 * 1024)); then gzip -f "$so"; fi
fi
KIT=/tmp/kit
python3 tools/h200-kernels/kit.py install /tmp/site || exit 3
export PYTHONPATH=$PYTHONPATH:$PWD/tools/h200-kernels EAGLE3_KERNEL_KIT=$KIT
echo "== ready in $((SECONDS - t0)) s"
# (d) the CUDA context one process holds before vLLM's first snapshot
python3 - > "$OUT/context.json" <<'PY'
import json, subprocess, torch
def used():
    return int(subprocess.check_output(["nvidia-smi", "--query-gpu=memory.used",
                                        "--format=csv,noheader,nounits"]).split()[0])
before = used(); torch.zeros(1, device="cuda"); torch.cuda.synchronize()
a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16); (a @ a).sum().item()
print(json.dumps({"mib_before": before, "mib_after_context_and_cublas": used()}))
PY
cat "$OUT/context.json"
python3 -c "import vllm._C as c; assert c.KIT, 'kit not loaded'; import torch; \
print('vllm._C ->', torch.ops._C.rms_norm, torch.ops._moe_C.grouped_topk)" || exit 4

run_dir=/tmp/cap-8b-l4
common=(model=tiny model.tiny_config=bench/throughput/configs/llama3_8b_l4.json model.max_model_len=2048
        model.gpu_memory_utilization=0.5 layers=explicit "layers.ids=[1,2,3,4]" dataset=sample
        "+engine.vllm_args.attention_config={backend: TRITON_ATTN}"
        "+engine.vllm_args.compilation_config={custom_ops: [all]}" engine.token_budget=8192)
# BUDGET_S: the call's limit; a step starts only if the time it usually takes is left
left() { echo $((BUDGET_S - (SECONDS - t0))); }
extract_verify() {  # extract_verify DTYPE [TAG OVERRIDE...]: the job, then eagle3-verify
  local dtype=$1 tag=${2:-$1} out=$run_dir-${2:-$1} t
  if (($(left) < 200)); then echo "== extract $tag skipped: $(left) s left"; return; fi
  t=$SECONDS
  timeout $(($(left) - 20)) python3 -m eagle3_extract.cli "${common[@]}" "output.dtype=$dtype" \
    "output.dir=$out" "${@:3}" > "$OUT/extract-$tag.log" 2>&1
  echo "== extract $tag rc=$? in $((SECONDS - t)) s"; tail -12 "$OUT/extract-$tag.log"
  cp "$out/manifest.json" "$OUT/manifest-$tag.json" 2> /dev/null
  t=$SECONDS
  read -r -a verify_args <<< "${VERIFY_ARGS:-}"
  timeout $(($(left) - 10)) python3 -m eagle3_extract.check.verify "$out" --samples 8 \
    "${verify_args[@]}" > "$OUT/verify-$tag.log" 2>&1
  echo "== verify $tag rc=$? in $((SECONDS - t)) s"; tail -30 "$OUT/verify-$tag.log"
  cp "$out/verify_report.json" "$OUT/verify-$tag.json" 2> /dev/null
}
# STEPS: which parts run, in this order (BENCH_DATA, BENCH_REPEATS size the bench)
STEPS=${STEPS:-"bf16 overlap bench fp8 marlin kimi kimi-w4a16"}
want() { [[ " $STEPS " == *" $1 "* ]]; }
want bf16 && extract_verify model

# issue 27: the engine loading beside tokenization vs after it (bench/throughput/overlap.py), tiny model
if want overlap && (($(left) > 150)); then
  t=$SECONDS
  (cd bench && timeout $(($(left) - 60)) python3 overlap.py --rows 20000 --repeats 1 --job-timeout 150 \
    --out /tmp/overlap "+engine.vllm_args.attention_config={backend: TRITON_ATTN}" \
    "+engine.vllm_args.compilation_config={custom_ops: [all]}" > "$OUT/overlap.log" 2>&1)
  echo "== overlap rc=$? in $((SECONDS - t)) s"; tail -4 "$OUT/overlap.log"
  cp /tmp/overlap/overlap.json "$OUT/" 2> /dev/null
fi

# the full 8B shape: the job's phases against plain prefill, kernels on
if ! want bench; then :; elif (($(left) < 150)); then echo "== bench skipped: $(left) s left"; else
if (($(df --output=avail -B1G /dev/shm | tail -1) < 8)); then export EAGLE3_SHM_DIR=/tmp; fi
dir=/var/tmp/eagle3-bench
[[ $(findmnt -no FSTYPE -T /var/tmp) == tmpfs ]] && dir=$PWD/.bench-out
t=$SECONDS
timeout $(($(left) - 10)) python3 bench/throughput/run.py --model bench/throughput/configs/llama3_8b.json \
  --load-format dummy --synthetic "${BENCH_DATA:-64x2048}" --token-budget 32768 --max-num-seqs 16 \
  --repeats "${BENCH_REPEATS:-2}" \
  --gpu-memory-utilization 0.6 --out-dir "$dir" --engine vllm --executor mp \
  --writer-threads 2 --more-writer-threads 4,8 \
  --vllm-args '{"attention_config": {"backend": "TRITON_ATTN"}, "compilation_config": {"custom_ops": ["all"]}}' \
  --out "$OUT/bench-8b-kernels.json" > "$OUT/bench-8b-kernels.log" 2>&1
echo "== bench 8b kernels rc=$? in $((SECONDS - t)) s"
grep -v '^(Worker' "$OUT/bench-8b-kernels.log" | grep -v Gloo | tail -16
fi

want fp8 && extract_verify fp8

# issue 25 (b): DeepseekV3 with Kimi-K2.5's real dimensions (bench/throughput/configs/kimi_k25_l4.json:
# 4 layers, the first dense, 16 routed experts of which 8 a token plus the shared one), MLA
# on (TRITON_MLA: Triton decode, prefill through the kit's varlen stand-in), MoE routing and
# alignment on vLLM's own _moe_C kernels, seeded random weights (10.8 GB, built there)
kimi=(model.gpu_memory_utilization=0.6 "+engine.vllm_args.attention_config={backend: TRITON_MLA}")
KIMI_BF16=bench/throughput/configs/kimi_k25_l4.json
want kimi && VERIFY_ARGS="--reference hf" extract_verify model kimi \
  model.tiny_config=$KIMI_BF16 "${kimi[@]}"

# (c) the Marlin MoE op inside vLLM's Python against a torch MoE on the dequantized weights
if want marlin; then
  PYTHONPATH=$PYTHONPATH:$PWD/bench timeout 120 python3 tools/h200-kernels/test_marlin.py \
    "$OUT/marlin.json" 2>&1 | grep -v "^INFO" | tail -6
fi
# (c) the same model, its routed experts in compressed-tensors W4A16 (bench/prediction/w4a16.py: groups
# of 32, symmetric, packed, as Kimi-K2.5 ships them), through vLLM 0.16's WNA16 MoE method
# (Marlin on this GPU); verified against HF transformers on the dequantized weights
if want kimi-w4a16 && (($(left) > 240)); then
  t=$SECONDS
  src=$(python3 -c "from eagle3_extract.models.tiny import build_tiny_model as b; print(b('$KIMI_BF16'))")
  python3 bench/prediction/w4a16.py "$src" /tmp/kimi-w4a16 /tmp/kimi-w4a16-ref > "$OUT/w4a16.json" \
    && echo "== w4a16 checkpoint in $((SECONDS - t)) s: $(cat "$OUT/w4a16.json")"
  VERIFY_ARGS="--reference hf model.path=/tmp/kimi-w4a16-ref" extract_verify model kimi-w4a16 \
    model.path=/tmp/kimi-w4a16 "${kimi[@]}"
  grep -h "WNA16\|Marlin" "$OUT/extract-kimi-w4a16.log" | head -3
elif want kimi-w4a16; then echo "== kimi-w4a16 skipped: $(left) s left"; fi
echo "== total $((SECONDS - t0)) s"
