#!/usr/bin/env bash
# Build the image (runtime and test targets) and prove it: smoke checks, the test suite
# inside it (compose profile `test`), and a build with a broken patch that must fail at the
# patch step naming the patch and hunk. `make image-test` runs it (and CI, through it).
#   IMAGE=eagle3-extract BASE_IMAGE=... COMPOSE_EXTRA=override.yml docker/image-test.sh
# IMAGE_TESTS="tests/test_a.py ...": run those files' CPU tests inside instead of the whole
# fast lane (CI: the host's fast lane runs them all from the same locks).
# EAGLE3_NO_BRIDGE=1: fail if any bridge network exists afterwards (hosts that forbid them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DOCKER=${DOCKER_CLI:-/usr/bin/docker}
IMAGE=${IMAGE:-eagle3-extract}
build_args=(--network=host)
[[ -n ${BASE_IMAGE:-} ]] && build_args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
series=$(docker/series-hash.sh patches)
build_args+=(--build-arg "PATCH_SERIES_SHA256=$series"
             --build-arg "GIT_COMMIT=$(git rev-parse HEAD 2> /dev/null || true)")
export DOCKER_BUILDKIT=1
step_start=$(date +%s)
step() {  # step NAME: print the time the previous step took, then the new step's name
    local now
    now=$(date +%s)
    echo "== image-test: $1 (previous step $((now - step_start)) s)"
    step_start=$now
}

step "build runtime and test targets"
"$DOCKER" build "${build_args[@]}" --target runtime -t "$IMAGE:latest" .
"$DOCKER" build "${build_args[@]}" --target test -t "$IMAGE:test" .

step "smoke checks of the runtime image"
run() { "$DOCKER" run --rm --network=host "$@"; }
run "$IMAGE:latest" --help | grep -q "eagle3-extract" || { echo "entrypoint --help failed" >&2; exit 1; }
run "$IMAGE:latest" patches > /dev/null
run --entrypoint python "$IMAGE:latest" -c "import vllm, torch, speculators, eagle3_extract"
uid=$(run --entrypoint id "$IMAGE:latest" -u)
[[ $uid != 0 ]] || { echo "the image runs as root" >&2; exit 1; }
run --entrypoint python "$IMAGE:latest" -c "
import json, os
info = json.load(open(os.environ['EAGLE3_BUILD_INFO']))
assert info['patch_series_sha256'] == '$series', info
print('BUILD_INFO ok:', info['versions']['vllm'], info['versions']['torch'])"
if run --entrypoint test "$IMAGE:latest" -d /opt/eagle3-extract/tests; then
    echo "the runtime image carries tests/" >&2; exit 1
fi
run --entrypoint test "$IMAGE:test" -f /opt/eagle3-extract/bench/throughput/run.py
# Captured first: grep -q closing the pipe early would fail the run under pipefail.
train_help=$(run "$IMAGE:latest" train --help 2>&1) || true
grep -q -- "--data-path" <<<"$train_help" \
    || { echo "the speculators 0.9.0 trainer does not start: ${train_help##*$'\n'}" >&2; exit 1; }

step "the test suite inside the image (compose profile test)"
compose=(-f docker-compose.yml)
[[ -n ${COMPOSE_EXTRA:-} ]] && compose+=(-f "$COMPOSE_EXTRA")
outputs=$(mktemp -d) && chmod 1777 "$outputs"
selection=()
if [[ -n ${IMAGE_TESTS:-} ]]; then
    read -r -a files <<< "$IMAGE_TESTS"
    selection=(test -q -m "not engine and not trainer" "${files[@]}")
fi
EAGLE3_TEST_IMAGE="$IMAGE:test" EAGLE3_HOST_OUTPUTS=$outputs \
    "$DOCKER" compose "${compose[@]}" --profile test run --rm test "${selection[@]}"

bridges=$("$DOCKER" network ls --filter driver=bridge -q)
if [[ -n $bridges && -n ${EAGLE3_NO_BRIDGE:-} ]]; then
    echo "a bridge network exists after the compose run; none may be created here" >&2
    exit 1
fi

step "a broken patch fails the build at the patch step"
broken=$(mktemp -d)
trap 'rm -rf "$broken"' EXIT
git ls-files -z 2> /dev/null | tar --null -T - -c | tar -C "$broken" -x \
    || cp -r . "$broken"
first=$(grep -v '^#' patches/series | head -1)
python3 - "$broken/patches/$first" <<'PY'
import sys
p = sys.argv[1]
text = open(p).read()
i = text.index("\n ", text.index("\n@@"))  # the first context line of the first hunk
open(p, "w").write(text[: i + 2] + "XX" + text[i + 2:])
PY
if "$DOCKER" build "${build_args[@]}" --progress=plain --target runtime "$broken" \
        > "$broken/build.log" 2>&1; then
    echo "the build with a broken $first succeeded" >&2; exit 1
fi
if ! grep -q "$first does not apply" "$broken/build.log" \
        || ! grep -q "Hunk #" "$broken/build.log"; then
    echo "the broken build failed, but not at the patch step:" >&2
    tail -20 "$broken/build.log" >&2
    exit 1
fi
echo "broken patch: the build failed at the patch step, naming $first and its hunk"
step "done"
