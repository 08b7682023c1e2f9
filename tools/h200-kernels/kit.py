"""Load the kit's library (vLLM 0.16.0's own kernels, built by build.py) into torch.

After `load(DIR)`, `torch.ops._C.fused_add_rms_norm`, `torch.ops._moe_C.grouped_topk`,
`torch.ops._C_cache_ops.concat_and_cache_mla`, ... are vLLM's CUDA kernels, under the
names and schemas vLLM's Python (`vllm/_custom_ops.py`) calls. The library is only
loaded by the torch it was built against (build.json): a C++ ABI mismatch would crash
at the first call rather than fail here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

LIB = "vllm016_kit.so"


def load(kit_dir: str | Path) -> dict:
    kit_dir = Path(kit_dir)
    record = json.loads((kit_dir / "build.json").read_text())
    if record["torch"] != torch.__version__:
        raise RuntimeError(f"{kit_dir / LIB} was built for torch {record['torch']}, this is "
                           f"{torch.__version__}: rebuild it (build.py)")
    torch.ops.load_library(str(kit_dir / LIB))
    return record


def built_ops(record: dict) -> dict[str, list[str]]:
    return {ns: list(ops) for ns, ops in record["ops"].items()}


def install(site: str | Path) -> Path:
    """Make `SITE/vllm/_C.py` (the vLLM kit's probe stub) dispatch to the kit's kernels:
    the stub moves to `vllm/_C_probe.py` and vllm_C.py takes its place; and give
    vllm-flash-attn's interface its FA2 op (`vllm_fa2_C.py`, the varlen stand-in MLA
    prefill calls). Idempotent."""
    vllm_dir = Path(site) / "vllm"
    probe, target = vllm_dir / "_C_probe.py", vllm_dir / "_C.py"
    if not probe.exists():
        target.replace(probe)
    shutil.copyfile(Path(__file__).with_name("vllm_C.py"), target)
    fa_dir = vllm_dir / "vllm_flash_attn"
    if fa_dir.is_dir():
        shutil.copyfile(Path(__file__).with_name("vllm_fa2_C.py"), fa_dir / "_vllm_fa2_C.py")
    return target


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] != ["install"] or len(sys.argv) != 3:
        sys.exit("usage: kit.py install SITE_DIR   (then: export PYTHONPATH=SITE_DIR:"
                 "tools/h200-kernels EAGLE3_KERNEL_KIT=KIT_DIR)")
    print(f"installed {install(sys.argv[2])}")
