"""Tiny random models built deterministically from committed configs.

Tests and the embedded default need a real model with no network: the weights
come from a fixed seed, the tokenizer is committed, and the result is cached by
the hash of everything that determines it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from eagle3_extract.layout import temp_path

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TOKENIZER_DIR = ASSETS / "tokenizer"
TINY_CONFIGS = {p.stem: p for p in sorted((ASSETS / "tiny").glob("*.json"))}
SEED = 1234


def tiny_config_path(name_or_path: str) -> Path:
    """A committed config by short name (llama, qwen3, deepseek_v3) or any path."""
    if name_or_path in TINY_CONFIGS:
        return TINY_CONFIGS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tiny model config {name_or_path!r} not found; use one of "
            f"{sorted(TINY_CONFIGS)} or a path to a config.json"
        )
    return path


def cache_root() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3-extract"))


def _fingerprint(config_path: Path) -> str:
    from importlib.metadata import version

    h = hashlib.sha256()
    h.update(config_path.read_bytes())
    for f in sorted(TOKENIZER_DIR.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    h.update(f"seed={SEED} transformers={version('transformers')}".encode())
    return h.hexdigest()[:16]


def build_once(out: Path, make: Callable[[Path], None]) -> Path:
    """`out`, made by `make(tmp)` in a temp dir beside it and renamed into place, once:
    a directory that exists is complete; one built concurrently elsewhere wins."""
    if (out / "model.safetensors").exists() or (out / "model.safetensors.index.json").exists():
        return out  # one file, or the shards save_pretrained writes for a larger model
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(out)  # the package's one temp rule: pid and a random tag
    tmp.mkdir()
    try:
        make(tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # built concurrently by another process: keep theirs
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tiny_model(config: str | Path, root: Path | None = None) -> Path:
    """Return a directory holding config, weights and tokenizer; build it once."""
    config_path = tiny_config_path(str(config))
    root = Path(root) if root else cache_root() / "tiny"

    def make(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        raw = json.loads(config_path.read_text())
        cfg = AutoConfig.for_model(**raw)
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
        with torch.no_grad():
            # Bigger-than-default init so layers change the residual stream visibly:
            # a test that confuses two layer ids must see a large difference.
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
        model.to(getattr(torch, raw.get("torch_dtype", "bfloat16"))).save_pretrained(
            tmp, safe_serialization=True)
        for f in TOKENIZER_DIR.iterdir():
            shutil.copy(f, tmp / f.name)

    return build_once(root / f"{config_path.stem}-{_fingerprint(config_path)}", make)
