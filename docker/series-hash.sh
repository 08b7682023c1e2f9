#!/usr/bin/env bash
# Print the patch-series hash: the sha256 of `sha256sum series <each patch listed in series,
# in series order>` run inside the patches directory (default: patches/). The Makefile's
# `build` passes it to the image as a build arg (label), the Dockerfile recomputes it into
# BUILD_INFO.json and fails if the two differ, and tests/test_container.py checks the
# definition. A patch listed in the series but missing is an error.
set -euo pipefail

dir=${1:-patches}
if [[ ! -f "$dir/series" ]]; then
    echo "series-hash: $dir/series not found" >&2
    exit 1
fi

sha256() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$@"
    else
        shasum -a 256 "$@"
    fi
}

files=(series)
while read -r name _ || [[ -n "${name:-}" ]]; do
    name=${name%$'\r'}
    [[ -z "$name" || "$name" == \#* ]] && continue
    if [[ ! -f "$dir/$name" ]]; then
        echo "series-hash: $dir/$name is listed in $dir/series but does not exist" >&2
        exit 1
    fi
    files+=("$name")
done < "$dir/series"

(cd "$dir" && sha256 -- "${files[@]}") | sha256 | cut -d' ' -f1
