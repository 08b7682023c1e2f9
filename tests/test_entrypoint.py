"""entrypoint.sh as a program: subcommand dispatch, argument passing, exit codes.

The console scripts are replaced by stub executables placed first on PATH (or in
$EAGLE3_BIN_DIR). Each stub appends one JSON record (its name, argv, pid) to a log and
exits with the status given in STUB_RC_<name>.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRYPOINT = ROOT / "entrypoint.sh"
STUBS = ("eagle3-extract", "eagle3-verify", "eagle3-validate", "eagle3-status",
         "eagle3-patches", "python", "bash", "speculators-0.9", "eagle3-train",
         "eagle3-acceptance")

STUB = f"""#!{sys.executable}
import json, os, sys
name = os.path.basename(sys.argv[0])
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"name": name, "argv": sys.argv[1:], "pid": os.getpid()}}) + "\\n")
sys.exit(int(os.environ.get("STUB_RC_" + name.replace("-", "_"), "0")))
"""


@pytest.fixture
def stubs(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in STUBS:
        path = bindir / name
        path.write_text(STUB)
        path.chmod(0o755)
    return bindir


class Entrypoint:
    def __init__(self, bindir: Path, log: Path):
        self.bindir = bindir
        self.log = log

    def __call__(self, *args: str, via: str = "path", **env: str):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("EAGLE3_")}
        full_env["STUB_LOG"] = str(self.log)
        if via == "path":
            full_env["PATH"] = f"{self.bindir}{os.pathsep}{full_env['PATH']}"
        else:
            full_env["EAGLE3_BIN_DIR"] = str(self.bindir)
        full_env.update(env)
        # /bin/bash explicitly: a stub named bash on PATH must not run the script itself
        proc = subprocess.Popen(["/bin/bash", str(ENTRYPOINT), *args], env=full_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
        calls = ([json.loads(ln) for ln in self.log.read_text().splitlines()]
                 if self.log.exists() else [])
        if self.log.exists():
            self.log.unlink()
        return proc, out, err, calls


@pytest.fixture
def entry(stubs, tmp_path):
    return Entrypoint(stubs, tmp_path / "calls.jsonl")


def test_default_is_extract(entry):
    proc, _, _, calls = entry()
    assert proc.returncode == 0
    assert [(c["name"], c["argv"]) for c in calls] == [("eagle3-extract", [])]
    # exec: the job replaced the shell, so signals sent to the container's process reach it
    assert calls[0]["pid"] == proc.pid


@pytest.mark.parametrize("via", ["path", "bin_dir"])
@pytest.mark.parametrize(
    "args, name, argv",
    [
        (["extract", "model=tiny"], "eagle3-extract", ["model=tiny"]),
        (["sweep", "layers.ids=[1,2],[3,4]"], "eagle3-extract", ["-m", "layers.ids=[1,2],[3,4]"]),
        (["verify", "/data/outputs/run", "verify.samples=4"], "eagle3-verify",
         ["/data/outputs/run", "verify.samples=4"]),
        (["validate", "/data/outputs/run"], "eagle3-validate", ["/data/outputs/run"]),
        (["status", "/data/outputs/run"], "eagle3-status", ["/data/outputs/run"]),
        (["shell", "-c", "echo hi"], "bash", ["-c", "echo hi"]),
        (["drafter", "data.dir=/data/outputs/run"], "eagle3-train", ["data.dir=/data/outputs/run"]),
        (["acceptance", "drafter.dir=/d", "engine=vllm"], "eagle3-acceptance",
         ["drafter.dir=/d", "engine=vllm"]),
        # anything else: Hydra overrides for extract
        (["model=tiny", "dataset.max_samples=3"], "eagle3-extract",
         ["model=tiny", "dataset.max_samples=3"]),
        (["+engine.extra=1", "~dataset.hub_config"], "eagle3-extract",
         ["+engine.extra=1", "~dataset.hub_config"]),
        (["extract", "--cfg", "job"], "eagle3-extract", ["--cfg", "job"]),
    ],
)
def test_dispatch(entry, via, args, name, argv):
    proc, _, err, calls = entry(*args, via=via)
    assert proc.returncode == 0, err
    assert [(c["name"], c["argv"]) for c in calls] == [(name, argv)]
    assert calls[0]["pid"] == proc.pid


def test_arguments_pass_through_unchanged(entry):
    tricky = [
        "dataset.path=/data/datasets/my file.jsonl",
        "key=value with spaces",
        "quoted='single' and \"double\"",
        "dollar=$HOME `uname` $(id) *",
        "",
        "new\nline",
        "tab\there",
        "unicode=héllo",
        "--flag-after-the-subcommand",
    ]
    proc, _, err, calls = entry("extract", *tricky)
    assert proc.returncode == 0, err
    assert calls[0]["argv"] == tricky
    proc, _, err, calls = entry(*tricky[:3])
    assert proc.returncode == 0, err
    assert calls[0]["argv"] == tricky[:3]


@pytest.mark.parametrize("rc", [1, 2, 3, 42, 130])
@pytest.mark.parametrize("args, stub", [
    ([], "eagle3-extract"),
    (["sweep", "a=1"], "eagle3-extract"),
    (["verify", "d"], "eagle3-verify"),
    (["validate", "d"], "eagle3-validate"),
    (["status", "d"], "eagle3-status"),
])
def test_exit_code_propagates(entry, args, stub, rc):
    proc, _, _, _ = entry(*args, **{"STUB_RC_" + stub.replace("-", "_"): str(rc)})
    assert proc.returncode == rc


def test_patches_shows_status_then_checks(entry):
    proc, _, err, calls = entry("patches")
    assert proc.returncode == 0, err
    assert [(c["name"], c["argv"]) for c in calls] == [
        ("eagle3-patches", ["status"]), ("eagle3-patches", ["check"])]
    assert calls[0]["pid"] != proc.pid and calls[1]["pid"] == proc.pid

    proc, _, _, calls = entry("patches", STUB_RC_eagle3_patches="1")
    assert proc.returncode == 1
    assert [c["argv"] for c in calls] == [["status"]]  # no manifest: stop, non-zero

    proc, _, err, calls = entry("patches", "extra")
    assert proc.returncode == 2 and calls == [] and "no arguments" in err


def test_test_subcommand_runs_the_shipped_suite(entry, tmp_path):
    proc, _, err, calls = entry("test", "-q", "-m", "not engine", EAGLE3_HOME=str(tmp_path))
    assert proc.returncode == 0, err
    assert calls[0]["name"] == "python"
    assert calls[0]["argv"] == ["-m", "pytest", "-p", "no:cacheprovider", f"{tmp_path}/tests",
                                "-q", "-m", "not engine"]
    # without EAGLE3_HOME: the tests next to the script
    _, _, _, calls = entry("test")
    assert calls[0]["argv"][4] == f"{ROOT}/tests"
    # files of the suite named as the repository names them: those only, from the suite
    _, _, err, calls = entry("test", "-q", "tests/test_job.py", "tests/test_a.py::test_b",
                             EAGLE3_HOME=str(tmp_path))
    assert calls[0]["argv"] == ["-m", "pytest", "-p", "no:cacheprovider",
                                f"{tmp_path}/tests/test_job.py",
                                f"{tmp_path}/tests/test_a.py::test_b", "-q"], err


@pytest.mark.parametrize("flag", ["-h", "--help", "help"])
def test_help(entry, flag):
    proc, out, _, calls = entry(flag)
    assert proc.returncode == 0 and calls == []
    assert out.startswith("usage:")
    for sub in ("extract", "sweep", "verify", "validate", "status", "patches", "train", "shell"):
        assert sub in out


@pytest.mark.parametrize("flag", ["--bogus", "-x", "--cfg"])
def test_unknown_leading_flag_is_a_usage_error(entry, flag):
    proc, out, err, calls = entry(flag, "model=tiny")
    assert proc.returncode == 2
    assert calls == []
    assert f"unknown option '{flag}'" in err and "usage:" in err and out == ""


def test_missing_executable_fails(entry, stubs):
    (stubs / "eagle3-status").unlink()
    proc, _, _, _ = entry("status", "d", via="bin_dir")
    assert proc.returncode == 127


def test_script_is_strict_and_execs():
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert os.access(ENTRYPOINT, os.X_OK)


def test_train_runs_the_speculators_09_trainer(entry):
    proc, _, _, calls = entry("train", "--data-path", "/data/outputs/x/export")
    assert proc.returncode == 0
    assert calls == [{"name": "speculators-0.9",
                      "argv": ["train", "--data-path", "/data/outputs/x/export"]}] or (
        calls[0]["name"] == "speculators-0.9"
        and calls[0]["argv"][-3:] == ["train", "--data-path", "/data/outputs/x/export"])
