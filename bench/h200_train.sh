#!/usr/bin/env bash
# speculators 0.9.0's EAGLE-3 trainer on the H200 through eagle3-train (issue 28's GPU
# training step, here on the tiny model so that it needs no staged weights): the device's
# torch 2.11 and transformers 5.17, the trainer's own packages as wheels in their own
# site (.gpu-bundle/whlT, made by `bash bench/h200_train.sh wheels` here; the vLLM kit's
# site stays out of the trainer's path: it pins transformers 4.57), our own CLI on
# hydra/omegaconf and the product's datasets 4 (.gpu-bundle/whlC), never the trainer's site.
# One call, on a cold machine too:
#   carry .gpu-bundle/{whlC,whlT}  ->  bash bench/h200_train.sh
# The extraction runs on the HF engine on the GPU (no vLLM needed), then eagle3-train
# with train=small; $OUT gets the logs and the drafter's eagle3-train.json.
set -uo pipefail
if [[ ${1:-} == wheels ]]; then  # here: the trainer's packages the device lacks (train.lock's pins)
  # and whlC, our CLI's own (cpu.lock's pins: hydra, and datasets 4 for the export, which
  # fits the kit's huggingface-hub 0.36.2; the trainer's datasets 5.1.0 needs hub >= 1.31
  # and stays in the trainer's site, off our CLI's path)
  mkdir -p .gpu-bundle/whlC
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu-bundle/whlC hydra-core==1.3.2 omegaconf==2.3.0 \
    antlr4-python3-runtime==4.9.3 datasets==4.8.5 fsspec==2026.2.0 multiprocess==0.70.19 \
    dill==0.4.1 || exit $?
  mkdir -p .gpu-bundle/whlT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .gpu-bundle/whlT speculators==0.9.0 hs-connectors==0.9.0 \
    datasets==5.1.0 multiprocess==0.70.19 dill==0.4.1 pydantic==2.14.4 pydantic-core==2.50.5 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 loguru==0.7.3 openai==3.57.0 distro==1.9.0 \
    jiter==0.19.0 sniffio==1.3.1 typing-inspection==0.4.5 annotated-types==0.8.0 httpx2==2.16.2 \
    httpcore2==2.16.2
  exit $?
fi
OUT=${OUT:-/tmp/train-results}
mkdir -p "$OUT"
t0=$SECONDS
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pipi /tmp/site .gpu-bundle/whlC/*.whl || exit 3
pipi /tmp/train-site .gpu-bundle/whlT/*.whl || exit 3
printf '#!/bin/sh\nPYTHONPATH=/tmp/train-site exec python3 "$@"\n' > /tmp/train-python
chmod +x /tmp/train-python
export PYTHONPATH=/tmp/site:$PWD/src EAGLE3_CACHE=/tmp/eagle3-cache \
  EAGLE3_TRAIN_PYTHON=/tmp/train-python PYTHONUNBUFFERED=1
echo "== installed in $((SECONDS - t0)) s"
/tmp/train-python -c "import speculators, transformers, torch; from importlib.metadata import \
version; print('trainer env: speculators', version('speculators'), 'transformers', \
transformers.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 4
run=/tmp/train-smoke
t=$SECONDS
python3 -m eagle3_extract.cli model=tiny engine=hf dataset=sample "output.dir=$run/extract" \
  > "$OUT/extract.log" 2>&1
echo "== extract (hf engine) rc=$? in $((SECONDS - t)) s"; tail -2 "$OUT/extract.log"
t=$SECONDS
# speculators 0.9.0's fused Triton loss does not compile under the device's torch 2.11:
# dynamo asserts "ListVariable(length=21) is already tracked for mutation" on the loss
# kernel's autotune configs (a prune_configs_by kernel called twice in one trace,
# pytorch/pytorch#177600): the eager loss until a torch with that fix
EAGER_LOSS="train.extra_args=[--loss-implementation,eager]"
python3 -m eagle3_extract.drafter.train "data.dir=$run/extract" train=small "output.dir=$run/drafter" \
  ${TRAIN_ARGS:-$EAGER_LOSS} > "$OUT/train.log" 2>&1
echo "== train rc=$? in $((SECONDS - t)) s"; grep -v "^\s*$" "$OUT/train.log" | tail -25
cp "$run/drafter/drafter/eagle3-train.json" "$OUT/" 2> /dev/null
echo "== total $((SECONDS - t0)) s"
