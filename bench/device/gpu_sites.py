"""The Python environments the GPU driver (bench/device/gpu.py) layers on the H200 machine, and
their rehearsal here: which packages each process sees, in its path's order, and whether
every package's own requirements hold there.

The device has its own torch 2.11 / transformers 5.17 site; the driver installs wheel
groups into sites of its own (SITES, in install order: a later group replaces a package of
the same name, as `pip install --upgrade --target` does) and each process puts some of them
ahead of the device's site (PATHS). The first copy of a package on a path is the one
imported, so a conflict is a requirement that the first copy does not meet, e.g. the
trainer's datasets 5.1.0 (huggingface-hub >= 1) behind the vLLM kit's hub 0.36.2 (the
`BucketNotFoundError` seen on the device). `resolve` finds those from the wheels' own
METADATA and the device's `pip list --format=freeze` (tests/fixtures/h200-pip-freeze.txt),
here, before GPU time is spent.

    python3 bench/device/gpu.py sites record   # after rebuilding .gpu-bundle: the fixture of its metadata
    python3 bench/device/gpu.py sites check    # the conflicts of every process's path (exit 1 if any)
"""

from __future__ import annotations

import email.parser
import hashlib
import re
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".gpu-bundle"
FIXTURES = ROOT / "tests" / "fixtures"
METADATA_FIXTURE = FIXTURES / "gpu-bundle-metadata.json"
DEVICE_FREEZE = FIXTURES / "h200-pip-freeze.txt"
DEVICE_PYTHON = "3.12"

# wheel group (a folder or the kit's zip under .gpu-bundle) -> the site it is installed into,
# in install order
SITES: dict[str, str] = {
    "whlA": "/tmp/site",  # the vLLM kit: transformers 4.57, xgrammar, tokenizers
    "whlB": "/tmp/site",  # the vLLM kit: what vLLM 0.16 imports that the device lacks
    "vllm016-py.zip": "/tmp/site",  # vLLM 0.16's Python code, its _C stubbed
    "whlC": "/tmp/site",  # our CLI: hydra, omegaconf, the product's datasets 4
    "whlT": "/tmp/train-site",  # speculators 0.9.0's trainer: datasets 5, pydantic, ...
}
# each process's path ahead of the device's own site-packages, in order ("src": our code)
PATHS: dict[str, list[str]] = {
    "cli": ["/tmp/site", "src"],  # eagle3-extract, -regenerate, -train's driver, -acceptance
    "trainer": ["/tmp/train-site"],  # `speculators train` (EAGLE3_TRAIN_PYTHON)
}
# requirements the kit leaves unmet on purpose, each with why no GPU step trips on it (the
# rehearsal fails on any other): vLLM's wheel pins the torch stack it was built for, while
# the kit runs its Python over the device's torch 2.11 with no compiled kernels
# (../shared/tools/h200-vllm016/README.md), and leaves out what only its API server imports
_KIT_TORCH = "the kit runs vLLM's Python over the device's torch 2.11 (no compiled kernels)"
_SERVER = "imported by vLLM's API server and tool parsers only; the steps use the LLM class"
_SPEC03 = ("speculators 0.3.0 rides in the kit's bundle for the image's patch tests; no GPU "
           "step imports it (the engine is ours, the trainer is 0.9.0 in its own site)")
