#!/usr/bin/env bash
# CI only: what `make image-test` needs on this machine kind (Debian 12): Docker 20.10 from
# Debian, BuildKit's CLI plugin and Compose v2 from Debian 13 (they need only libc6 >= 2.34;
# Debian 12's own docker-compose 1.29 cannot parse the compose file), debootstrap and the
# Ubuntu archive keyring (Debian 13's ubuntu-keyring) for the stand-in base image.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! grep -rqs "trixie" /etc/apt/sources.list /etc/apt/sources.list.d/; then
    cat > /etc/apt/sources.list.d/eagle3-ci-trixie.sources <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    # Nothing comes from trixie unless asked for by name below.
    printf 'Package: *\nPin: release n=trixie\nPin-Priority: 100\n' \
        > /etc/apt/preferences.d/eagle3-ci-trixie
fi
apt-get update -q
apt-get install -y -q --no-install-recommends docker.io debootstrap ca-certificates
apt-get install -y -q --no-install-recommends -t trixie docker-buildx docker-compose ubuntu-keyring
/usr/bin/docker --version
/usr/bin/docker buildx version
/usr/bin/docker compose version
