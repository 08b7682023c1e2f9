#!/usr/bin/env bash
# Start a Docker daemon for image builds when none answers, host networking only (no
# bridge: --bridge=none, no iptables), with its own data root, socket and pidfile.
#   eval "$(docker/dockerd.sh up)"   # prints DOCKER_HOST=...; starts one only if needed
#   docker/dockerd.sh down           # stops the daemon that `up` started (by its pid)
set -euo pipefail
DOCKER=${DOCKER_CLI:-/usr/bin/docker}
state=${EAGLE3_DOCKERD_STATE:-/run/eagle3-dockerd}
case ${1:-} in
up)
    if "$DOCKER" info > /dev/null 2>&1; then
        echo "# a Docker daemon already answers; using it" >&2
        exit 0
    fi
    mkdir -p "$state"
    sock="unix://$state/docker.sock"
    dockerd --host "$sock" --pidfile "$state/dockerd.pid" \
        --data-root "${EAGLE3_DOCKERD_ROOT:-/var/lib/eagle3-docker}" --exec-root "$state/exec" \
        --bridge=none --iptables=false --ip-masq=false --ip6tables=false \
        --storage-driver=overlay2 > "$state/dockerd.log" 2>&1 &
    for _ in $(seq 1 60); do
        if DOCKER_HOST=$sock "$DOCKER" info > /dev/null 2>&1; then
            echo "export DOCKER_HOST=$sock"
            exit 0
        fi
        sleep 1
    done
    echo "dockerd did not answer within 60 s; its log: $state/dockerd.log" >&2
    tail -20 "$state/dockerd.log" >&2
    exit 1
    ;;
down)
    if [[ -f $state/dockerd.pid ]]; then
        pid=$(cat "$state/dockerd.pid")
        kill "$pid" 2> /dev/null || true
        for _ in $(seq 1 30); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
        rm -f "$state/dockerd.pid"
    fi
    ;;
*)
    echo "usage: $0 up|down" >&2
    exit 2
    ;;
esac
