"""The layouts eagle3-export writes, one per trainer, and the final norm two of them need.

What each trainer reads, from its own released code:

- speculators 0.9.0 (`format=speculators`): an Arrow dataset (`input_ids`, `loss_mask`,
  `seq_len`) and `hidden_states/hs_<row>.safetensors` with `token_ids` [T] and
  `hidden_states` [T, L, H], the last layer before the final norm (the trainer applies
  the verifier's norm); fp8 stays fp8 (hs_connectors' fp8 backend dequantizes).
- SpecForge 0.2.0 (`format=specforge`): one `torch.save` dict per sample, `*.ckpt`
  anywhere under the directory (its `OfflineManifestReader`): `input_ids` [T],
  `loss_mask` [T], `aux_hidden_state` [1, T, 3H] (the aux layers side by side, in layer
  order) and `hidden_state` [1, T, H], the final state *after* the final norm: its
  `TargetHead` is the lm_head alone. Its normalizer takes exactly these keys.
- ModelOpt 0.47.0 (`format=modelopt`): one `*.pt` dict per sample (its
  `OfflineSupervisedDataset`, `torch.load(weights_only=True)`): `input_ids` [T],
  `loss_mask` [T] (read with `answer_only_loss`), `aux_hidden_states` [T, kH] and
  `hidden_states` [T, H] after the final norm (`hidden_states_prenorm` False, its default).

Both post-norm layouts get the model's own final RMSNorm applied here from the
checkpoint's weight, in float32 and rounded once to the model dtype (as vLLM's kernel;
the trainers' heads take the model dtype); fp8 states are dequantized to the model dtype first. Their trainers count layer
outputs: our aux id k (the stream entering layer k) is their k - 1 (export.json says
both).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.layout import atomic_write
from eagle3_extract.models.config import read_config, text_config

FORMATS = ("speculators", "specforge", "modelopt")
POST_NORM = {"specforge", "modelopt"}  # the formats whose final state is after the norm
SUFFIX = {"specforge": ".ckpt", "modelopt": ".pt", "speculators": ".safetensors"}
FILES_PER_DIR = 10_000
# Families whose final norm is RMSNorm as transformers' Llama computes it (weight times
# the normalized state); Gemma's (1 + weight) and LayerNorm models are refused.
RMS_FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "deepseek_v3",
                "deepseek_v2", "kimi_k2", "kimi_k25", "minicpm", "granite", "smollm3"}
NORM_KEYS = ("model.norm.weight", "language_model.model.norm.weight",
             "model.language_model.norm.weight")


class FormatError(ValueError):
    pass


@dataclass(frozen=True)
class FinalNorm:
    """The model's final RMSNorm, read from its checkpoint."""

    weight: torch.Tensor
    eps: float
    key: str
    sha256: str  # of the weight's bytes: export.json records which norm was applied

    def __call__(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(dtype)  # one rounding, as vLLM's kernel


def load_final_norm(model_dir: str, hidden_size: int) -> FinalNorm:
    """The final norm of the checkpoint in `model_dir` (config.json and safetensors)."""
    from safetensors import safe_open

    cfg, _ = read_config(model_dir)
    text = text_config(cfg)
    family = str(text.get("model_type") or cfg.get("model_type"))
    if family not in RMS_FAMILIES:
        raise FormatError(f"{model_dir}: model_type {family!r} is not a family whose final "
                          "norm this export applies (RMSNorm: "
                          f"{', '.join(sorted(RMS_FAMILIES))}); use format=speculators")
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: root / f for k, f in weight_map.items() if k in NORM_KEYS}
    else:
        files = {k: f for f in sorted(root.glob("*.safetensors")) for k in NORM_KEYS
                 if k in safe_open(f, "pt").keys()}
    if len(files) != 1:
        raise FormatError(f"{model_dir}: {'no' if not files else 'several'} final norm "
                          f"weights ({', '.join(NORM_KEYS)}) in its safetensors; give "
                          "--model the checkpoint the extraction ran on")
    (key, path), = files.items()
    with safe_open(path, "pt") as f:
        weight = f.get_tensor(key)
    if tuple(weight.shape) != (hidden_size,):
        raise FormatError(f"{path}: {key} has shape {tuple(weight.shape)}, the extraction's "
                          f"hidden size is {hidden_size}; give --model the model it ran on")
    eps = text.get("rms_norm_eps")
    if eps is None:
        raise FormatError(f"{model_dir}/config.json has no rms_norm_eps")
    sha = hashlib.sha256(weight.float().numpy().tobytes()).hexdigest()
    return FinalNorm(weight, float(eps), key, sha)


def rel_path(fmt: str, row: int, index: int) -> str:
    """A row's file under the export, <= FILES_PER_DIR per folder for the per-sample layouts."""
    if fmt == "speculators":
        return f"hidden_states/hs_{row}.safetensors"
    return f"rows/{index // FILES_PER_DIR:05d}/{index:09d}{SUFFIX[fmt]}"


def trainer_tensors(fmt: str, ids: torch.Tensor, mask: torch.Tensor, states: torch.Tensor,
                    norm: FinalNorm, dtype: torch.dtype) -> dict[str, Any]:
    """One sample as SpecForge's or ModelOpt's file holds it. `states` [T, L, H] is the
    stored stack (aux layers, then id N before the norm), dequantized to `dtype`."""
    t, layers, h = states.shape
    aux = states[:, :-1, :].reshape(t, (layers - 1) * h).contiguous()
    final = norm(states[:, -1, :], dtype).contiguous()
    ids, mask = ids.to(torch.int64), mask.to(torch.int64)
    if fmt == "specforge":
        return {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": aux[None],
                "hidden_state": final[None]}
    return {"input_ids": ids, "loss_mask": mask, "aux_hidden_states": aux,
            "hidden_states": final, "hidden_states_prenorm": False}


def save_torch(obj: dict[str, Any], path: Path) -> str:
    """torch.save into `path` whole or not at all; the sha256 of the bytes written."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getbuffer()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        f.write(data)
    return hashlib.sha256(data).hexdigest()


def check_layers(fmt: str, layer_ids: list[int], num_layers: int) -> None:
    """The aux-layer count each trainer's EAGLE-3 model takes."""
    aux = len(layer_ids) - 1
    if layer_ids[-1] != num_layers:
        raise FormatError(f"layer ids {layer_ids} do not end with id {num_layers} (the final "
                          f"state): format={fmt} needs it for its targets")
    if fmt == "specforge" and aux != 3:
        raise FormatError(f"format=specforge: SpecForge's EAGLE-3 takes exactly 3 aux layers, "
                          f"the extraction has {aux} ({layer_ids[:-1]}); extract with 3")
    if aux < 1:
        raise FormatError(f"format={fmt}: the extraction has no aux layer ({layer_ids})")


def trainer_layer_ids(fmt: str, layer_ids: list[int]) -> list[int]:
    """The aux layer ids in the trainer's own count (SGLang and ModelOpt count layer
    outputs: our id k, the stream entering layer k, is their k - 1)."""
    aux = layer_ids[:-1]
    return aux if fmt == "speculators" else [k - 1 for k in aux]
