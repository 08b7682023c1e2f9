# eagle3-extract GPU image: vLLM 0.16 + speculators 0.3.0 (patched) on CUDA 12.9.1,
# Python 3.12, for Hopper (sm90), Blackwell datacenter (sm100) and Blackwell RTX PRO /
# GeForce (sm120).
#
# Stages: `base` (everything the job needs), `test` (base + the test suite, tests/ and
# bench/: `docker compose --profile test`), `runtime` (the default target, what users run:
# no tests). Build with `make build`: it passes PATCH_SERIES_SHA256 (docker/series-hash.sh)
# and GIT_COMMIT, which end up in the image labels. `make image-test` builds both targets
# and runs the tests inside the image. Needs BuildKit (the default builder of
# Docker >= 23) for the cache mounts. Every version below is a build arg; the Python
# pins must equal requirements/cuda.lock (checked here at build time and by
# tests/test_container.py).

# Base image: CUDA 12.9.1 (what vLLM 0.16 is built and tested on; >= 12.8 is needed for
# sm120), -devel flavour because FlashInfer and Triton compile kernels at run time.
# Pinned by digest. Provenance of the digest: it is NOT resolved here (this project's
# build machines reach no registry); it is the manifest-list digest recorded for
# nvidia/cuda:12.9.1-devel-ubuntu24.04 in public repositories, e.g. the Dockerfile of
# github.com/Capsize-Games/airunner (commit 6a6c20662d46c956e49e62f251522e23faf9ca2f,
# "pinned to the digest of the manifest list resolved for
# nvidia/cuda:12.9.1-devel-ubuntu24.04"), and the same value in at least two other
# unrelated repositories' CI pins. Verify or refresh it on a host with registry access:
#   docker buildx imagetools inspect nvidia/cuda:12.9.1-devel-ubuntu24.04
ARG CUDA_VERSION=12.9.1
ARG BASE_IMAGE=nvidia/cuda:12.9.1-devel-ubuntu24.04@sha256:020bc241a628776338f4d4053fed4c38f6f7f3d7eb5919fecb8de313bb8ba47c

FROM ${BASE_IMAGE} AS base

# Python 3.12 is Ubuntu 24.04's own python3.
ARG PYTHON_VERSION=3.12
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# System packages: Python and its headers (Triton builds its launcher against Python.h at
# run time), a host C/C++ toolchain for nvcc (FlashInfer JIT), and `patch`. Versions come
# from the Ubuntu archive of the pinned base image's release.
# hadolint ignore=DL3008
RUN --mount=type=cache,target=/var/cache/apt,sharing=locked \
    --mount=type=cache,target=/var/lib/apt,sharing=locked \
    rm -f /etc/apt/apt.conf.d/docker-clean \
    && apt-get update \
    && apt-get install -y --no-install-recommends \
        "python${PYTHON_VERSION}" "python${PYTHON_VERSION}-dev" "python${PYTHON_VERSION}-venv" \
        build-essential ca-certificates patch \
    && "python${PYTHON_VERSION}" --version

# A virtual environment owned by root (read-only for the job), with uv bootstrapped by pip
# from the same hash-pinned lock as everything else.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    UV_HTTP_TIMEOUT=500 \
    UV_LINK_MODE=copy \
    UV_COMPILE_BYTECODE=1 \
    UV_PYTHON_DOWNLOADS=never \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/eagle3-extract
COPY docker/lock-pick.sh docker/lock-pick.sh
COPY requirements/cuda.lock requirements/cuda-nodeps.lock requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    "python${PYTHON_VERSION}" -m venv /opt/venv \
    && docker/lock-pick.sh requirements/cuda.lock uv setuptools > /tmp/bootstrap.txt \
    && /opt/venv/bin/python -m pip install --require-hashes --no-deps -r /tmp/bootstrap.txt \
    && rm /tmp/bootstrap.txt \
    && uv --version

# vLLM, torch and every other Python dependency, hash-checked against requirements/cuda.lock
# (uv pip compile for Python 3.12, x86_64-manylinux_2_31). The one sdist in the lock
# (antlr4-python3-runtime, for omegaconf) builds with the locked setuptools: no build
# isolation, so no unpinned build dependency is fetched.
ARG VLLM_VERSION=0.16.0
ARG TORCH_VERSION=2.9.1
RUN --mount=type=cache,target=/root/.cache/uv \
    grep -q "^vllm==${VLLM_VERSION} " requirements/cuda.lock \
    && grep -q "^torch==${TORCH_VERSION} " requirements/cuda.lock \
    && uv pip install --require-hashes --no-build-isolation -r requirements/cuda.lock

