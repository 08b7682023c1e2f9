"""A bf16 MoE checkpoint -> its routed experts in compressed-tensors W4A16, plus the
dequantized reference (issue 25 (c)).

    python3 bench/prediction/w4a16.py SRC_DIR PACKED_DIR REF_DIR [--group-size 32]

Kimi-K2.5 ships its routed experts as 4-bit integers, symmetric, in groups of 32 along
the input, packed eight to an int32 (compressed-tensors `pack-quantized`); attention,
shared experts, the dense layer and lm_head stay bf16. PACKED_DIR is such a checkpoint
of SRC_DIR (what vLLM loads: its WNA16 MoE method, Marlin on Hopper and Blackwell);
REF_DIR is SRC_DIR with every routed expert replaced by exactly the weights PACKED_DIR
decodes to (what HF transformers loads as the reference for eagle3-verify). The
capture from PACKED_DIR against HF on REF_DIR then differs only by how the kernels
compute, not by what they compute with.

The arithmetic is compressed-tensors' own (its calculate_qparams, quantize and
pack_to_int32 for these args; tests/test_w4a16.py checks it against compressed-tensors
bit for bit), written out here because the device has no compressed-tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from kimi import BITS, quantization_config

Q_MIN, Q_MAX = -(1 << (BITS - 1)), (1 << (BITS - 1)) - 1  # -8, 7
PACK = 32 // BITS
EXPERT = re.compile(r"^(?P<p>.*\.mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$")
FUSED = re.compile(r"^(?P<p>.*\.mlp\.experts)\.(?P<w>gate_up_proj|down_proj)$")  # HF v5


def quantize(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K] in [-8, 7], scale [N, K / group] in w's dtype), as
    compressed-tensors computes them: scale = max|w| / 7.5 in the weight's dtype, a zero
    scale replaced by that dtype's eps, q = round(clamp(w / scale))."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input dim {k} is not a multiple of the group size {group_size}")
    g = w.view(n, k // group_size, group_size)
    scale = g.abs().amax(-1) / ((Q_MAX - Q_MIN) / 2)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype,
                                                 device=w.device), scale)
    q = torch.round(torch.clamp(g / scale.unsqueeze(-1), Q_MIN, Q_MAX))
    return q.to(torch.int8).view(n, k), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    g = q.view(n, scale.shape[1], -1).to(scale.dtype) * scale.unsqueeze(-1)
    return g.view(n, k)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> int32 [N, K / 8]: offset to unsigned, element i at bits 4i."""
    n, k = q.shape
    u = (q.to(torch.int32) - Q_MIN).view(n, k // PACK, PACK)
    shifts = torch.arange(PACK, device=q.device, dtype=torch.int32) * BITS
    return (u << shifts).sum(-1, dtype=torch.int32)


def _experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF v5's fused expert tensors split into the per-expert names checkpoints use."""
    out = {}
    for name, t in tensors.items():
        m = FUSED.match(name)
        if not m:
            out[name] = t
        elif m["w"] == "down_proj":  # [E, H, I]
            for e in range(t.shape[0]):
                out[f"{m['p']}.{e}.down_proj.weight"] = t[e]
        else:  # gate_up_proj [E, 2I, H]: gate first
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{m['p']}.{e}.gate_proj.weight"] = gate
                out[f"{m['p']}.{e}.up_proj.weight"] = up
    return out


def convert(src: Path, packed: Path, ref: Path, group_size: int = 32,
            device: str | None = None) -> dict:
    """Write PACKED and REF from SRC (each atomically: a temp dir renamed into place)."""
    from safetensors.torch import load_file, save_file

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {src}")
    tmps = [Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent)) for d in (packed, ref)]
    try:
        maps: list[dict[str, str]] = [{}, {}]
        experts = 0
        for f in files:
            outs: list[dict[str, torch.Tensor]] = [{}, {}]
            for name, t in _experts(load_file(f)).items():
                m = EXPERT.match(name)
                if not m:
                    outs[0][name] = outs[1][name] = t
                    continue
                q, scale = quantize(t.to(device), group_size)
                p = m["p"]
                outs[0][f"{p}.weight_packed"] = pack(q).cpu()
                outs[0][f"{p}.weight_scale"] = scale.cpu()
                outs[0][f"{p}.weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
                outs[1][name] = dequantize(q, scale).cpu()
                experts += 1
            for i, tmp in enumerate(tmps):
                save_file(outs[i], str(tmp / f.name), metadata={"format": "pt"})
                maps[i].update({k: f.name for k in outs[i]})
        if not experts:
            raise ValueError(f"{src} has no routed expert weights (…mlp.experts.N.*_proj)")
        for p in src.iterdir():  # config, tokenizer, generation config
            if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
                for tmp in tmps:
                    shutil.copy(p, tmp / p.name)
        cfg = json.loads((src / "config.json").read_text())
        cfg["quantization_config"] = quantization_config(group_size)
        (tmps[0] / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        if len(files) > 1:
            for i, tmp in enumerate(tmps):
                (tmp / "model.safetensors.index.json").write_text(json.dumps(
                    {"metadata": {}, "weight_map": dict(sorted(maps[i].items()))}, indent=1))
        for tmp, final in zip(tmps, (packed, ref)):
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
    finally:
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"expert_matrices": experts, "group_size": group_size, "files": len(files)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("packed", type=Path)
    ap.add_argument("ref", type=Path)
    ap.add_argument("--group-size", type=int, default=32)
    args = ap.parse_args(argv)
    print(json.dumps(convert(args.src, args.packed, args.ref, args.group_size)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
