"""Build vLLM 0.16.0's own CUDA kernels for the ops on our path, on the device.

    python3 tools/h200-kernels/build.py pack SDIST CSRC.tar.gz   # here: csrc/ of the sdist
    python3 tools/h200-kernels/build.py SOURCES OUTDIR           # on the device

SOURCES is the sdist (its sha256 checked: the file PyPI lists for vllm==0.16.0) or the
`pack`ed csrc/ of it (600 KB instead of 29 MB, so it fits beside the wheels in one
call's carry; `pack` checks the sdist's sha256 and records it and every file's sha256,
which the build checks again). The build writes the bindings for the chosen ops from
vLLM's own torch_bindings.cpp (bindings.py), generates the Marlin MoE kernels with the
sdist's own generator narrowed to Kimi-K2.5's W4A16 case (MARLIN_MOE), compiles it
all with torch's cpp_extension against the device's torch (sm_90, ninja, every core)
and leaves `OUTDIR/vllm016_kit.so` plus `build.json` (what was built from what, with
which compilers, in how long). `kit.py` loads it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDIST_NAME = "vllm-0.16.0.tar.gz"
SDIST_SHA256 = "1f684bb31fbef59d862e2fe666e23a41f1d39d93f86215ce1ce1db89a8f5665b"
CSRC_PREFIX = "vllm-0.16.0/csrc/"
SOURCE_JSON = "SOURCE.json"  # in a pack: the sdist's sha256 and every csrc file's
SOURCES = [
    "layernorm_kernels.cu",  # rms_norm, fused_add_rms_norm (in place)
    "activation_kernels.cu",  # silu_and_mul, gelu_and_mul, gelu_tanh_and_mul
    "pos_encoding_kernels.cu",  # rotary_embedding (in place)
    "cache_kernels.cu",  # reshape_and_cache_flash, concat_and_cache_mla
    "cuda_utils_kernels.cu",  # device attributes cache_kernels asks for
    "moe/topk_softmax_kernels.cu",  # topk_softmax, topk_sigmoid
    "moe/moe_align_sum_kernels.cu",  # moe_align_block_size, moe_sum
    "moe/grouped_topk_kernels.cu",  # grouped_topk (DeepseekV3 / Kimi-K2.5 routing)
]
# Sources that register their own impls with TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME):
# compiled through a wrapper that names the namespace vLLM's CMake builds them into.
REGISTERING = {
    "quantization/marlin/gptq_marlin_repack.cu": "_C",  # checkpoint -> Marlin layout
    "moe/marlin_moe_wna16/ops.cu": "_moe_C",  # moe_wna16_marlin_gemm
}
# The Marlin MoE instantiations built: vLLM's generator (csrc/moe/marlin_moe_wna16/
# generate_kernels.py) writes every activation x weight x group combination; ops.cu
# skips a config that was not built (`if (kernel == MarlinDefault) continue;`). Kept:
# bf16 activations and output, uint4b8 weights (compressed-tensors' symmetric
# pack-quantized int4, WNA16_SUPPORTED_TYPES_MAP[4]), groups of 32 (group_blocks 2):
# Kimi-K2.5's experts. Every thread and block shape of that case stays.
MARLIN_MOE = {"a_type": "kBFloat16", "b_type": "kU4B8", "c_type": "kBFloat16",
              "group_blocks": [2]}
MARLIN_DIR = "moe/marlin_moe_wna16"
MARLIN_PARTS = 5  # generated instantiations split over this many files: ninja compiles
# them side by side
# torch's extension build defines these (vLLM's CMake does not); the kernels need the
# half / bfloat16 operators back. ENABLE_FP8: vLLM's CMake sets it for sm_89+.
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-DENABLE_FP8",
              # vLLM's CMake, nvcc >= 12.8, for Marlin: its template kernels are
              # instantiated in one file and launched from another (ops.cu)
              "-static-global-template-stub=false",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
ARCH = "9.0"


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # Python >= 3.11


def pack(sdist: Path, out: Path) -> dict:
    """csrc/ of the sdist as a tar.gz, with SOURCE.json: the sdist's sha256 and each file's."""
    got = sha256(sdist)
    if got != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {got}, expected {SDIST_SHA256} (vllm==0.16.0)")
    files = {}
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:gz") as dst:
        for m in src.getmembers():
            if not m.name.startswith(CSRC_PREFIX) or not m.isfile():
                continue
            data = src.extractfile(m).read()
            files[m.name[len(CSRC_PREFIX):]] = hashlib.sha256(data).hexdigest()
            dst.addfile(m, io.BytesIO(data))
        record = json.dumps({"sdist": SDIST_NAME, "sdist_sha256": got, "files": files},
                            indent=1).encode()
        info = tarfile.TarInfo(SOURCE_JSON)
        info.size = len(record)
        dst.addfile(info, io.BytesIO(record))
    os.replace(tmp, out)
    return {"sdist_sha256": got, "files": len(files), "bytes": out.stat().st_size}


def extract_csrc(sources: Path, work: Path) -> tuple[Path, str]:
    """csrc/ under work from the sdist or a pack of it; (csrc dir, the sdist's sha256)."""
    with tarfile.open(sources) as tar:
        names = tar.getnames()
        if SOURCE_JSON not in names:  # the sdist itself
            got = sha256(sources)
            if got != SDIST_SHA256:
                raise SystemExit(f"{sources}: sha256 {got}, expected {SDIST_SHA256} "
                                 "(vllm==0.16.0)")
            members = [m for m in tar.getmembers() if m.name.startswith(CSRC_PREFIX)]
            tar.extractall(work, members=members, filter="data")
            return work / CSRC_PREFIX, got
        record = json.loads(tar.extractfile(SOURCE_JSON).read())
        if record["sdist_sha256"] != SDIST_SHA256:
            raise SystemExit(f"{sources} was packed from sdist {record['sdist_sha256']}, "
                             f"expected {SDIST_SHA256}")
        members = [m for m in tar.getmembers() if m.name.startswith(CSRC_PREFIX)]
        tar.extractall(work, members=members, filter="data")
    csrc = work / CSRC_PREFIX
    seen = {str(p.relative_to(csrc)): sha256(p) for p in csrc.rglob("*") if p.is_file()}
    if seen != record["files"]:
        bad = sorted(set(seen.items()) ^ set(record["files"].items()))[:3]
        raise SystemExit(f"{sources}: csrc/ differs from what pack recorded: {bad}")
    return csrc, record["sdist_sha256"]


def generate_marlin_moe(csrc: Path, parts: int = MARLIN_PARTS) -> list[Path]:
    """Run the sdist's Marlin MoE generator for MARLIN_MOE only; the instantiations split
    over `parts` files. Returns them (kernel_selector.h is written beside)."""
    gen_dir = csrc / MARLIN_DIR
    spec = importlib.util.spec_from_file_location("marlin_moe_gen",
                                                  gen_dir / "generate_kernels.py")
    gen = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, ["generate_kernels.py", ARCH]  # it reads the arch at import
    try:
        spec.loader.exec_module(gen)
    finally:
        sys.argv = argv
    base = [c for c in gen.QUANT_CONFIGS if c["b_type"] == MARLIN_MOE["b_type"]
            and "a_type" not in c]
    if len(base) != 1 or not set(MARLIN_MOE["group_blocks"]) <= set(base[0]["group_blocks"]):
        raise SystemExit(f"{gen_dir}/generate_kernels.py has no {MARLIN_MOE['b_type']} "
                         f"config with group_blocks {MARLIN_MOE['group_blocks']}")
    gen.QUANT_CONFIGS = [{**base[0], "a_type": [MARLIN_MOE["a_type"]],
                          "c_type": [MARLIN_MOE["c_type"]],
                          "group_blocks": MARLIN_MOE["group_blocks"]}]
    gen.remove_old_kernels()
    gen.generate_new_kernels()
    generated = sorted(gen_dir.glob("sm*_kernel_*.cu"))
    text = "".join(p.read_text() for p in generated)
    instances = re.findall(r"^template __global__ void Marlin<.*?;$", text, re.M)
    if not instances:
        raise SystemExit(f"the generator wrote no Marlin instantiation in {gen_dir}")
    for p in generated:
        p.unlink()
    head = gen.FILE_HEAD
    out = []
    for i in range(parts):
        chunk = instances[i::parts]
        if chunk:
            p = gen_dir / f"kit_marlin_part{i}.cu"
            p.write_text(head + "\n\n" + "\n\n".join(chunk) + "\n\n}\n")
            out.append(p)
    return out


def registering_wrappers(csrc: Path, work: Path) -> list[Path]:
    """One wrapper per REGISTERING source: its impls land in the namespace vLLM calls."""
    out = []
    for src, ns in REGISTERING.items():
        p = work / ("kit_" + src.replace("/", "_"))
        p.write_text(f"// {src} with its TORCH_LIBRARY_IMPL under {ns} (vLLM's CMake builds "
                     f"it into {ns})\n#undef TORCH_EXTENSION_NAME\n"
                     f"#define TORCH_EXTENSION_NAME {ns}\n#include \"{csrc / src}\"\n")
        out.append(p)
    return out


def main(sources: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    work = Path(os.environ.get("KIT_WORK", "/tmp/vllm016-kit"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    csrc, sdist_sha = extract_csrc(sources, work)
    sys.path.insert(0, str(HERE))
    import bindings

    (work / "kit_bindings.cpp").write_text(bindings.render(csrc))
    marlin = generate_marlin_moe(csrc)
    os.environ["TORCH_CUDA_ARCH_LIST"] = ARCH
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    import torch
    from torch.utils.cpp_extension import load

    build = work / "build"
    build.mkdir()
    load(name="vllm016_kit", sources=[str(csrc / s) for s in SOURCES]
         + [str(p) for p in marlin + registering_wrappers(csrc, work)]
         + [str(work / "kit_bindings.cpp")],
         extra_include_paths=[str(csrc)], extra_cflags=["-O3"],
         extra_cuda_cflags=CUDA_FLAGS, build_directory=str(build),
         is_python_module=False, verbose=False)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "vllm016_kit.so", out / "vllm016_kit.so")
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    record = {
        "sdist": SDIST_NAME, "sdist_sha256": sdist_sha, "sources": SOURCES,
        "registering_sources": REGISTERING, "marlin_moe": MARLIN_MOE,
        "ops": {ns: ops for ns, (_, _, _, ops) in bindings.OPS.items()},
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nvcc": nvcc.strip().splitlines()[-1] if nvcc else None,
        "arch": ARCH, "cuda_flags": CUDA_FLAGS, "seconds": round(time.perf_counter() - t0, 1),
        "so_sha256": sha256(out / "vllm016_kit.so"),
    }
    (out / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    if sys.argv[1:2] == ["pack"] and len(sys.argv) == 4:
        print(json.dumps(pack(Path(sys.argv[2]), Path(sys.argv[3])), indent=2))
    elif len(sys.argv) == 3:
        print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2])), indent=2))
    else:
        sys.exit("usage: build.py pack SDIST CSRC.tar.gz | build.py SOURCES OUTDIR")