# Optional: swap in a vLLM nightly wheel, e.g. a build of the 0.16 line, by URL and sha256
# (both required). It is installed --no-deps on top of the 0.16.0 dependency set, so it
# must be compatible with torch ${TORCH_VERSION}. Empty (default): vLLM ${VLLM_VERSION}.
ARG VLLM_WHEEL_URL=""
ARG VLLM_WHEEL_SHA256=""
RUN --mount=type=cache,target=/root/.cache/uv \
    if [ -n "${VLLM_WHEEL_URL}" ]; then \
        if ! printf '%s' "${VLLM_WHEEL_SHA256}" | grep -Eqx '[0-9a-f]{64}'; then \
            echo "VLLM_WHEEL_URL needs VLLM_WHEEL_SHA256 (64 hex digits)" >&2; exit 1; \
        fi; \
        echo "vllm @ ${VLLM_WHEEL_URL} --hash=sha256:${VLLM_WHEEL_SHA256}" > /tmp/vllm-wheel.txt \
        && uv pip install --require-hashes --no-deps --reinstall-package vllm \
            -r /tmp/vllm-wheel.txt \
        && rm /tmp/vllm-wheel.txt; \
    fi

# speculators 0.3.0 without its dependencies (its `datagen` extra pins vllm==0.11.0; the
# runtime requirements it needs are in cuda.in / cuda.lock).
ARG SPECULATORS_VERSION=0.3.0
RUN --mount=type=cache,target=/root/.cache/uv \
    grep -q "^speculators==${SPECULATORS_VERSION} " requirements/cuda-nodeps.lock \
    && uv pip install --require-hashes --no-deps -r requirements/cuda-nodeps.lock

# speculators 0.9.0's trainer in its own environment (it needs transformers >= 5, which
# cannot share the vLLM 0.16 one): /opt/venv-train from requirements/train-cuda.lock, with
# speculators and hs-connectors --no-deps (train-nodeps.lock; their torchvision/torchaudio
# requirements are not imported by the training code). torch is /opt/venv's (CUDA, 2.9.1,
# as speculators 0.9.0 allows), on the path after the trainer's own packages.
COPY requirements/train-cuda.lock requirements/train-nodeps.lock requirements/
RUN --mount=type=cache,target=/root/.cache/uv \
    "python${PYTHON_VERSION}" -m venv /opt/venv-train \
    && uv pip install --python /opt/venv-train/bin/python --require-hashes --no-deps \
        -r requirements/train-cuda.lock \
    && docker/lock-pick.sh requirements/train-nodeps.lock speculators hs-connectors \
        > /tmp/train-nodeps.txt \
    && uv pip install --python /opt/venv-train/bin/python --require-hashes --no-deps \
        -r /tmp/train-nodeps.txt \
    && rm /tmp/train-nodeps.txt \
    && echo "/opt/venv/lib/python${PYTHON_VERSION}/site-packages" \
        > "/opt/venv-train/lib/python${PYTHON_VERSION}/site-packages/zz-torch-of-opt-venv.pth" \
    && ln -s /opt/venv-train/bin/speculators /usr/local/bin/speculators-0.9 \
    && /opt/venv-train/bin/python -c "import speculators.train.data, transformers, torch; \
print('trainer env: transformers', transformers.__version__, 'torch', torch.__version__)"

# The project, in the repository layout (the Hydra conf/ directory is found relative to
# the source tree), installed editable without dependencies.
COPY pyproject.toml ./
COPY conf/ conf/
COPY src/ src/
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install --no-deps --no-build-isolation -e . \
    && python -m compileall -q src \
    && python -c "import eagle3_extract"

# Our patch series, applied by the same program CI runs (`eagle3-patches apply`, i.e.
# `python -m eagle3_extract.patching apply`): it exits non-zero if any patch does not
# apply, and `check` re-verifies the result, so the build fails unless all applied.
COPY patches/ patches/
RUN eagle3-patches apply \
    && eagle3-patches check \
    && python -m compileall -q \
        "$(python -c 'import importlib.util as u; print(u.find_spec("speculators").submodule_search_locations[0])')"

# BUILD_INFO.json: installed versions, patch-series hash (recomputed here and compared with
# the PATCH_SERIES_SHA256 build arg that labels the image), base image digest, git commit.
ARG BASE_IMAGE
ARG PATCH_SERIES_SHA256=""
ARG GIT_COMMIT=""
COPY docker/ docker/
RUN if [ -z "${VLLM_WHEEL_URL}" ]; then set -- --expect "vllm=${VLLM_VERSION}"; else set --; fi; \
    python docker/build-info.py --out /opt/eagle3-extract/BUILD_INFO.json \
        --series-hash "$(docker/series-hash.sh patches)" \
        --expected-series-hash "${PATCH_SERIES_SHA256}" \
        --base-image "${BASE_IMAGE}" \
        --git-commit "${GIT_COMMIT}" \
        --vllm-wheel-url "${VLLM_WHEEL_URL}" \
        "$@" \
        --expect "torch=${TORCH_VERSION}" \
        --expect "speculators=${SPECULATORS_VERSION}"

COPY entrypoint.sh entrypoint.sh

