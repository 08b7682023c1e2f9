"""The container definition agrees with the locks, the patch series and the job.

No Docker engine is needed: the Dockerfile, compose file and .dockerignore are parsed
as text/YAML and checked against requirements/cuda*.lock, patches/ and pyproject.toml;
the helper scripts in docker/ are run for real.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
CUDA_LOCK = ROOT / "requirements" / "cuda.lock"
CUDA_NODEPS_LOCK = ROOT / "requirements" / "cuda-nodeps.lock"
CUDA_IN = ROOT / "requirements" / "cuda.in"
PATCHES = ROOT / "patches"


# --- parsing helpers ----------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_args() -> dict[str, str]:
    """Default values of every ARG that has one (global and stage)."""
    args: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip().strip('"')
    return args


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env


def run_commands() -> list[str]:
    return [rest for word, rest in dockerfile_instructions() if word == "RUN"]


def lock_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^ \\;]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def lock_entries(path: Path) -> dict[str, list[str]]:
    """name -> the --hash values of its entry."""
    entries: dict[str, list[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        if re.match(r"^[A-Za-z0-9]", line):
            current = re.split(r"[=\[ ]", line, maxsplit=1)[0].lower()
            entries[current] = re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
        elif current and "--hash=" in line:
            entries[current] += re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
        elif not line.startswith(" "):
            current = None
    return entries


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def series_names() -> list[str]:
    lines = [ln.strip() for ln in (PATCHES / "series").read_text().splitlines()]
    return [n for n in lines if n and not n.startswith("#")]


# --- pins: Dockerfile == locks ------------------------------------------------------------
def test_dockerfile_pins_equal_the_lock_files():
    args = dockerfile_args()
    cuda = lock_pins(CUDA_LOCK)
    nodeps = lock_pins(CUDA_NODEPS_LOCK)
    assert args["VLLM_VERSION"] == cuda["vllm"] == "0.16.0"
    assert args["TORCH_VERSION"] == cuda["torch"] == "2.9.1"
    assert args["SPECULATORS_VERSION"] == nodeps["speculators"] == "0.3.0"
    # speculators comes --no-deps from its own lock, never resolved with its vllm==0.11 pin
    assert "speculators" not in cuda


def test_every_locked_requirement_has_a_hash():
    for path in (CUDA_LOCK, CUDA_NODEPS_LOCK):
        entries = lock_entries(path)
        assert entries, path
        unhashed = [name for name, hashes in entries.items() if not hashes]
        assert not unhashed, f"{path.name}: no --hash for {unhashed}"


def test_cuda_lock_is_the_documented_resolution():
    header = CUDA_LOCK.read_text().splitlines()[1]
    for flag in ("--python-version 3.12", "--python-platform x86_64-manylinux_2_31",
                 "--generate-hashes", "requirements/cuda.in"):
        assert flag in header
    pins = lock_pins(CUDA_LOCK)
    assert pins["datasets"].split(".")[0] == "4"  # datasets>=5 needs huggingface-hub>=1.31
    assert int(pins["huggingface-hub"].split(".")[0]) < 1  # transformers<5 needs <1.0
    assert int(pins["transformers"].split(".")[0]) < 5
    assert pins["hydra-core"] == "1.3.2"
    assert "hydra-submitit-launcher" in pins
    assert "flashinfer-python" in pins  # vllm 0.16's attention backend on sm90/sm120
    # speculators 0.3.0's runtime requirements (it is installed --no-deps)
    for name in ("accelerate", "click", "datasets", "httpx", "loguru", "pydantic-settings",
                 "rich", "typer-slim", "safetensors"):
        assert name in pins, name
    # every direct input of cuda.in is pinned in the lock
    for line in CUDA_IN.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name = re.split(r"[<>=!\[ ]", line, maxsplit=1)[0].lower()
            assert name in pins, name


def test_base_image_is_cuda_12_9_devel_pinned_by_digest():
    args = dockerfile_args()
    base = args["BASE_IMAGE"]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-devel-ubuntu(\d+\.\d+)@sha256:[0-9a-f]{64}",
                     base)
    assert m, base
    assert (int(m.group(1)), int(m.group(2))) >= (12, 8)  # sm120 needs CUDA >= 12.8
    assert args["CUDA_VERSION"] == ".".join(m.group(1, 2, 3))
    froms = [rest for word, rest in dockerfile_instructions() if word == "FROM"]
    assert froms[0] == "${BASE_IMAGE} AS base"  # every stage builds on the pinned base
    assert args["PYTHON_VERSION"] == "3.12"


def test_tests_live_in_the_test_stage_and_runtime_is_the_default_target():
    """As vLLM's Dockerfile: the test suite (tests/, bench/) only in a `test` stage; the
    last stage, what `docker build` and compose's extract service build, carries none."""
    stages: dict[str, list[tuple[str, str]]] = {}
    name = None
    for word, rest in dockerfile_instructions():
        if name is None and word != "FROM":
            continue  # global ARGs
        if word == "FROM":
            name = rest.split(" AS ")[-1]
            stages[name] = [(word, rest)]
        else:
            stages[name].append((word, rest))
    assert list(stages) == ["base", "test", "runtime"]
    copies = {n: [r.split()[0] for w, r in ins if w == "COPY"] for n, ins in stages.items()}
    assert {"tests/", "bench/"} <= set(copies["test"])
    assert not {"tests/", "bench/"} & set(copies["base"] + copies["runtime"])
    assert stages["test"][0][1] == stages["runtime"][0][1].replace("runtime", "test")
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert compose["services"]["test"]["build"]["target"] == "test"
    assert "target" not in compose["services"]["extract"]["build"]


