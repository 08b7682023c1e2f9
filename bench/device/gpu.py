"""One driver for every experiment on the H200 machine: stage its pieces here, then calls
there that install them, run the experiment's step (resumable) and bring its results back.

    here:   python3 bench/device/gpu.py bundle              # the wheel groups (.gpu-bundle), once
            python3 bench/device/gpu.py sites record|check  # their metadata; the sites' conflicts
            python3 bench/device/gpu.py plan EXPERIMENT     # stage .gpu-stage/, check the sites, print the calls
                [--drafters DIR]  (acceptance: an e2e out dir)  [--no-rehearsal]  (before a
                device package list exists: call 1 brings it back)  [--models a,b]  (the
                real targets, models/real.py's names; default smollm2)
    there:  python3 bench/device/gpu.py call EXPERIMENT N   # call N of the plan, as the plan prints it
            python3 bench/device/gpu.py call EXPERIMENT run # the step again: it continues where a call stopped
    here:   python3 bench/device/gpu.py collect EXPERIMENT FILES_AT   # unpack a call's results

Why one driver: a call carries at most 64 MiB and the machine forgets /tmp 30 s after a
call, so every experiment stages the same way (the vLLM kit's wheels, our CLI's, the
trainer's, a model's GGUF in pieces) over calls made back to back. `plan` packs the pieces
into calls in install order and records each piece's sha256; `call` checks what it was
carried and what earlier calls installed (a cold machine is one line: start at call 1),
installs into the sites bench/device/gpu_sites.py declares (the same declaration the CPU rehearsal
checks), and on the last call runs bench/device/steps/EXPERIMENT.sh with the call's time left.
Everything the step writes under $RESULTS comes back as one archive.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_sites  # noqa: E402  (stdlib only until `check`)

BUNDLE, STAGE = ROOT / ".gpu-bundle", ROOT / ".gpu-stage"
DEVICE = Path(os.environ.get("GPU_DRIVER_DIR", "/tmp/gpu"))  # the device's state, in /tmp
CALL_BYTES = 62 * 2**20  # of the 64 MiB a call carries (the checkout counted in: _tree_bytes)
MAX_CARRY = 8
CALL_LIMIT_S = 600
MODELS = ["smollm2"]  # the real targets a "model" piece stages (plan --models)

KIT = ["whlA", "whlB", "vllm016-py.zip", "whlC"]
# experiment -> the pieces its step needs, in install order ("model": each target's GGUF in
# parts, staged as <name>.gguf; ".bench-tok", "drafters", ".kernels/...": folders as they are)
EXPERIMENTS: dict[str, list[str]] = {
    "e2e": [*KIT, "whlT", "model"],  # the regeneration ratio, then the drafter chain
    "acceptance": [*KIT, "model", "drafters"],  # vLLM's EAGLE-3 (and our loop) on drafters
    "bench": [*KIT, ".bench-tok"],  # the 8B shape's phases, HF, writer profile, regen
    "train": ["whlC", "whlT"],  # the trainer on the tiny model, no vLLM
    "capture": [*KIT, ".kernels/vllm016-csrc.tar.gz"],  # vLLM's own kernels (the kernel kit)
    "kimi": [*KIT, ".kernels/vllm016-csrc.tar.gz"],  # a Kimi-K2.5 TP rank and PP stage
}
# wheel groups for `bundle` beyond the vLLM kit's own (build-bundle.sh): our CLI's (cpu.lock's
# pins; datasets 4 fits the kit's huggingface-hub 0.36.2) and the trainer's (train.lock's)
WHEELS = {
    "whlC": ["hydra-core==1.3.2", "omegaconf==2.3.0", "datasets==4.8.5", "fsspec==2026.2.0",
             "multiprocess==0.70.19", "dill==0.4.1"],
    "whlT": ["speculators==0.9.0", "hs-connectors==0.9.0", "datasets==5.1.0",
             "multiprocess==0.70.19", "dill==0.4.1", "pydantic==2.14.4", "pydantic-core==2.50.5",
             "pydantic-settings==2.16.3", "python-dotenv==1.2.4", "loguru==0.7.3",
             "openai==3.57.0", "distro==1.9.0", "jiter==0.19.0", "sniffio==1.3.1",
             "typing-inspection==0.4.5", "annotated-types==0.8.0", "httpx2==2.16.2",
             "httpcore2==2.16.2", "truststore==0.10.5"],
}
SDIST_ONLY = {"whlC": ["antlr4-python3-runtime==4.9.3"]}  # pure Python, built into a wheel here


def say(msg: str) -> None:
    print(f"gpu: {msg}", flush=True)


def sha256_of(path: Path) -> str:
    """A file's sha256, or a folder's: of its files' relative names and contents, sorted."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() \
        else path.stat().st_size


