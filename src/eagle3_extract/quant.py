"""How the states are stored: the model's dtype, or fp8 e4m3 with float32 scales.

Disk, not the GPU, is what a real run runs out of (56 KiB a token for Kimi-K2.5
in bf16), so `output.dtype=fp8` halves it, in the file layout speculators 0.9.0's
hs_connectors reads (`fp8_utils.py`, its FP8 backend): `hidden_states` e4m3
[T, L, H] and `hidden_states_scales` float32 [T, 1, 1], one scale per token over
the whole [L, H] row; x = fp8 * scale. `output.fp8_scale=token_layer` stores
[T, L, 1] instead, one per token and layer (the final layer's magnitude is
orders above the first aux layer's); the same loader reads it (the scale
broadcasts). Quantized on the device before the one device-to-host copy, so the
copy halves too. The arithmetic is hs_connectors' to the bit (tests compare).
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_extract.layout import SCALES_KEY, STATES_KEY, Storage  # noqa: F401 - re-exported

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# rows per float32 temporary in quantize_into: its peak beside the capture (engine/memory.py)
FP8_CHUNK_ROWS = 4096


def quantize_into(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                  chunk: int = FP8_CHUNK_ROWS) -> None:
    """x [R, L, H] (any float dtype) -> q [R, L, H] e4m3 and scales [R, S] float32.

    S = 1: one scale per row over [L, H]; S = L: one per row and layer. hs_connectors'
    arithmetic (scale = amax / 448, at least 1e-12; q = e4m3(float32(x) / scale)) in
    fewer passes over the data, since on the GPU it runs beside the next prefill: amax
    from max and -min (no |x| temporary, exact in any float dtype), the division into
    one float32 temporary per chunk of rows, the cast in the copy. No clamp is needed:
    |x / scale| <= 448 (1 + 2^-23), which e4m3 rounds to 448. A NaN or Inf row gets a
    non-finite scale (max propagates NaN), which is how the capture flags it.
    """
    per_layer = scales.shape[1] != 1
    dims = (-1,) if per_layer else (1, 2)
    for a in range(0, x.shape[0], chunk):
        xs = x[a:a + chunk]
        amax = torch.maximum(xs.amax(dim=dims), -xs.amin(dim=dims)).float()
        s = (amax.view(xs.shape[0], -1) / FP8_MAX).clamp(min=1e-12)
        scales[a:a + chunk].copy_(s)
        q[a:a + chunk].copy_(torch.div(xs, s.unsqueeze(-1), out=torch.empty(
            xs.shape, dtype=torch.float32, device=xs.device)))


def quantize(x: torch.Tensor, scale: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, L, H] -> (e4m3 [T, L, H], float32 scales [T, 1, 1] or [T, L, 1])."""
    cols = x.shape[1] if scale == "token_layer" else 1
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty((x.shape[0], cols), dtype=torch.float32, device=x.device)
    quantize_into(x, q, s)
    return q, s.unsqueeze(-1)


def dequantize(q: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 * scale, in `dtype` (hs_connectors computes it in its target dtype too)."""
    return q.to(dtype) * scales.to(dtype)


def check_scales(states: torch.Tensor, scales: Any) -> str | None:
    """Why `scales` does not belong to fp8 `states` [T, L, H], or None."""
    if not isinstance(scales, torch.Tensor):
        return f"{SCALES_KEY} missing: fp8 states need their scales"
    T, L = states.shape[0], states.shape[1]
    if scales.dtype != torch.float32 or tuple(scales.shape) not in ((T, 1, 1), (T, L, 1)):
        return (f"{SCALES_KEY} {tuple(scales.shape)} {scales.dtype}, expected float32 "
                f"[{T}, 1, 1] or [{T}, {L}, 1]")
    if not bool(torch.isfinite(scales).all()) or not bool((scales > 0).all()):
        return f"{SCALES_KEY} holds values that are not finite and positive"
    return None


def states_tensor(hs: Any) -> torch.Tensor:
    """[T, L, H] as stored, from a tensor or speculators 0.3.0's list of L [T, H]."""
    if isinstance(hs, torch.Tensor):
        return hs
    if isinstance(hs, (list, tuple)) and hs and all(isinstance(t, torch.Tensor) for t in hs):
        shapes = {tuple(t.shape) for t in hs}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise ValueError(f"hidden_states list of tensors with shapes {sorted(shapes)}")
        return torch.stack(list(hs), dim=1)
    raise ValueError(f"hidden_states is a {type(hs).__name__}, not a tensor or list of tensors")


def states_of(tensors: dict[str, Any], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A sample's states [T, L, H] as numbers: fp8 dequantized (to float32, or `dtype`),
    anything else as stored (or cast to `dtype`)."""
    hs = states_tensor(tensors[STATES_KEY])
    if hs.dtype == FP8:
        why = check_scales(hs, tensors.get(SCALES_KEY)) if hs.dim() == 3 else "not [T, L, H]"
        if why:
            raise ValueError(why)
        return dequantize(hs, tensors[SCALES_KEY], dtype or torch.float32)
    return hs if dtype is None else hs.to(dtype)
