#!/usr/bin/env bash
# bench/device/gpu.py's bench step: the H200 figures of docs/BENCHMARKS.md, vLLM 0.16's Python code
# over the device's torch (../shared/tools/h200-vllm016/README.md), an 8B Llama shape with
# dummy weights, 64 x 2048 synthetic tokens, 16 per call. BENCH picks the parts
# (all|vllm|hf|profile|regen, default all); BENCH_DTYPE=fp8 stores the states as fp8.
# regen reads .bench-tok (SmolLM2's tokenizer files + smollm2.json, carried as a piece).
set -uo pipefail
what=${BENCH:-all}
OUT=$RESULTS
# The shared host buffer (3 slots x 33,792 rows x 4 x 4096 bf16 = 3.3 GB) lives in /dev/shm.
if (($(df --output=avail -B1G /dev/shm | tail -1) < 8)); then export EAGLE3_SHM_DIR=/tmp; fi
# Outputs on a disk, not tmpfs (that would measure RAM).
dir=/var/tmp/eagle3-bench
[[ $(findmnt -no FSTYPE -T /var/tmp) == tmpfs ]] && dir=$PWD/.bench-out
# BENCH_DATA=256x2048 BENCH_REPEATS=2 BENCH_BREAKDOWN=: 16 calls a phase instead of 4, so
# the one copy a phase cannot overlap (the last call's) weighs a quarter as much in (2).
breakdown=(--breakdown); [[ -n ${BENCH_BREAKDOWN+x} ]] && read -r -a breakdown <<< "$BENCH_BREAKDOWN"
common=(--model bench/throughput/configs/llama3_8b.json --load-format dummy
        --synthetic "${BENCH_DATA:-64x2048}" --token-budget 32768 --max-num-seqs 16
        --repeats "${BENCH_REPEATS:-3}" "${breakdown[@]}"
        --gpu-memory-utilization 0.6 --out-dir "$dir")
vllm_args='{"attention_config": {"backend": "TRITON_ATTN"}, "compilation_config": {"custom_ops": ["none"]}}'

# BENCH_DTYPE=fp8: the states stored as fp8 e4m3 + per-token scales (output=fp8)
dtype=${BENCH_DTYPE:-model}
if [[ $what == all || $what == vllm ]]; then
  tag=vllm${BENCH_TAG:-}; [[ $dtype != model ]] && tag=$tag-$dtype
  timeout 330 python3 bench/throughput/run.py "${common[@]}" --engine vllm --executor mp \
    --output-dtype "$dtype" --vllm-args "$vllm_args" --out "$OUT/$tag.json" \
    > "$OUT/$tag.log" 2>&1
  echo "$tag rc=$?"
  grep -v '^(Worker' "$OUT/$tag.log" | grep -v Gloo | tail -22
fi
if [[ $what == regen ]]; then
  # eagle3-regenerate vs LLM.generate on one engine (bench/throughput/regenerate.py): the 8B shape with
  # SmolLM2's vocabulary and tokenizer (carried as .bench-tok/: tokenizer files + smollm2.json,
  # its config), and the SmolLM2-135M shape itself (where per-step overheads weigh most).
  for shape in ${REGEN_SHAPES:-8b 135m}; do
    model=(--model bench/throughput/configs/llama3_8b.json --vocab 49152)
    [[ $shape == 135m ]] && model=(--model "$GPU_STAGE/.bench-tok/smollm2.json")
    timeout 230 python3 bench/throughput/regenerate.py "${model[@]}" --tokenizer "$GPU_STAGE/.bench-tok" \
      --load-format dummy --samples "${REGEN_SAMPLES:-128}" --max-tokens 128 --enforce-eager true \
      --repeats "${REGEN_REPEATS:-2}" \
      --gpu-memory-utilization 0.6 --vllm-args "$vllm_args" --out "$OUT/regen-$shape.json" \
      > "$OUT/regen-$shape.log" 2>&1
    echo "regen $shape rc=$?"
    grep -v '^(Worker' "$OUT/regen-$shape.log" | grep -v Gloo | tail -6
  done
fi
if [[ $what == all || $what == hf ]]; then
  timeout 150 python3 bench/throughput/run.py "${common[@]}" --engine hf --out "$OUT/hf.json" \
    > "$OUT/hf.log" 2>&1
  echo "hf rc=$?"
  tail -16 "$OUT/hf.log"
fi
if [[ $what == all || $what == profile ]]; then
  timeout 90 python3 bench/throughput/writer_profile.py --dir "$dir/profile" --out "$OUT/writer_profile.json" \
    > "$OUT/writer_profile.log" 2>&1
  echo "profile rc=$?"
  tail -20 "$OUT/writer_profile.log"
  rm -rf "$dir/profile"
fi