# --- here ----------------------------------------------------------------------------------
def bundle() -> int:
    if not (BUNDLE / "whlB").is_dir():
        kit = ROOT.parent / "shared" / "tools" / "h200-vllm016" / "build-bundle.sh"
        subprocess.run(["bash", str(kit), str(BUNDLE)], check=True)
    for group, specs in WHEELS.items():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                        "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
                        "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(BUNDLE / group), *specs], check=True)
    for group, specs in SDIST_ONLY.items():
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(BUNDLE / group), *specs], check=True)
    say(f"bundle ready in {BUNDLE.relative_to(ROOT)}; record its metadata for the rehearsal "
        "with `python3 bench/device/gpu.py sites record`")
    return 0


def _tree_bytes() -> int:
    """What the checkout itself sends each call (tracked and untracked-not-ignored files)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names
               if n and (ROOT / n.decode()).is_file())


def _model_gguf(name: str) -> Path:
    """A real target's GGUF here (models/real.py; the Qwen parts are fetched once)."""
    venv = ROOT / ".venv" / "bin" / "python"
    r = subprocess.run([str(venv), "-c", "import sys; from eagle3_extract.models.real "
                        "import local_gguf; print(local_gguf(sys.argv[1]))", name],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"gpu: {name}'s GGUF is not here ({tail}): `make venv` first")
    return Path(r.stdout.strip())


def _piece_path(name: str) -> Path:
    if name in gpu_sites.SITES:
        return BUNDLE / name
    if name == "drafters":
        return STAGE / "drafters"
    return ROOT / name


def _stage_drafters(src: Path) -> None:
    """The drafters an e2e run trained, without their embeddings (the target's own)."""
    from safetensors.torch import load_file, save_file

    dst = STAGE / "drafters"
    shutil.rmtree(dst, ignore_errors=True)
    for kind in ("real", "control"):
        d = src / f"drafter-{kind}" / "drafter"
        if not (d / "model.safetensors").is_file():
            continue
        (dst / kind).mkdir(parents=True)
        w = load_file(str(d / "model.safetensors"))
        w.pop("embed_tokens.weight")  # a frozen copy of the target's; vLLM shares it
        save_file(w, str(dst / kind / "model.safetensors"))
        for name in ("config.json", "eagle3-train.json"):
            if (d / name).exists():
                shutil.copy2(d / name, dst / kind / name)
    if not dst.is_dir():
        raise SystemExit(f"gpu: no drafter under {src}/drafter-{{real,control}}/drafter")


