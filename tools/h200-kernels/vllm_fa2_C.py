"""A stand-in for vllm-flash-attn's FA2 `varlen_fwd`, for MLA prefill on the device kit.

vLLM 0.16's MLA (DeepseekV3, Kimi-K2.5) prefills new tokens with
`vllm.vllm_flash_attn.flash_attn_varlen_func` (`MLACommonImpl._run_prefill_new_tokens_fa`;
on Hopper, FlashInfer and cuDNN prefill are off by default), which calls the compiled
`torch.ops._vllm_fa2_C.varlen_fwd`. Building vllm-flash-attn does not fit a device call, so
`kit.py install` puts this file in its place (`vllm/vllm_flash_attn/_vllm_fa2_C.py`):
importing it registers `varlen_fwd` under the same name and argument order, computed with
torch in float32 (scores, softmax, the log-sum-exp vLLM merges context chunks with).
On a CUDA device the op runs FlashAttention-2's own varlen forward kernel, the one torch
vendors (`aten::_flash_attention_forward`: the same FA2 code vllm-flash-attn forks, bottom-
right causal, grouped heads, lse [heads, total_q]) when the call is one it takes (bf16/fp16,
q, k, v of one head size <= 256, as MLA's padded v is); `EAGLE3_VARLEN_KERNEL=torch` (and
every other call) computes it with torch in float32 instead: what FlashAttention computes,
not how, so figures from that path are not FlashAttention's speed. Non-paged only (`block_table` None), no dropout, alibi, softcap or windows: what MLA
prefill passes; anything else is refused, never approximated.
"""

from __future__ import annotations

import os

import torch

SCHEMA = (
    "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor? out, Tensor cu_seqlens_q, "
    "Tensor cu_seqlens_k, Tensor? seqused_k, Tensor? leftpad_k, Tensor? block_table, "
    "Tensor? alibi_slopes, int max_seqlen_q, int max_seqlen_k, float p_dropout, "
    "float softmax_scale, bool zero_tensors, bool is_causal, int window_size_left, "
    "int window_size_right, float softcap, bool return_softmax, int num_splits, "
    "Generator? gen) -> (Tensor, Tensor)"
)
HEADS_PER_STEP = 16  # scores of [16, Lq, Lk] float32 at a time


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q [Lq, H, D], k [Lk, Hk, D], v [Lk, Hk, Dv] -> (out [Lq, H, Dv] in q's
    dtype, lse [H, Lq] float32). Grouped heads: query head h reads key head h // (H / Hk).
    Causal is aligned to the bottom right, as FlashAttention's: query i sees keys
    j <= i + Lk - Lq; a query that sees no key gives 0 (and lse -inf)."""
    lq, h, _ = q.shape
    lk, hk = k.shape[0], k.shape[1]
    group = h // hk
    out = torch.empty(lq, h, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(h, lq, dtype=torch.float32, device=q.device)
    keep = None
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        keep = j <= i + (lk - lq)
    for a in range(0, h, HEADS_PER_STEP):
        b = min(a + HEADS_PER_STEP, h)
        kv = torch.arange(a, b, device=q.device) // group
        qs = q[:, a:b].float().transpose(0, 1)  # [n, Lq, D]
        ks = k[:, kv].float().transpose(0, 1)  # [n, Lk, D]
        vs = v[:, kv].float().transpose(0, 1)  # [n, Lk, Dv]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        m = torch.logsumexp(scores, dim=-1)  # [n, Lq]
        probs = torch.exp(scores - m[..., None]).nan_to_num(0.0)
        out[:, a:b] = torch.matmul(probs, vs).transpose(0, 1).to(q.dtype)
        lse[a:b] = m
    return out, lse


def flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's FA2 varlen kernel runs this call (else the float32 path)."""
    return (os.environ.get("EAGLE3_VARLEN_KERNEL", "flash") == "flash" and q.is_cuda
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
            and q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] <= 256
            and q.shape[-1] % 8 == 0)


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table,
               alibi_slopes, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
               zero_tensors, is_causal, window_size_left, window_size_right, softcap,
               return_softmax, num_splits, gen):
    unsupported = {"block_table (paged KV)": block_table is not None,
                   "seqused_k": seqused_k is not None, "leftpad_k": leftpad_k is not None,
                   "alibi_slopes": alibi_slopes is not None, "dropout": p_dropout > 0,
                   "softcap": softcap > 0,
                   "a sliding window": (window_size_left, window_size_right) != (-1, -1)
                   and not (is_causal and window_size_right in (0, -1)
                            and window_size_left == -1)}
    asked = [name for name, on in unsupported.items() if on]
    if asked:
        raise NotImplementedError(f"the varlen_fwd stand-in (tools/h200-kernels) has no {asked}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    total_q, heads = q.shape[0], q.shape[1]
    if flash_takes(q, k, v):
        o, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, is_causal,
            False, scale=softmax_scale)
        if out is None:
            return o, lse
        out.copy_(o)
        return out, lse
    if out is None:
        out = torch.empty(total_q, heads, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(heads, total_q, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        o, m = attention(q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]],
                         softmax_scale, is_causal)
        out[cq[s]:cq[s + 1]] = o
        lse[:, cq[s]:cq[s + 1]] = m
    return out, lse


def register() -> None:
    """Define `_vllm_fa2_C::varlen_fwd` once (importing this module does it)."""
    if hasattr(torch.ops._vllm_fa2_C, "varlen_fwd"):
        return
    lib = torch.library.Library("_vllm_fa2_C", "DEF")
    lib.define(SCHEMA)
    lib.impl("varlen_fwd", varlen_fwd, "CompositeExplicitAutograd")
    _LIBS.append(lib)  # a Library unregisters its ops when collected


_LIBS: list = []
register()
