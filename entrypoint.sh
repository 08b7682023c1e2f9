#!/usr/bin/env bash
# Container entrypoint for eagle3-extract: dispatches a subcommand to the project's
# console scripts, replacing itself (exec) so that signals reach the job and its exit
# status is the container's. See `entrypoint.sh --help`.
#
# Executables are looked up on PATH, or in $EAGLE3_BIN_DIR when that is set (tests put
# recording stubs there).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: entrypoint.sh [SUBCOMMAND] [ARGS...]

subcommands:
  extract [OVERRIDES...]   run the extraction (default): eagle3-extract OVERRIDES
  regenerate [OVERRIDES]   the target's own answers first: eagle3-regenerate OVERRIDES
  sweep [OVERRIDES...]     Hydra multirun: eagle3-extract -m OVERRIDES
  verify DIR [OVERRIDES]   eagle3-verify: recompute samples of DIR with the reference engine
  validate DIR             eagle3-validate: check the files and manifest of DIR
  status DIR               eagle3-status: progress of a (running) extraction in DIR
  patches                  eagle3-patches status, then eagle3-patches check
  train [ARGS...]          speculators 0.9.0's trainer (its own environment):
                           speculators train ARGS, e.g. --data-path an eagle3-export dir
  drafter [OVERRIDES]      eagle3-train: a drafter vLLM 0.16 serves, from an extraction
  acceptance [OVERRIDES]   eagle3-acceptance: how many of a drafter's tokens are accepted
  test [PYTEST ARGS]       run the test suite shipped in the image (python -m pytest;
                           tests/FILE.py picks files of it)
  shell [BASH ARGS]        bash
  -h, --help               this text

Any other arguments are Hydra overrides for extract, e.g.
  entrypoint.sh model=tiny dataset.max_samples=3
EOF
}

# run NAME [ARGS...]: exec NAME from $EAGLE3_BIN_DIR if set, else from PATH.
run() {
    local name=$1
    shift
    if [[ -n "${EAGLE3_BIN_DIR:-}" ]]; then
        exec "${EAGLE3_BIN_DIR}/${name}" "$@"
    fi
    exec "$name" "$@"
}

# call NAME [ARGS...]: like run, without exec (status propagates through set -e).
call() {
    local name=$1
    shift
    if [[ -n "${EAGLE3_BIN_DIR:-}" ]]; then
        "${EAGLE3_BIN_DIR}/${name}" "$@"
    else
        "$name" "$@"
    fi
}

if [[ $# -eq 0 ]]; then
    set -- extract
fi

cmd=$1
case "$cmd" in
    -h | --help | help)
        usage
        exit 0
        ;;
    extract)
        shift
        run eagle3-extract "$@"
        ;;
    sweep)
        shift
        run eagle3-extract -m "$@"
        ;;
    regenerate)
        shift
        run eagle3-regenerate "$@"
        ;;
    verify)
        shift
        run eagle3-verify "$@"
        ;;
    validate)
        shift
        run eagle3-validate "$@"
        ;;
    status)
        shift
        run eagle3-status "$@"
        ;;
    patches)
        shift
        if [[ $# -gt 0 ]]; then
            echo "entrypoint.sh: 'patches' takes no arguments" >&2
            exit 2
        fi
        call eagle3-patches status
        run eagle3-patches check
        ;;
    test)
        shift
        root=${EAGLE3_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
        # tests/... names the shipped suite's files (resolved against it, wherever the
        # container's working dir is); without one, the whole suite.
        picked=() rest=()
        for a in "$@"; do
            if [[ $a == tests || $a == tests/* ]]; then picked+=("$root/$a"); else rest+=("$a"); fi
        done
        [[ ${#picked[@]} -eq 0 ]] && picked=("$root/tests")
        run python -m pytest -p no:cacheprovider "${picked[@]}" "${rest[@]}"
        ;;
    train)
        shift
        run speculators-0.9 train "$@"
        ;;
    drafter)
        shift
        run eagle3-train "$@"
        ;;
    acceptance)
        shift
        run eagle3-acceptance "$@"
        ;;
    shell)
        shift
        run bash "$@"
        ;;
    -*)
        echo "entrypoint.sh: unknown option '$cmd'" >&2
        usage >&2
        exit 2
        ;;
    *)
        # Hydra overrides (key=value, +key=value, ~key, ...) for extract.
        run eagle3-extract "$@"
        ;;
esac
