"""Engines: prefill a batch of token ids and capture the residual stream.

Layer ids are resolved here once, in the vLLM / EAGLE-3 convention; every later
stage sees explicit integers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..types import Engine


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


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    # Multimodal wrappers (Kimi-K2.5, ...) keep the decoder's shape in text_config.
    return cfg.get("text_config") or cfg


def _dtype(name: str | None, cfg: dict[str, Any]) -> torch.dtype:
    if name in (None, "auto"):
        name = _text_config(cfg).get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"model.dtype={name!r} is not a torch dtype (use bfloat16, float16 or float32)")
    return dt


def inspect_model(model_cfg: Any) -> ModelInfo:
    """Resolve `model.path` and read its shape without loading weights.

    `path: tiny` builds the embedded tiny model (deterministic random weights).
    Hub ids are read through the HF cache; nothing is downloaded here unless the
    user's environment allows it.
    """
    path = str(model_cfg.path)
    if path == "tiny":
        from ..tiny import build_tiny_model

        path = str(build_tiny_model(model_cfg.tiny_config or "llama"))
    cfg_file = Path(path) / "config.json"
    if cfg_file.is_file():
        raw = cfg_file.read_bytes()
        cfg = json.loads(raw)
        sha = hashlib.sha256(raw).hexdigest()
    else:
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(
                path, trust_remote_code=bool(model_cfg.trust_remote_code)
            ).to_dict()
        except Exception as e:  # noqa: BLE001 - re-raised with the fix
            raise ValueError(
                f"model.path={path!r}: no config.json there and it could not be read as a hub "
                f"id ({type(e).__name__}: {e}). Give a local model directory or a reachable "
                "hub id (set HF_TOKEN for gated models)."
            ) from e
        sha = None
    text = _text_config(cfg)
    if "num_hidden_layers" not in text or "hidden_size" not in text:
        raise ValueError(f"{path}: config has no num_hidden_layers/hidden_size")
    tok = getattr(model_cfg, "tokenizer", None) or path
    return ModelInfo(
        path=path,
        tokenizer_path=str(tok),
        architecture=(cfg.get("architectures") or ["?"])[0],
        num_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        dtype=_dtype(getattr(model_cfg, "dtype", None), cfg),
        config_sha256=sha,
    )


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers plus the final pre-norm state (id N)."""
    n = num_layers
    return sorted({2, n // 2, n - 3, n})


def resolve_layer_ids(ids: list[int] | None, num_layers: int) -> list[int]:
    """Validate ids in the vLLM convention: 1 <= k <= N, strictly increasing."""
    if ids is None:
        if num_layers < 4:
            raise ValueError(
                f"the default layers need >= 4 decoder layers, the model has {num_layers}; "
                "set layers.ids explicitly"
            )
        return default_layer_ids(num_layers)
    ids = [int(k) for k in ids]
    if not ids:
        raise ValueError("layers.ids is empty: give at least one layer id")
    bad = [k for k in ids if not 1 <= k <= num_layers]
    if bad:
        raise ValueError(
            f"layers.ids {bad} out of range for a model with {num_layers} decoder layers: "
            f"ids count boundaries (vLLM / EAGLE-3 convention), 1..{num_layers}, where k is "
            f"the residual stream entering layer k and {num_layers} the state before the "
            "final norm"
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"layers.ids {ids} must be strictly increasing (no duplicates)")
    return ids


def build_engine(cfg: Any, info: ModelInfo, layer_ids: list[int]) -> Engine:
    name = cfg.engine.name
    if name == "hf":
        from .hf import HFEngine

        return HFEngine(cfg, info, layer_ids)
    if name == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(cfg, info, layer_ids)
    raise ValueError(f"engine={name!r}: choose engine=vllm or engine=hf")
