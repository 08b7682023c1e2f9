#!/usr/bin/env bash
# The Makefile's job runner (make extract / sweep / verify): runs the job in the image
# through docker compose when a Docker daemon answers and `nvidia-smi` works, else in the
# local virtual environment (created first with `make venv`).
#
#   docker/make-job.sh extract|regenerate|sweep|verify [HYDRA OVERRIDES...]
#
# Environment (the Makefile exports it):
#   RUNNER   auto (default) | docker | local
#   DATASET  a file (contains / or ends in .jsonl/.json/.parquet): dataset=local
#            dataset.path=FILE; else a dataset config name: dataset=DATASET
#   MODEL    model=MODEL
#   DIR      the extraction directory (verify)
#   VENV (.venv), DOCKER (docker), COMPOSE ("$DOCKER compose"), MAKE (make),
#   EAGLE3_HOST_OUTPUTS/_DATASETS/_HF_CACHE: host directories compose mounts.
set -euo pipefail

usage() {
    echo "usage: $0 extract|regenerate|sweep|verify [HYDRA OVERRIDES...]" >&2
    exit 2
}
[[ $# -ge 1 ]] || usage
job=$1
shift

case "$job" in
    extract | regenerate | sweep) ;;
    verify)
        if [[ -z "${DIR:-}" ]]; then
            echo 'usage: make verify DIR=<extraction dir> [ARGS="overrides"]' >&2
            exit 2
        fi
        ;;
    *) usage ;;
esac

runner=${RUNNER:-auto}
venv=${VENV:-.venv}
docker_cmd=${DOCKER:-docker}
read -r -a compose <<< "${COMPOSE:-$docker_cmd compose}"

case "$runner" in
    docker) in_image=1 ;;
    local) in_image=0 ;;
    auto)
        if "$docker_cmd" info > /dev/null 2>&1 && nvidia-smi > /dev/null 2>&1; then
            in_image=1
        else
            in_image=0
        fi
        ;;
    *)
        echo "RUNNER must be auto, docker or local, not '$runner'" >&2
        exit 2
        ;;
esac

abspath() {
    local dir
    dir=$(cd "$(dirname "$1")" && pwd)
    printf '%s/%s' "$dir" "$(basename "$1")"
}

# Overrides from DATASET and MODEL, and, in the image, a mount for a host dataset file.
overrides=()
mounts=()
if [[ -n "${DATASET:-}" ]]; then
    case "$DATASET" in
        */* | *.jsonl | *.json | *.parquet)
            path=$DATASET
            if [[ -f "$DATASET" ]]; then
                path=$(abspath "$DATASET")
                if [[ $in_image -eq 1 ]]; then
                    mounts+=(-v "$(dirname "$path"):/data/datasets/host:ro")
                    path=/data/datasets/host/$(basename "$path")
                fi
            fi
            overrides+=(dataset=local "dataset.path=$path")
            ;;
        *)
            overrides+=("dataset=$DATASET")
            ;;
    esac
fi
if [[ -n "${MODEL:-}" ]]; then
    overrides+=("model=$MODEL")
fi

if [[ $in_image -eq 1 ]]; then
    # Bind-mount sources are created here (owned by the caller), not by the daemon (root).
    mkdir -p "${EAGLE3_HOST_OUTPUTS:-./outputs}" "${EAGLE3_HOST_DATASETS:-./datasets}" \
        "${EAGLE3_HOST_HF_CACHE:-$HOME/.cache/huggingface}"
    case "$job" in
        extract)
            cmd=("${compose[@]}" run --rm "${mounts[@]}" extract extract)
            ;;
        regenerate)
            cmd=("${compose[@]}" run --rm "${mounts[@]}" regenerate regenerate)
            ;;
        sweep)
            cmd=("${compose[@]}" --profile sweep run --rm "${mounts[@]}" sweep sweep)
            ;;
        verify)
            cmd=("${compose[@]}" run --rm -v "$(abspath "$DIR"):/data/verify" extract
                verify /data/verify)
            ;;
    esac
else
    "${MAKE:-make}" --no-print-directory venv VENV="$venv"
    case "$job" in
        extract) cmd=("$venv/bin/eagle3-extract") ;;
        regenerate) cmd=("$venv/bin/eagle3-regenerate") ;;
        sweep) cmd=("$venv/bin/eagle3-extract" -m) ;;
        verify) cmd=("$venv/bin/eagle3-verify" "$DIR") ;;
    esac
fi

cmd+=("${overrides[@]}" "$@")
printf '+'
printf ' %q' "${cmd[@]}"
printf '\n'
exec "${cmd[@]}"