def test_runtime_environment():
    env = dockerfile_env()
    assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    arch = dockerfile_args()["TORCH_CUDA_ARCH_LIST"]
    assert env["TORCH_CUDA_ARCH_LIST"] == "${TORCH_CUDA_ARCH_LIST}"
    assert "12.0" in arch.split() or "12.0+PTX" in arch.split()
    assert env["HF_HOME"] == "/data/hf-cache"
    assert env["EAGLE3_OUTPUT_ROOT"] == "/data/outputs"
    instructions = dockerfile_instructions()
    user = [rest for word, rest in instructions if word == "USER"]
    assert user and user[-1] not in ("root", "0", "0:0")
    assert user[-1] == "${APP_UID}:${APP_GID}" and dockerfile_args()["APP_UID"] != "0"
    entry = [rest for word, rest in instructions if word == "ENTRYPOINT"]
    assert json.loads(entry[-1]) == ["/opt/eagle3-extract/entrypoint.sh"]
    assert any(w == "COPY" and r == "entrypoint.sh entrypoint.sh" for w, r in instructions)
    assert (ROOT / "entrypoint.sh").stat().st_mode & 0o111


def test_python_dependencies_install_from_the_hash_pinned_locks():
    runs = " ".join(run_commands())
    assert "uv pip install --require-hashes --no-build-isolation -r requirements/cuda.lock" in runs
    assert "uv pip install --require-hashes --no-deps -r requirements/cuda-nodeps.lock" in runs
    assert "--require-hashes --no-deps -r /tmp/bootstrap.txt" in runs  # uv itself
    # the nightly swap needs both the URL and the sha256
    assert "--hash=sha256:${VLLM_WHEEL_SHA256}" in runs
    assert {"VLLM_WHEEL_URL", "VLLM_WHEEL_SHA256"} <= set(dockerfile_args())


# --- patches ------------------------------------------------------------------------------
def test_dockerfile_runs_the_patch_program_ci_runs():
    # The console script CI and `make venv` call is the module the contract names.
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["eagle3-patches"] == "eagle3_extract.patching:main"
    assert "$(VENV)/bin/eagle3-patches apply" in (ROOT / "Makefile").read_text()

    instructions = dockerfile_instructions()
    runs = [i for i, (w, r) in enumerate(instructions) if w == "RUN"]
    patch_run = [i for i in runs if "eagle3-patches apply" in instructions[i][1]]
    assert len(patch_run) == 1
    idx = patch_run[0]
    cmd = instructions[idx][1]
    # apply, then check, chained with && so any failure fails the build
    assert re.search(r"eagle3-patches apply\s*&&\s*eagle3-patches check", cmd)
    # ... after speculators is installed and the patches are copied in
    spec = [i for i in runs if "cuda-nodeps.lock" in instructions[i][1]]
    copy_patches = [i for i, (w, r) in enumerate(instructions)
                    if w == "COPY" and r == "patches/ patches/"]
    assert spec and spec[0] < idx and copy_patches and copy_patches[0] < idx


