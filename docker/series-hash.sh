#!/usr/bin/env bash
# Print the patch-series hash, the same value as `eagle3-patches hash` and the manifest's
# "series_sha256" (src/eagle3_extract/patching.py: series_hash), without Python:
#   sha256( bytes of series, then for each patch in series order: name, NUL, bytes )
# Series lines are stripped; empty lines and lines starting with # are skipped. A listed
# patch that is missing, or a *.patch file that is not listed, is an error.
# The Makefile's `build` passes it to the image as a build arg (label); the Dockerfile
# recomputes it into BUILD_INFO.json and fails if the two differ.
#   docker/series-hash.sh [PATCHES_DIR]      (default: patches)
set -euo pipefail

dir=${1:-patches}
if [[ ! -f "$dir/series" ]]; then
    echo "series-hash: $dir/series not found" >&2
    exit 1
fi

names=()
while IFS= read -r line || [[ -n "$line" ]]; do
    # strip surrounding whitespace (as Python's str.strip)
    line="${line#"${line%%[![:space:]]*}"}"
    line="${line%"${line##*[![:space:]]}"}"
    [[ -z "$line" || "$line" == \#* ]] && continue
    if [[ ! -f "$dir/$line" ]]; then
        echo "series-hash: $dir/$line is listed in $dir/series but does not exist" >&2
        exit 1
    fi
    names+=("$line")
done < "$dir/series"

shopt -s nullglob
for path in "$dir"/*.patch; do
    listed=0
    for name in "${names[@]}"; do
        [[ "$name" == "${path##*/}" ]] && listed=1
    done
    if [[ $listed -eq 0 ]]; then
        echo "series-hash: ${path##*/} is not listed in $dir/series" >&2
        exit 1
    fi
done

sha256() {
    if command -v sha256sum > /dev/null 2>&1; then
        sha256sum
    else
        shasum -a 256
    fi
}

{
    cat "$dir/series"
    for name in "${names[@]}"; do
        printf '%s\0' "$name"
        cat "$dir/$name"
    done
} | sha256 | cut -d' ' -f1