def plan(experiment: str, drafters: Path | None = None, rehearse: bool = True,
         models: list[str] | None = None) -> list[dict]:
    """Pack the experiment's pieces into calls; write .gpu-stage/<exp>/plan.json."""
    models = models or MODELS
    pieces = [p for n in EXPERIMENTS[experiment]
              for p in ([f"model:{m}" for m in models] if n == "model" else [n])]
    for name in pieces:
        if name in gpu_sites.SITES and not _piece_path(name).exists():
            raise SystemExit(f"gpu: {BUNDLE.name}/{name} is missing: `python3 bench/device/gpu.py bundle`")
    if "drafters" in pieces:
        if drafters is None:
            raise SystemExit("gpu: plan acceptance needs --drafters DIR (an e2e run's out dir)")
        _stage_drafters(drafters)
    if rehearse and any(n in gpu_sites.SITES for n in pieces):  # the rehearsal: sites as the device has them
        if not gpu_sites.DEVICE_FREEZE.is_file():
            raise SystemExit(f"gpu: {gpu_sites.DEVICE_FREEZE.relative_to(ROOT)} is missing: "
                             "every call 1 brings the device's back (device-pip-freeze.txt)")
        problems = gpu_sites.check(gpu_sites.record(BUNDLE), gpu_sites.device_freeze())
        if problems:
            raise SystemExit("gpu: the sites conflict (bench/device/gpu.py sites check):\n  "
                             + "\n  ".join(problems))
    cap = (CALL_BYTES - _tree_bytes()) // 2**20 * 2**20  # whole MiB: parts stay put
    calls: list[list[dict]] = [[]]
    room = cap
    parts_dir = STAGE / "parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    for name in pieces:
        if name.startswith("model:"):
            model = name.split(":", 1)[1]
            gguf = _model_gguf(model)
            (parts_dir / model).mkdir(parents=True, exist_ok=True)
            data_left, k = gguf.stat().st_size, 0
            with open(gguf, "rb") as src:
                while data_left:
                    if room < 2**20 or len(calls[-1]) >= MAX_CARRY - 1:
                        calls.append([])
                        room = cap
                    n = min(room, data_left)
                    part = parts_dir / model / f"part.{k}"
                    part.write_bytes(src.read(n))
                    calls[-1].append({"name": f"{model} part {k}", "kind": "part",
                                      "path": str(part.relative_to(ROOT)), "bytes": n,
                                      "sha256": sha256_of(part)})
                    room -= n
                    data_left -= n
                    k += 1
            calls[-1][-1]["whole"] = {"file": f"{model}.gguf", "sha256": sha256_of(gguf),
                                      "parts": k}
            continue
        path = _piece_path(name)
        if not path.exists():
            raise SystemExit(f"gpu: {path.relative_to(ROOT)} is missing (the experiment "
                             f"{experiment} needs it)")
        n = size_of(path)
        if n > cap:
            raise SystemExit(f"gpu: {path.relative_to(ROOT)} is {n >> 20} MiB, over the "
                             f"{cap >> 20} MiB a call carries beside the checkout")
        if n > room or len(calls[-1]) >= MAX_CARRY - 1:
            calls.append([])
            room = cap
        kind = ("zip" if name.endswith(".zip") else "wheels") if name in gpu_sites.SITES \
            else "dir"
        calls[-1].append({"name": name, "kind": kind, "path": str(path.relative_to(ROOT)),
                          "bytes": n, "sha256": sha256_of(path), "site": gpu_sites.SITES.get(name)})
        room -= n
    out = STAGE / experiment
    out.mkdir(parents=True, exist_ok=True)
    record = {"experiment": experiment, "models": models, "calls": calls,
              "made": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (out / "plan.json").write_text(json.dumps(record, indent=1) + "\n")
    plan_rel = str((out / "plan.json").relative_to(ROOT))
    for i, call in enumerate(calls, 1):
        carry = [plan_rel, *(p["path"] for p in call)]
        mib = sum(p["bytes"] for p in call) / 2**20
        say(f"call {i}/{len(calls)} ({mib:.0f} MiB): carry {json.dumps(carry)} -> "
            f"python3 bench/device/gpu.py call {experiment} {i}")
    if any(p.startswith("model:") for p in pieces):
        say(f"targets {', '.join(models)}: the step sees MODELS={' '.join(models)!r} and "
            "$GPU_STAGE/<name>.gguf")
    say(f"then, to continue a step its call's time stopped: carry {json.dumps([plan_rel])} -> "
        f"python3 bench/device/gpu.py call {experiment} run")
    return calls


def collect(experiment: str, files_at: Path) -> int:
    dst = ROOT / "outputs" / "gpu" / experiment
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(files_at.iterdir()):
        if f.name.endswith(".tar.gz"):
            with tarfile.open(f) as t:
                t.extractall(dst, filter="data")
        else:
            shutil.copy2(f, dst / f.name)
    say(f"results in {dst.relative_to(ROOT)}")
    return 0


# --- there ---------------------------------------------------------------------------------
def _installed() -> dict[str, str]:
    f = DEVICE / "installed.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _pip_target(site: str, wheels: list[Path]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--no-cache-dir", "--upgrade", "--target", site,
                    *map(str, wheels)], check=True)