def test_series_and_patch_files_agree():
    names = series_names()
    assert names, "patches/series lists no patch"
    assert len(names) == len(set(names))
    for name in names:
        assert (PATCHES / name).is_file(), f"{name} is in patches/series but missing"
    on_disk = {p.name for p in PATCHES.iterdir() if p.suffix in (".patch", ".diff")}
    assert on_disk == set(names), f"not listed in series: {sorted(on_disk - set(names))}"


def _python_series_hash(patches: Path) -> str:
    h = hashlib.sha256((patches / "series").read_bytes())
    lines = [ln.strip() for ln in (patches / "series").read_text().splitlines()]
    for name in (n for n in lines if n and not n.startswith("#")):
        h.update(name.encode() + b"\0" + (patches / name).read_bytes())
    return h.hexdigest()


def series_hash_sh(patches: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "docker" / "series-hash.sh"), str(patches)],
                          capture_output=True, text=True)


def test_series_hash_script_matches_the_patch_program():
    res = series_hash_sh(PATCHES)
    assert res.returncode == 0, res.stderr
    value = res.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", value)
    assert value == _python_series_hash(PATCHES)
    from eagle3_extract import patching  # installed editable: the source tree's file

    assert Path(patching.__file__).resolve() == ROOT / "src" / "eagle3_extract" / "patching.py"
    assert value == patching.series_hash(PATCHES)


