#!/usr/bin/env bash
# The GPU acceptance figures of docs/QUALITY.md: vLLM 0.16's own EAGLE-3 speculative
# decoding (the H200 kit, ../shared/tools/h200-vllm016/) and our hf loop on the same
# GPU, for the drafters `make e2e` trained here (real and control), on the real
# SmolLM2-135M-Instruct. Each call carries at most 64 MiB, so the model travels as its
# GGUF in pieces (bench/h200_acceptance.sh stage, here), four calls back to back:
#   A: carry .gpu-bundle/{whlA,install-on-device.sh} .gpu-stage/a      -> ... A
#   B: carry .gpu-bundle/{whlB,vllm016-py.zip,whlC,install-on-device.sh} .gpu-stage/b -> ... B
#   C: carry .gpu-stage/c                                               -> ... C
#   D: carry .gpu-stage/d (last piece, drafters)                        -> ... vllm
#   E: carry .gpu-stage/d                                               -> ... hf
# (vllm: vLLM's speculative decoding with both drafters; hf: our loop, real drafter, bf16.)
# `model` (after C, carrying .gpu-stage/d): only reassemble the GGUF and build the model;
# its directory goes to /tmp/stage/model-dir (bench/h200_e2e.sh runs the chain on it).
set -uo pipefail
step=${1:?stage|A|B|C|model|vllm|hf}
OUT=${OUT:-/tmp/acceptance-results}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf

if [[ $step == stage ]]; then  # here: split the GGUF, drafters without their embeddings
  src=${2:?drafters dir: outputs/e2e/<model>}
  gguf=$(.venv/bin/python -c "from eagle3_extract.models.smollm2 import gguf_path; print(gguf_path())")
  rm -rf .gpu-stage && mkdir -p .gpu-stage/{a,b,c,d}
  head -c 2000000 "$gguf" > .gpu-stage/a/part.0
  tail -c +2000001 "$gguf" | head -c 28000000 > .gpu-stage/b/part.1
  tail -c +30000001 "$gguf" | head -c 58000000 > .gpu-stage/c/part.2
  tail -c +88000001 "$gguf" > .gpu-stage/d/part.3
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu-stage/d/gguf.sha256
  for kind in real control; do
    [[ -f $src/drafter-$kind/drafter/model.safetensors ]] || continue
    .venv/bin/python - "$src/drafter-$kind/drafter" ".gpu-stage/d/drafter-$kind" <<'PY'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
dst.mkdir(parents=True)
w = load_file(str(src / "model.safetensors"))
w.pop("embed_tokens.weight")  # a frozen copy of the target's; vLLM and the loop share it
save_file(w, str(dst / "model.safetensors"))
for name in ("config.json", "eagle3-train.json"):
    if (src / name).exists():  # an epoch checkpoint has no eagle3-train.json
        shutil.copy2(src / name, dst / name)
PY
  done
  du -sh .gpu-stage/*
  exit 0
fi

mkdir -p /tmp/stage "$OUT"
case $step in
  A) bash .gpu-bundle/install-on-device.sh .gpu-bundle A || exit 3 ;;
  B) bash .gpu-bundle/install-on-device.sh .gpu-bundle B || exit 3
     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
       .gpu-bundle/whlC/*.whl || exit 3 ;;
esac
cp .gpu-stage/*/part.* /tmp/stage/ 2> /dev/null
[[ $step == vllm || $step == hf || $step == model ]] || { ls -la /tmp/stage; exit 0; }

export PYTHONPATH=/tmp/site:$PWD/src VLLM_WORKER_MULTIPROC_METHOD=spawn PYTHONUNBUFFERED=1
if [[ ! -f /tmp/stage/$GGUF ]]; then
  cat /tmp/stage/part.0 /tmp/stage/part.1 /tmp/stage/part.2 /tmp/stage/part.3 > "/tmp/stage/$GGUF"
fi
[[ $(sha256sum "/tmp/stage/$GGUF" | cut -d' ' -f1) == $(cat .gpu-stage/d/gguf.sha256) ]] \
  || { echo "the GGUF pieces do not reassemble (a call was lost): start again at A" >&2; exit 3; }
model=$(python3 -c "
from pathlib import Path; from eagle3_extract.models.smollm2 import build_smollm2
print(build_smollm2(root=Path('/tmp/real'), gguf=Path('/tmp/stage/$GGUF')))") || exit 3
sha256sum "$model/config.json"
if [[ $step == model ]]; then echo "$model" > /tmp/stage/model-dir; exit 0; fi
common=(model=smollm2 "model.path=$model" "dataset.max_samples=${HELDOUT:-160}"
        acceptance.max_tokens=128)
kit=('+engine.vllm_args.attention_config={backend:TRITON_ATTN}'
     '+engine.vllm_args.compilation_config={custom_ops:[none]}'
     model.gpu_memory_utilization=0.5)
if [[ $step == vllm ]]; then
  for kind in real control; do
    [[ -d .gpu-stage/d/drafter-$kind ]] || continue
    timeout 240 python3 -m eagle3_extract.drafter.acceptance "${common[@]}" \
      "drafter.dir=.gpu-stage/d/drafter-$kind" engine=vllm "${kit[@]}" \
      "output.dir=$OUT/vllm-$kind" > "$OUT/vllm-$kind.log" 2>&1
    echo "vllm $kind rc=$?"; grep -a eagle3-acceptance "$OUT/vllm-$kind.log" | tail -3
  done
else
  timeout 500 python3 -m eagle3_extract.drafter.acceptance "${common[@]}" \
    drafter.dir=.gpu-stage/d/drafter-real engine=hf acceptance.hf_dtype=bfloat16 \
    "output.dir=$OUT/hf-real" > "$OUT/hf-real.log" 2>&1
  echo "hf real rc=$?"; grep -a eagle3-acceptance "$OUT/hf-real.log" | tail -3
fi