def install(piece: dict) -> None:
    path = ROOT / piece["path"]
    if not path.exists():
        raise SystemExit(f"gpu: {piece['path']} was not carried: name it in this call's carry")
    if sha256_of(path) != piece["sha256"]:
        raise SystemExit(f"gpu: {piece['path']} is not the piece the plan staged (sha256 "
                         "differs): run plan again here")
    kind, stage = piece["kind"], DEVICE / "stage"
    stage.mkdir(parents=True, exist_ok=True)
    if kind == "wheels":
        _pip_target(piece["site"], sorted(path.glob("*.whl")))
    elif kind == "zip":
        import zipfile

        zipfile.ZipFile(path).extractall(piece["site"])
    elif kind == "part":
        parts = stage / f"{path.parent.name}.parts"
        parts.mkdir(exist_ok=True)
        shutil.copy2(path, parts / path.name)
        whole = piece.get("whole")
        if whole:
            target = stage / whole["file"]
            with open(target, "wb") as out:
                for k in range(whole["parts"]):
                    with open(parts / f"part.{k}", "rb") as part:
                        shutil.copyfileobj(part, out)
            if sha256_of(target) != whole["sha256"]:
                raise SystemExit(f"gpu: {whole['file']} does not reassemble from its parts "
                                 "(a call was lost): start again at call 1")
            shutil.rmtree(parts)
    else:  # a folder or file the step reads as it is: kept beside the parts
        dst = stage / path.name
        shutil.rmtree(dst, ignore_errors=True)
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, dst)
    done = _installed()
    done[piece["name"]] = piece["sha256"]
    (DEVICE / "installed.json").write_text(json.dumps(done, indent=1))


def _trainer_python() -> Path:
    """The trainer's interpreter on its own path. GPU_TRAINER_PYTHON: another interpreter
    under the same path (the CPU rehearsal's .venv-train; the device has one python3)."""
    wrapper = DEVICE / "train-python"
    python = os.environ.get("GPU_TRAINER_PYTHON", sys.executable)
    wrapper.write_text("#!/bin/sh\nPYTHONPATH=%s exec %s \"$@\"\n"
                       % (gpu_sites.pythonpath("trainer", ROOT), python))
    wrapper.chmod(0o755)
    return wrapper


def run_step(experiment: str, budget_s: int, out: Path, models: list[str]) -> int:
    results = DEVICE / "results" / experiment
    results.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": gpu_sites.pythonpath("cli", ROOT),
           "EAGLE3_TRAIN_PYTHON": str(_trainer_python()), "GPU_STAGE": str(DEVICE / "stage"),
           "RESULTS": str(results), "BUDGET_S": str(budget_s), "GPU_HOME": str(DEVICE), "PYTHONUNBUFFERED": "1",
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "EAGLE3_CACHE": str(DEVICE / "cache"),
           "MODELS": " ".join(models)}
    step = ROOT / "bench" / "device" / "steps" / f"{experiment}.sh"
    say(f"step {step.relative_to(ROOT)} with {budget_s} s")
    t = time.monotonic()
    try:
        rc = subprocess.run(["bash", str(step)], env=env, cwd=ROOT,
                            timeout=max(budget_s, 30)).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    say(f"step rc={rc} in {time.monotonic() - t:.0f} s"
        + (" (the call's time: run `call ... run` again to continue)" if rc == 124 else ""))
    with tarfile.open(out / f"{experiment}-results.tar.gz", "w:gz") as tar:
        tar.add(results, arcname=".")
    return rc


