#!/usr/bin/env bash
# bench/device/gpu.py's train step: speculators 0.9.0's EAGLE-3 trainer on the H200 through
# eagle3-train, on the tiny model (no staged weights, no vLLM): the extraction runs on the
# HF engine on the GPU, then eagle3-train with train=small in the trainer's own site
# (EAGLE3_TRAIN_PYTHON, bench/device/gpu_sites.py PATHS["trainer"]). TRAIN_ARGS replaces the
# trainer overrides (default: the eager loss).
set -uo pipefail
t0=$SECONDS
"$EAGLE3_TRAIN_PYTHON" -c "import speculators, transformers, torch; from importlib.metadata import \
version; print('trainer env: speculators', version('speculators'), 'transformers', \
transformers.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" || exit 4
run=/tmp/gpu/train-smoke
t=$SECONDS
python3 -m eagle3_extract.cli model=tiny engine=hf dataset=sample "output.dir=$run/extract" \
  > "$RESULTS/extract.log" 2>&1
echo "== extract (hf engine) rc=$? in $((SECONDS - t)) s"; tail -2 "$RESULTS/extract.log"
t=$SECONDS
# speculators 0.9.0's fused Triton loss does not compile under the device's torch 2.11:
# dynamo asserts "ListVariable(length=21) is already tracked for mutation" on the loss
# kernel's autotune configs (a prune_configs_by kernel called twice in one trace,
# pytorch/pytorch#177600): the eager loss until a torch with that fix
EAGER_LOSS="train.extra_args=[--loss-implementation,eager]"
# shellcheck disable=SC2086  # TRAIN_ARGS: several overrides, split on spaces
python3 -m eagle3_extract.drafter.train "data.dir=$run/extract" train=small \
  "output.dir=$run/drafter" ${TRAIN_ARGS:-$EAGER_LOSS} > "$RESULTS/train.log" 2>&1
echo "== train rc=$? in $((SECONDS - t)) s"; grep -v "^\s*$" "$RESULTS/train.log" | tail -25
cp "$run/drafter/drafter/eagle3-train.json" "$RESULTS/" 2> /dev/null
echo "== total $((SECONDS - t0)) s"
