"""Load the kit's library (vLLM 0.16.0's own kernels, built by build.py) into torch.

After `load(DIR)`, `torch.ops._C.fused_add_rms_norm`, `torch.ops._moe_C.grouped_topk`,
`torch.ops._C_cache_ops.concat_and_cache_mla`, ... are vLLM's CUDA kernels, under the
names and schemas vLLM's Python (`vllm/_custom_ops.py`) calls. The library is only
loaded by the torch it was built against (build.json): a C++ ABI mismatch would crash
at the first call rather than fail here.
"""

from __future__ import annotations

import json
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