ACCEPTED: dict[tuple[str, str], str] = {
    **{("vllm", dep): _KIT_TORCH for dep in ("torch", "torchaudio", "torchvision", "xformers",
                                              "flashinfer-python", "numba", "ray")},
    **{("vllm", dep): _SERVER for dep in ("watchfiles", "python-json-logger", "ijson",
                                           "anthropic", "model-hosting-container-standards",
                                           "mcp", "grpcio-reflection")},
    ("vllm", "setuptools"): "vLLM pins setuptools < 81 for building its kernels; the kit "
                            "builds none (the device's 81.0.0 only serves pkg_resources)",
    ("mistral-common", "numpy"): "imported only for Mistral tokenizers; SmolLM2 and the "
                                 "tiny models use transformers' tokenizers",
    **{("speculators==0.3.0", dep): _SPEC03 for dep in ("deepspeed", "pydantic-settings",
                                                  "typer-slim")},
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _group_files(group: str, bundle: Path) -> list[Path]:
    p = bundle / group
    return sorted(p.glob("*.whl")) if p.is_dir() else [p]


def _dists_in(path: Path) -> list[dict]:
    """Name, version and Requires-Dist of each distribution a wheel or the kit's zip holds."""
    out = []
    with zipfile.ZipFile(path) as z:
        for member in z.namelist():
            if member.count("/") == 1 and member.endswith(".dist-info/METADATA"):
                msg = email.parser.Parser().parsestr(z.read(member).decode())
                out.append({"name": canonical(msg["Name"]), "version": msg["Version"],
                            "requires": msg.get_all("Requires-Dist") or []})
    return out


def record(bundle: Path = BUNDLE) -> dict:
    """The metadata of every wheel group, with each file's sha256 (the fixture)."""
    groups = {}
    for group in SITES:
        files = _group_files(group, bundle)
        if not files or not all(f.is_file() for f in files):
            raise SystemExit(f"gpu_sites: {bundle / group} is missing: build the bundle first "
                             "(python3 bench/device/gpu.py bundle)")
        groups[group] = [{"file": f.name, "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                          "dists": _dists_in(f)} for f in files]
    return {"python": DEVICE_PYTHON, "groups": groups}


def device_freeze(path: Path = DEVICE_FREEZE) -> dict[str, str]:
    """The device's own packages, from `python3 -m pip list --format=freeze` there."""
    out = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            out[canonical(name)] = version
    return out


def visible(path_name: str, meta: dict, base: dict[str, str]) -> dict[str, tuple[str, str, list]]:
    """name -> (version, where, requires) of the copy a process on PATHS[path_name] imports."""
    sites: dict[str, dict[str, tuple[str, str, list]]] = {}
    for group, site in SITES.items():  # install order: a later group replaces a package
        for f in meta["groups"][group]:
            for d in f["dists"]:
                sites.setdefault(site, {})[d["name"]] = (d["version"], f"{site} ({group})",
                                                         d["requires"])
    seen: dict[str, tuple[str, str, list]] = {}
    for entry in PATHS[path_name]:
        for name, dist in sites.get(entry, {}).items():
            seen.setdefault(name, dist)
    for name, version in base.items():
        seen.setdefault(name, (version, "the device's site", []))
    return seen


def resolve(path_name: str, meta: dict, base: dict[str, str]) -> list[str]:
    """One line per requirement that the first copy on the path does not meet."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = {"python_version": DEVICE_PYTHON, "python_full_version": DEVICE_PYTHON + ".3",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "extra": ""}
    seen = visible(path_name, meta, base)
    problems = []
    for name, (version, where, requires) in sorted(seen.items()):
        for spec in requires:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canonical(req.name)
            if (name, dep) in ACCEPTED or (f"{name}=={version}", dep) in ACCEPTED:
                continue
            if dep not in seen:
                problems.append(f"{path_name}: {name} {version} ({where}) needs {spec}: "
                                "not on the path")
                continue
            have, have_where, _ = seen[dep]
            if req.specifier and not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{path_name}: {name} {version} ({where}) needs {req.name}"
                                f"{req.specifier}, the path has {have} first ({have_where})")
    return problems


def check(meta: dict, base: dict[str, str]) -> list[str]:
    return [p for path_name in PATHS for p in resolve(path_name, meta, base)]


def pythonpath(path_name: str, repo: Path) -> str:
    """PATHS[path_name] as the device's PYTHONPATH (src relative to the checkout there)."""
    return ":".join(str(repo / e) if e == "src" else e for e in PATHS[path_name])
