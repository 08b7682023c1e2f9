"""Build vLLM 0.16.0's own CUDA kernels for the ops on our path, on the device.

    python3 tools/h200-kernels/build.py SDIST OUTDIR

Checks the sdist's sha256 (the file PyPI lists for vllm==0.16.0), extracts its csrc/,
writes the bindings for the chosen ops from vLLM's own torch_bindings.cpp
(bindings.py), compiles them with torch's cpp_extension against the device's torch
(sm_90, ninja, every core) and leaves `OUTDIR/vllm016_kit.so` plus `build.json` (what
was built from what, with which compilers, in how long). `kit.py` loads it.
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

HERE = Path(__file__).resolve().parent
SDIST_NAME = "vllm-0.16.0.tar.gz"
SDIST_SHA256 = "1f684bb31fbef59d862e2fe666e23a41f1d39d93f86215ce1ce1db89a8f5665b"
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
# torch's extension build defines these (vLLM's CMake does not); the kernels need the
# half / bfloat16 operators back. ENABLE_FP8: vLLM's CMake sets it for sm_89+.
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-DENABLE_FP8",
              "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
ARCH = "9.0"


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # Python >= 3.11


def main(sdist: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    got = sha256(sdist)
    if got != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {got}, expected {SDIST_SHA256} (vllm==0.16.0)")
    work = Path(os.environ.get("KIT_WORK", "/tmp/vllm016-kit"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("vllm-0.16.0/csrc/")]
        tar.extractall(work, members=members, filter="data")
    csrc = work / "vllm-0.16.0" / "csrc"
    sys.path.insert(0, str(HERE))
    import bindings

    (work / "kit_bindings.cpp").write_text(bindings.render(csrc))
    os.environ["TORCH_CUDA_ARCH_LIST"] = ARCH
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    import torch
    from torch.utils.cpp_extension import load

    build = work / "build"
    build.mkdir()
    load(name="vllm016_kit", sources=[str(csrc / s) for s in SOURCES]
         + [str(work / "kit_bindings.cpp")],
         extra_include_paths=[str(csrc)], extra_cflags=["-O3"],
         extra_cuda_cflags=CUDA_FLAGS, build_directory=str(build),
         is_python_module=False, verbose=False)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(build / "vllm016_kit.so", out / "vllm016_kit.so")
    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    record = {
        "sdist": SDIST_NAME, "sdist_sha256": got, "sources": SOURCES,
        "ops": {ns: ops for ns, (_, _, _, ops) in bindings.OPS.items()},
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "nvcc": nvcc.strip().splitlines()[-1] if nvcc else None,
        "arch": ARCH, "cuda_flags": CUDA_FLAGS, "seconds": round(time.perf_counter() - t0, 1),
        "so_sha256": sha256(out / "vllm016_kit.so"),
    }
    (out / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), Path(sys.argv[2])), indent=2))
