#!/usr/bin/env bash
# CI only: a stand-in for the pinned CUDA base (no registry is reachable here): Ubuntu
# 24.04 (noble, Python 3.12 like the CUDA image) made with debootstrap, plus this machine's
# TLS-intercepting proxy CA so pip/uv reach PyPI from inside the build. The CA is copied at
# build time (it is regenerated at machine start) and never goes into the image users build
# (their base is the pinned CUDA image). No CUDA here: the Dockerfile's steps need none.
#   .ci/standin-base.sh [TAG]      (default eagle3-standin:noble; reused when present)
set -euo pipefail
tag=${1:-eagle3-standin:noble}
DOCKER=${DOCKER_CLI:-/usr/bin/docker}
if "$DOCKER" image inspect "$tag" > /dev/null 2>&1; then
    echo "stand-in base $tag: present"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
# The gutsy script carries Ubuntu's default mirror; the keyring is Debian's ubuntu-keyring.
if ! debootstrap --variant=minbase --keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg \
        --include=ca-certificates noble "$work/rootfs" "" /usr/share/debootstrap/scripts/gutsy \
        > "$work/debootstrap.log" 2>&1; then
    echo "debootstrap of Ubuntu noble failed (is Ubuntu's archive reachable from here?):" >&2
    tail -15 "$work/debootstrap.log" >&2
    exit 1
fi
tar -C "$work/rootfs" -c . | "$DOCKER" import - eagle3-standin-rootfs:noble > /dev/null
mkdir -p "$work/ctx"
cp /usr/local/share/ca-certificates/*.crt "$work/ctx/" 2> /dev/null || true
cat > "$work/ctx/Dockerfile" <<'DF'
FROM eagle3-standin-rootfs:noble
COPY *.crt /usr/local/share/ca-certificates/
# The components and pockets of a stock Ubuntu image (debootstrap writes `main` only),
# on the mirror debootstrap used.
RUN update-ca-certificates > /dev/null \
    && line=$(grep -m1 '^deb ' /etc/apt/sources.list) \
    && { for pocket in "" -updates -security; do \
           echo "$line" | sed -E "s/ noble main$/ noble$pocket main restricted universe multiverse/"; \
         done; } > /etc/apt/sources.list.new \
    && mv /etc/apt/sources.list.new /etc/apt/sources.list
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt UV_NATIVE_TLS=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
DF
ls "$work/ctx"/*.crt > /dev/null 2>&1 || touch "$work/ctx/none.crt"
DOCKER_BUILDKIT=1 "$DOCKER" build -q --network=host -t "$tag" "$work/ctx" > /dev/null
echo "stand-in base $tag: built in $(($(date +%s) - t0)) s"