def call(experiment: str, which: str) -> int:
    t0 = time.monotonic()
    out = Path(os.environ.get("OUT", "/tmp/gpu-out"))
    out.mkdir(parents=True, exist_ok=True)
    DEVICE.mkdir(parents=True, exist_ok=True)
    record = json.loads((STAGE / experiment / "plan.json").read_text())
    calls = record["calls"]
    n = len(calls) if which == "run" else int(which)
    done = _installed()
    missing = [p["name"] for c in calls[:n - 1] for p in c if done.get(p["name"]) != p["sha256"]]
    if missing:
        raise SystemExit(f"gpu: {', '.join(missing)} from earlier calls are not installed here "
                         "(a cold machine, or a call was skipped): start again at call 1")
    if n == 1:  # what the device's site holds: the rehearsal's base (tests/fixtures)
        freeze = subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"],
                                capture_output=True, text=True).stdout
        (out / "device-pip-freeze.txt").write_text(freeze)
    if which != "run":
        for piece in calls[n - 1]:
            if done.get(piece["name"]) != piece["sha256"]:
                install(piece)
        say(f"call {n}/{len(calls)}: installed {', '.join(p['name'] for p in calls[n - 1])} "
            f"in {time.monotonic() - t0:.0f} s")
    if n < len(calls):
        return 0
    limit = int(os.environ.get("GPU_CALL_LIMIT_S", CALL_LIMIT_S))
    return run_step(experiment, int(limit - (time.monotonic() - t0) - 45), out,
                    record.get("models", MODELS))


def sites(what: str) -> int:
    """`record` the bundle's metadata (after a bundle change), or `check` it against the
    device's freeze (gpu_sites.py's declaration of the sites)."""
    if what == "record":
        gpu_sites.METADATA_FIXTURE.write_text(
            json.dumps(gpu_sites.record(), indent=1, sort_keys=True) + "\n")
        print(f"gpu sites: wrote {gpu_sites.METADATA_FIXTURE.relative_to(ROOT)}")
        return 0
    if what == "check":
        meta = json.loads(gpu_sites.METADATA_FIXTURE.read_text())
        problems = gpu_sites.check(meta, gpu_sites.device_freeze())
        for p in problems:
            print(f"gpu sites: {p}")
        print(f"gpu sites: {len(problems)} conflict(s) on {', '.join(gpu_sites.PATHS)}")
        return 1 if problems else 0
    raise SystemExit(f"gpu sites: {what!r}: give record or check")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    what, rest = argv[0], argv[1:]
    if what == "bundle":
        return bundle()
    if what == "sites":
        return sites(rest[0] if rest else "check")
    if what in ("plan", "call", "collect") and (not rest or rest[0] not in EXPERIMENTS):
        raise SystemExit(f"gpu: {what} needs one of {', '.join(EXPERIMENTS)}")
    if what == "plan":
        drafters = Path(rest[rest.index("--drafters") + 1]) if "--drafters" in rest else None
        models = rest[rest.index("--models") + 1].split(",") if "--models" in rest else None
        plan(rest[0], drafters, rehearse="--no-rehearsal" not in rest, models=models)
        return 0
    if what == "call":
        return call(rest[0], rest[1] if len(rest) > 1 else "1")
    if what == "collect":
        return collect(rest[0], Path(rest[1]))
    raise SystemExit(f"gpu: {what!r}: give bundle, sites, plan, call or collect")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
