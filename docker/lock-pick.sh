#!/usr/bin/env bash
# Print the entries (pin and --hash lines) of the named packages from a hash-pinned lock
# file written by `uv pip compile --generate-hashes`, for a `pip install --require-hashes -r`.
# Used to bootstrap uv (and setuptools) from the same lock that pins everything else.
#   docker/lock-pick.sh requirements/cuda.lock uv setuptools > /tmp/bootstrap.txt
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 LOCKFILE PACKAGE..." >&2
    exit 2
fi
lock=$1
shift

awk -v names="$*" '
BEGIN {
    n = split(tolower(names), wanted, " ")
    for (i = 1; i <= n; i++) want[wanted[i]] = 1
}
/^[ \t]*#/ { next }
/^[A-Za-z0-9]/ {
    split($1, parts, "==")
    name = tolower(parts[1])
    keep = (name in want)
    if (keep) found[name] = 1
}
keep { print }
END {
    status = 0
    for (name in want) {
        if (!(name in found)) {
            print "lock-pick: " name " is not pinned in the lock file" > "/dev/stderr"
            status = 1
        }
    }
    exit status
}
' "$lock"
