#!/usr/bin/env bash
# bench/device/gpu.py's kimi step (issue 37): one TP=8 rank and one PP=8 stage of Kimi-K2.5 on the
# H200, each the shape that card of the user's node holds (bench/prediction/kimi_shapes.py: dummy
# weights, routed experts in compressed-tensors W4A16 through vLLM's Marlin MoE), with vLLM
# 0.16.0's own kernels (the kernel kit, as the capture step builds it) and MLA prefill through
# FlashAttention-2's varlen kernel (tools/h200-kernels/vllm_fa2_C.py; the stand-in's cost
# measured beside it). Sub-steps, in order, each skipped when its result is already in
# $RESULTS (a call that ran out of time is continued with `call kimi run`):
#   kit        the kernel kit (94 s), the ops checked
#   varlen     FA2 vs the float32 stand-in at MLA's shapes (test_varlen.py)
#   rank       bench/throughput/run.py on the rank over bench/throughput/mix.py's mix, MIX_TOKENS per repeat x
#              REPEATS: plain prefill vs the job's extraction to disk, same engine
#   rank-job   the job itself (eagle3-extract) on the rank over JOB_TOKENS of mix
#              conversations: its manifest (timings: preflight beside the engine's start)
#   stage      bench/throughput/run.py on the stage, as rank
#   standin    the rank again with EAGLE3_VARLEN_KERNEL=torch (the stand-in's share), short
# nvidia-smi is sampled every second during each run (mem-<name>.csv: the card's peak).
set -uo pipefail
t0=$SECONDS
OUT=$RESULTS
left() { echo $((BUDGET_S - (SECONDS - t0))); }
done_() { [[ -f "$OUT/$1.done" ]]; }
STEPS=${STEPS:-"kit varlen rank rank-job stage standin"}
MIX_TOKENS=${MIX_TOKENS:-250000}
REPEATS=${REPEATS:-4}
JOB_TOKENS=${JOB_TOKENS:-300000}
RANK_LAYERS=${RANK_LAYERS:-61}
STAGE_LAYERS=${STAGE_LAYERS:-8}
RANK_IDS=2,$((RANK_LAYERS / 2)),$((RANK_LAYERS - 3)),$RANK_LAYERS  # [2, 30, 58, 61] at 61
UTIL=${UTIL:-0.9}
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want kit && [[ ! -f /tmp/kit/build.json ]]; then
  python3 tools/h200-kernels/build.py "$GPU_STAGE/vllm016-csrc.tar.gz" /tmp/kit \
    > "$OUT/kit-build.log" 2>&1
  rc=$?; echo "== kit build rc=$rc in $((SECONDS - t0)) s"; tail -3 "$OUT/kit-build.log"
  ((rc == 0)) || { grep -m5 -i -B2 -A8 "error" "$OUT/kit-build.log" | head -40; exit 4; }
  python3 tools/h200-kernels/test_ops.py /tmp/kit "$OUT/ops.json" | tail -5
fi
python3 tools/h200-kernels/kit.py install /tmp/site || exit 3
export PYTHONPATH=$PYTHONPATH:$PWD/tools/h200-kernels EAGLE3_KERNEL_KIT=/tmp/kit
python3 -c "import vllm._C as c; assert c.KIT, 'kit not loaded'" || exit 4
echo "== ready in $((SECONDS - t0)) s"

if want varlen && ! done_ varlen; then
  t=$SECONDS
  python3 tools/h200-kernels/test_varlen.py "$OUT/varlen.json" > "$OUT/varlen.log" 2>&1 \
    && touch "$OUT/varlen.done"
  echo "== varlen rc=$? in $((SECONDS - t)) s"; tail -3 "$OUT/varlen.log"
fi

python3 bench/prediction/kimi_shapes.py rank /tmp/kimi-rank --layers "$RANK_LAYERS" > "$OUT/shape-rank.json"
python3 bench/prediction/kimi_shapes.py stage /tmp/kimi-stage --layers "$STAGE_LAYERS" > "$OUT/shape-stage.json"
cat "$OUT/shape-rank.json" "$OUT/shape-stage.json"
if (($(df --output=avail -B1G /dev/shm | tail -1) < 8)); then export EAGLE3_SHM_DIR=/tmp; fi
files=${FILES:-/var/tmp/eagle3-kimi}  # FILES=/dev/shm/...: the capture without the disk
[[ $(findmnt -no FSTYPE -T /var/tmp) == tmpfs ]] && files=$PWD/.bench-out
VLLM_ARGS='{"attention_config": {"backend": "TRITON_MLA"}, "compilation_config": {"custom_ops": ["all"]}}'