def test_series_hash_script_on_a_scratch_series(tmp_path):
    (tmp_path / "series").write_text("# comment\n\n a.patch \nb.patch")  # no final newline
    (tmp_path / "a.patch").write_text("--- a/x\n+++ b/x\n")
    (tmp_path / "b.patch").write_bytes(b"binary\0content\n")
    first = series_hash_sh(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == _python_series_hash(tmp_path)

    (tmp_path / "b.patch").write_bytes(b"binary\0content changed\n")
    assert series_hash_sh(tmp_path).stdout.strip() not in ("", first.stdout.strip())

    (tmp_path / "c.patch").write_text("unlisted\n")
    res = series_hash_sh(tmp_path)
    assert res.returncode != 0 and "not listed" in res.stderr
    (tmp_path / "c.patch").unlink()

    (tmp_path / "series").write_text("a.patch\nmissing.patch\n")
    res = series_hash_sh(tmp_path)
    assert res.returncode != 0 and "missing.patch" in res.stderr
    assert series_hash_sh(tmp_path / "nowhere").returncode != 0


def test_build_passes_the_series_hash_and_build_info_checks_it():
    make = (ROOT / "Makefile").read_text()
    assert "series=$$(docker/series-hash.sh patches)" in make
    assert "--build-arg PATCH_SERIES_SHA256=$$series" in make
    runs = " ".join(run_commands())
    assert '--series-hash "$(docker/series-hash.sh patches)"' in runs
    assert '--expected-series-hash "${PATCH_SERIES_SHA256}"' in runs
    labels = " ".join(r for w, r in dockerfile_instructions() if w == "LABEL")
    for value in ("${PATCH_SERIES_SHA256}", "${VLLM_VERSION}", "${TORCH_VERSION}",
                  "${SPECULATORS_VERSION}", "${GIT_COMMIT}", "${BASE_IMAGE}"):
        assert value in labels


def _build_info_module():
    spec = importlib.util.spec_from_file_location("_build_info", ROOT / "docker" / "build-info.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_build_info_records_and_refuses_mismatches(tmp_path, monkeypatch, capsys):
    mod = _build_info_module()
    series = "a" * 64
    monkeypatch.setattr(mod, "patch_manifest", lambda: {"series_sha256": series})
    out = tmp_path / "BUILD_INFO.json"
    base = "nvidia/cuda:12.9.1-devel-ubuntu24.04@sha256:" + "b" * 64
    pytest_version = mod.metadata.version("pytest")
    common = ["--out", str(out), "--series-hash", series, "--base-image", base,
              "--git-commit", "abc123", "--expect", f"pytest={pytest_version}"]
    assert mod.main(common + ["--expected-series-hash", series]) == 0
    info = json.loads(out.read_text())
    assert info["patch_series_sha256"] == series
    assert info["base_image_digest"] == "sha256:" + "b" * 64
    assert info["git_commit"] == "abc123"
    assert set(info["versions"]) >= {"vllm", "torch", "speculators", "eagle3-extract"}

    out.unlink()
    assert mod.main(common + ["--expected-series-hash", "c" * 64]) == 1  # stale label
    assert mod.main(common + ["--expect", "pytest=0.0.1"]) == 1  # installed != pin
    monkeypatch.setattr(mod, "patch_manifest", lambda: None)
    assert mod.main(common) == 1  # patches not applied
    monkeypatch.setattr(mod, "patch_manifest", lambda: {"series_sha256": "d" * 64})
    assert mod.main(common) == 1  # applied another series
    assert not out.exists()
    assert "build-info:" in capsys.readouterr().err


def test_lock_pick_extracts_hash_pinned_entries(tmp_path):
    script = str(ROOT / "docker" / "lock-pick.sh")
    res = subprocess.run(["bash", script, str(CUDA_LOCK), "uv", "setuptools"],
                         capture_output=True, text=True, check=True)
    picked = tmp_path / "picked.txt"
    picked.write_text(res.stdout)
    assert set(lock_pins(picked)) == {"uv", "setuptools"}
    assert lock_pins(picked) == {k: lock_pins(CUDA_LOCK)[k] for k in ("uv", "setuptools")}
    assert all(lock_entries(picked).values())
    assert lock_pins(ROOT / "requirements" / "cpu.lock")["uv"] == lock_pins(CUDA_LOCK)["uv"]
    res = subprocess.run(["bash", script, str(CUDA_LOCK), "no-such-package"],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "no-such-package" in res.stderr


# --- compose: volumes match where the job writes ------------------------------------------
def _targets(service: dict) -> dict[str, str]:
    """container path -> mode ('rw'/'ro') of the service's volumes (short syntax,
    "${VAR:-default}:/target[:mode]")."""
    out = {}
    for vol in service["volumes"]:
        m = re.fullmatch(r"(.+):(/[^:]+)(?::(ro|rw))?", vol)
        assert m, vol
        out[m.group(2)] = m.group(3) or "rw"
    return out


def test_compose_volumes_are_where_the_job_writes():
    env = dockerfile_env()
    services = compose()["services"]
    for name in ("extract", "sweep", "test"):
        svc = services[name]
        targets = _targets(svc)
        assert targets[env["HF_HOME"]] == "rw"
        assert targets[env["EAGLE3_OUTPUT_ROOT"]] == "rw"
        assert targets["/data/datasets"] == "ro"
        assert env["EAGLE3_DATASET_ROOT"] == "/data/datasets"
        # the job's environment in compose agrees with the image
        for key in ("HF_HOME", "EAGLE3_OUTPUT_ROOT", "EAGLE3_DATASET_ROOT"):
            assert svc["environment"][key] == env[key]
        # every kernel cache lives on the cache volume
        for key in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                    "FLASHINFER_WORKSPACE_BASE", "XDG_CACHE_HOME", "EAGLE3_CACHE"):
            assert env[key].startswith("/data/cache"), key
        assert "/data/cache" in targets
    # the image's VOLUMEs are mounted by compose
    volumes = [json.loads(r) for w, r in dockerfile_instructions() if w == "VOLUME"]
    assert volumes and set(volumes[0]) <= set(_targets(services["extract"]))


def test_compose_gpu_service():
    doc = compose()
    extract = doc["services"]["extract"]
    assert "profiles" not in extract
    devices = extract["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert extract["ipc"] == "host"
    assert extract["ulimits"]["memlock"] == -1 and extract["ulimits"]["stack"] >= 67108864
    assert extract["init"] is True
    env = extract["environment"]
    # passed through from the host only when set there: no value in the file
    assert "HF_TOKEN" in env and env["HF_TOKEN"] is None
    assert "NCCL_P2P_DISABLE" in env and env["NCCL_P2P_DISABLE"] is None
    assert extract["command"] == "extract ${EXTRACT_ARGS:-}"
    assert doc["services"]["sweep"]["profiles"] == ["sweep"]
    assert doc["services"]["sweep"]["command"].split()[0] == "sweep"
    assert doc["services"]["test"]["profiles"] == ["test"]
    assert doc["services"]["test"]["command"][0] == "test"
    # the suite's /dev/shm check needs a namespace whose every process it can see
    assert doc["services"]["test"]["ipc"] == "private"
    # the tests run in the same Dockerfile's `test` stage: the runtime image + tests/, bench/
    build_x, build_t = doc["services"]["extract"]["build"], doc["services"]["test"]["build"]
    assert {**build_x, "target": "test"} == build_t


# --- build context ------------------------------------------------------------------------
def _dockerignore_regex(pattern: str) -> re.Pattern:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out += pattern[i:j + 1]
            i = j + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def dockerignored(path: str, rules: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a parent directory
    matches everything below it."""
    prefixes = [path] + ["/".join(path.split("/")[:k]) for k in range(1, path.count("/") + 1)]
    ignored = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        rx = _dockerignore_regex(pattern.strip("/"))
        if any(rx.fullmatch(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_dockerfile_copies():
    rules = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    copied: list[str] = []
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            copied += rest.split()[:-1]
    assert copied
    for src in copied:
        src = src.rstrip("/")
        assert (ROOT / src).exists(), src
        files = [src] if (ROOT / src).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / src).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and ".egg-info" not in str(p)]
        for f in files:
            assert not dockerignored(f, rules), f"{f} is COPY'd but excluded by .dockerignore"
    for junk in (".venv/bin/python", ".git/HEAD", "outputs/run/x.safetensors",
                 "src/eagle3_extract/__pycache__/x.pyc", "src/eagle3_extract.egg-info/PKG-INFO",
                 "datasets/big.jsonl", "multirun/x/.hydra/config.yaml"):
        assert dockerignored(junk, rules), junk


def test_scripts_are_executable_and_strict():
    scripts = [ROOT / "entrypoint.sh", *sorted((ROOT / "docker").glob("*.sh"))]
    in_checkout = (ROOT / ".git").exists()  # the image ships no .ci/
    if in_checkout:
        scripts += [ROOT / ".ci" / "run", *sorted((ROOT / ".ci").glob("*.sh"))]
    for path in scripts:
        assert path.stat().st_mode & 0o111, f"{path} is not executable"
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), path
        assert "set -euo pipefail" in text, path
    if in_checkout:
        text = (ROOT / ".ci" / "run").read_text()
        # The image and the environments start first (downloads); lane B (the fast lane
        # and the pipelines from when .venv exists, the trainer half and the drafter check
        # once the trainers' environments do) beside lane A (the vLLM half, from then);
        # every background stream is waited for, its failure failing CI; the costs table
        # is printed at the end, passed or failed.
        order = [text.index(s) for s in ('bg "image" 10 image', '" make venv\n',
                                         'bg "environments of the trainers" 0',
                                         "OMP_NUM_THREADS=1", "make pipeline ",
                                         '" make lint ||', '" make test PYTEST_ARGS=',
                                         'make test-engine TESTS=', 'bg "lane B',
                                         'collect "environments of the trainers"',
                                         'make test-engine PYTEST', 'collect "lane B',
                                         'collect "image"', "\ncosts\n")]
        assert order == sorted(order), order
        assert text.count("measure.py stage") == 1 and text.count("stage \"") >= 8
        assert "trap finish EXIT" in text  # the table on a failure too
        # The image's own test run names files that exist (pytest would stop on one gone).
        picked = re.findall(r"tests/test_\w+\.py", text[: text.index("make image-test IMAGE")])
        assert len(picked) >= 3 and all((ROOT / f).is_file() for f in picked), picked
        # vLLM's step watchdog is raised before any engine stream starts.
        assert text.index("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=") < text.index('" make test PYTEST_ARGS=')