# The job's user (not root). APP_UID/APP_GID default to 1000, the usual first user of a
# Linux host, so bind-mounted host directories are writable; compose can also run the
# container as the host user (EAGLE3_UID/EAGLE3_GID), which the sticky world-writable
# data directories (and home) allow. Ubuntu 24.04's preinstalled `ubuntu` user (uid 1000)
# is removed.
ARG APP_UID=1000
ARG APP_GID=1000
RUN if id ubuntu > /dev/null 2>&1; then userdel --remove ubuntu || true; fi \
    && if getent group ubuntu > /dev/null; then groupdel ubuntu; fi \
    && groupadd --gid "${APP_GID}" eagle3 \
    && useradd --create-home --uid "${APP_UID}" --gid eagle3 --shell /bin/bash eagle3 \
    && mkdir -p /data/hf-cache /data/outputs /data/datasets /data/cache \
    && chown eagle3:eagle3 /data/hf-cache /data/outputs /data/datasets /data/cache \
    && chmod 1777 /data/hf-cache /data/outputs /data/cache /home/eagle3

# Runtime environment.
#  - HF_HOME: Hugging Face cache (models, tokenizers, hub datasets): a volume.
#  - EAGLE3_OUTPUT_ROOT: where the job writes extractions, manifests and Hydra logs.
#  - /data/datasets: local datasets, mounted read-only.
#  - /data/cache: kernel caches (FlashInfer JIT, Triton, vLLM, torch inductor) and the
#    embedded tiny models (EAGLE3_CACHE); a named volume in docker-compose.yml so JIT
#    compilation happens once per host.
#  - no usage statistics are sent (batch job; GPU hosts are often offline).
#  - VLLM_WORKER_MULTIPROC_METHOD=spawn: CUDA cannot be re-initialised in forked workers.
#  - TORCH_CUDA_ARCH_LIST: any torch extension built at run time covers sm90, sm100 and
#    sm120 (+PTX). FlashInfer's JIT compiles for the GPUs it finds.
ARG TORCH_CUDA_ARCH_LIST="9.0 10.0 12.0+PTX"
ENV HF_HOME=/data/hf-cache \
    EAGLE3_OUTPUT_ROOT=/data/outputs \
    EAGLE3_DATASET_ROOT=/data/datasets \
    EAGLE3_HOME=/opt/eagle3-extract \
    EAGLE3_BUILD_INFO=/opt/eagle3-extract/BUILD_INFO.json \
    EAGLE3_CACHE=/data/cache/eagle3-extract \
    EAGLE3_TRAIN_PYTHON=/opt/venv-train/bin/python \
    XDG_CACHE_HOME=/data/cache \
    VLLM_CACHE_ROOT=/data/cache/vllm \
    TRITON_CACHE_DIR=/data/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/data/cache/torchinductor \
    FLASHINFER_WORKSPACE_BASE=/data/cache \
    VLLM_WORKER_MULTIPROC_METHOD=spawn \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    CUDA_HOME=/usr/local/cuda \
    PYTHONUNBUFFERED=1 \
    HOME=/home/eagle3 \
    USER=eagle3

ARG VLLM_VERSION
ARG TORCH_VERSION
ARG SPECULATORS_VERSION
ARG CUDA_VERSION
LABEL org.opencontainers.image.title="eagle3-extract" \
      org.opencontainers.image.description="EAGLE-3 training data (per-token hidden states) from vLLM 0.16 prefill" \
      org.opencontainers.image.revision="${GIT_COMMIT}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.eagle3-extract.cuda.version="${CUDA_VERSION}" \
      io.eagle3-extract.python.version="${PYTHON_VERSION}" \
      io.eagle3-extract.vllm.version="${VLLM_VERSION}" \
      io.eagle3-extract.vllm.wheel-url="${VLLM_WHEEL_URL}" \
      io.eagle3-extract.torch.version="${TORCH_VERSION}" \
      io.eagle3-extract.speculators.version="${SPECULATORS_VERSION}" \
      io.eagle3-extract.patch-series.sha256="${PATCH_SERIES_SHA256}"

VOLUME ["/data/hf-cache", "/data/outputs"]
USER ${APP_UID}:${APP_GID}
# Relative paths (e.g. Hydra's default run directory) land in the outputs volume.
WORKDIR /data/outputs
# SIGINT lets the job finish its in-flight writes (files are renamed into place atomically
# and a rerun resumes); compose gives it stop_grace_period.
STOPSIGNAL SIGINT
ENTRYPOINT ["/opt/eagle3-extract/entrypoint.sh"]
CMD ["extract"]

# --- test: the suite and the files it checks (entrypoint.sh test, compose profile test) ---
FROM base AS test
WORKDIR /opt/eagle3-extract
COPY tests/ tests/
COPY bench/ bench/
COPY requirements/ requirements/
COPY Makefile Dockerfile docker-compose.yml .dockerignore ./
WORKDIR /data/outputs

# --- runtime (default target): the job, no tests ---
FROM base AS runtime