watch_mem() {  # watch_mem NAME: the card's memory every second until the run ends
  nvidia-smi --query-gpu=timestamp,memory.used,memory.total,utilization.gpu \
    --format=csv,noheader,nounits -l 1 > "$OUT/mem-$1.csv" 2> /dev/null &
  MEM_PID=$!
}
memory() {  # memory NAME LOG: the card's peak and vLLM's own split of it -> mem-NAME.json
  python3 - "$OUT/mem-$1.csv" "$2" "$UTIL" > "$OUT/mem-$1.json" <<'PY'
import json, re, sys
csv, log, util = sys.argv[1], open(sys.argv[2], errors="replace").read(), float(sys.argv[3])
rows = [r.split(", ") for r in open(csv).read().splitlines() if r.count(",") >= 3]
used = [int(r[1]) for r in rows if r[1].strip().isdigit()]
total_gib = int(rows[0][2]) / 1024 if rows else None
def gib(pattern):
    m = re.findall(pattern, log)
    return float(m[-1]) if m else None
weights, kv = gib(r"Model loading took ([0-9.]+) GiB"), gib(r"Available KV cache memory: ([0-9.]+) GiB")
rest = util * total_gib - weights - kv if None not in (weights, kv, total_gib) else None
print(json.dumps({"peak_used_gib": max(used) / 1024 if used else None, "total_gib": total_gib,
                  "gpu_memory_utilization": util, "weights_gib": weights, "kv_cache_gib": kv,
                  "activation_and_non_torch_gib": rest}))
PY
  cat "$OUT/mem-$1.json"
}
bench() {  # bench NAME MODEL_DIR LAYERS NEED_S [ENV=...]: bench/throughput/run.py over the mix
  local name=$1 model=$2 layers=$3 need=$4 t=$SECONDS
  done_ "$name" && return
  if (($(left) < need)); then echo "== $name skipped: $(left) s left (needs $need)"; return; fi
  watch_mem "$name"
  env "${@:5}" timeout $(($(left) - 15)) python3 bench/throughput/run.py --model "$model" \
    --load-format dummy --mix "$MIX_TOKENS" --repeats "${BENCH_REPEATS:-$REPEATS}" --warmup 2 \
    --phases prefill,extract_disk --no-disk-test --layers "$layers" \
    --max-model-len 8192 --token-budget 32768 --max-num-seqs 64 \
    --gpu-memory-utilization "$UTIL" --executor mp --writer-threads 2 \
    --vllm-args "$VLLM_ARGS" --out-dir "$files" --out "$OUT/bench-$name.json" \
    > "$OUT/bench-$name.log" 2>&1
  local rc=$?
  kill "$MEM_PID" 2> /dev/null
  memory "$name" "$OUT/bench-$name.log"
  echo "== $name rc=$rc in $((SECONDS - t)) s"
  grep -v '^(Worker\|Gloo\|^INFO\|^WARNING' "$OUT/bench-$name.log" | tail -8
  ((rc == 0)) && touch "$OUT/$name.done"
}

want rank && bench rank /tmp/kimi-rank "$RANK_IDS" 330

if want rank-job && ! done_ rank-job && (($(left) > 240)); then
  t=$SECONDS
  python3 bench/throughput/mix.py conversations /tmp/kimi-mix.jsonl --tokens "$JOB_TOKENS" > "$OUT/mix.json"
  rm -rf "$files/job"
  watch_mem rank-job
  timeout $(($(left) - 15)) python3 -m eagle3_extract.cli model=tiny model.path=/tmp/kimi-rank \
    model.tiny_config=null model.tokenizer=src/eagle3_extract/assets/tokenizer \
    model.load_format=dummy model.max_model_len=8192 model.gpu_memory_utilization="$UTIL" \
    layers=explicit "layers.ids=[$RANK_IDS]" dataset=local \
    dataset.path=/tmp/kimi-mix.jsonl dataset.max_length=8191 dataset.overlong=skip \
    engine.token_budget=32768 engine.max_num_seqs=64 output.dir="$files/job" \
    "+engine.vllm_args.attention_config={backend: TRITON_MLA}" \
    "+engine.vllm_args.compilation_config={custom_ops: [all]}" > "$OUT/job-rank.log" 2>&1
  rc=$?
  kill "$MEM_PID" 2> /dev/null
  memory rank-job "$OUT/job-rank.log"
  echo "== rank-job rc=$rc in $((SECONDS - t)) s"; tail -6 "$OUT/job-rank.log"
  cp "$files/job/manifest.json" "$OUT/manifest-rank-job.json" 2> /dev/null && ((rc == 0)) \
    && touch "$OUT/rank-job.done"
  rm -rf "$files/job"
fi

want stage && bench stage /tmp/kimi-stage "2,$((STAGE_LAYERS - 1)),$STAGE_LAYERS" 300

# the stand-in's share: the rank's mix once, MLA prefill in float32 torch
want standin && BENCH_REPEATS=1 bench standin /tmp/kimi-rank "$RANK_IDS" 240 \
  EAGLE3_VARLEN_KERNEL=torch
echo "== total $((SECONDS - t0)) s"
