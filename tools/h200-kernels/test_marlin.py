"""The kit's Marlin MoE inside vLLM 0.16.0's own Python, against a torch MoE over the
dequantized weights (issue 25 (c)).

    PYTHONPATH=SITE:tools/h200-kernels:bench EAGLE3_KERNEL_KIT=KIT \
        python3 tools/h200-kernels/test_marlin.py [REPORT.json]

Experts quantized by bench/prediction/w4a16.py (compressed-tensors' W4A16, groups of 32), laid out
as vLLM's loader lays out a compressed-tensors checkpoint for Marlin (each
`weight_packed` [N, K/8] and `weight_scale` [N, K/32] transposed, gate and up
stacked), repacked with `gptq_marlin_moe_repack` and `marlin_moe_permute_scales` as
CompressedTensorsWNA16MarlinMoEMethod.process_weights_after_loading does, then
`fused_marlin_moe` as its apply() calls it. Kimi-K2.5's per-rank shapes at TP 8
(hidden 7168, expert width 2048 / 8) and at TP 1, 8 of 16 experts a token.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import w4a16  # bench/prediction/w4a16.py, on PYTHONPATH

DEV, BF16, GROUP = "cuda", torch.bfloat16, 32


def quantized_experts(e: int, n: int, k: int, g: torch.Generator):
    """E experts of [n, k]: (dequantized [E, n, k], packed as loaded [E, k/8, n],
    scales as loaded [E, k/32, n])."""
    deq, packed, scales = [], [], []
    for _ in range(e):
        w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(BF16)
        q, s = w4a16.quantize(w, GROUP)
        deq.append(w4a16.dequantize(q, s))
        packed.append(w4a16.pack(q).t())
        scales.append(s.t())
    return torch.stack(deq), torch.stack(packed).contiguous(), torch.stack(scales).contiguous()


def reference(x, w13, w2, topk_w, topk_ids):
    out = torch.zeros(x.shape, device=DEV, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = x[t].float() @ w13[e].float().t()
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += topk_w[t, j] * (a.to(BF16).float() @ w2[e].float().t())
    return out


def case(tokens: int, hidden: int, inter: int, experts: int, topk: int, seed: int) -> dict:
    import vllm._C  # noqa: F401 - the kit's vllm/_C: loads the library (EAGLE3_KERNEL_KIT)
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.fused_moe.fused_marlin_moe import fused_marlin_moe
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        marlin_make_workspace_new,
        marlin_moe_permute_scales,
    )
    from vllm.scalar_type import scalar_types

    g = torch.Generator(DEV).manual_seed(seed)
    gate, gate_p, gate_s = quantized_experts(experts, inter, hidden, g)
    up, up_p, up_s = quantized_experts(experts, inter, hidden, g)
    down, w2_p, w2_s = quantized_experts(experts, hidden, inter, g)
    w13 = torch.cat((gate, up), 1)  # [E, 2I, H]: gate first, as vLLM loads w1 then w3
    w13_p, w13_s = torch.cat((gate_p, up_p), 2), torch.cat((gate_s, up_s), 2)
    empty = torch.empty((experts, 0), dtype=torch.int32, device=DEV)
    m13 = ops.gptq_marlin_moe_repack(w13_p, empty, hidden, 2 * inter, 4)
    m2 = ops.gptq_marlin_moe_repack(w2_p, empty, inter, hidden, 4)
    s13 = marlin_moe_permute_scales(s=w13_s, size_k=hidden, size_n=2 * inter,
                                    group_size=GROUP)
    s2 = marlin_moe_permute_scales(s=w2_s, size_k=inter, size_n=hidden, group_size=GROUP)
    x = torch.randn(tokens, hidden, device=DEV, generator=g).to(BF16)
    logits = torch.randn(tokens, experts, device=DEV, generator=g)
    topk_w, topk_ids = torch.topk(logits.softmax(-1), topk, dim=-1)
    topk_w = topk_w / topk_w.sum(-1, keepdim=True)
    got = fused_marlin_moe(x, m13, m2, None, None, s13, s2, topk_w, topk_ids.to(torch.int32),
                           quant_type_id=scalar_types.uint4b8.id, global_num_experts=experts,
                           g_idx1=empty, g_idx2=empty, sort_indices1=empty,
                           sort_indices2=empty, workspace=marlin_make_workspace_new(DEV, 4),
                           is_k_full=True)
    want = reference(x, w13, down, topk_w, topk_ids)
    per_tok = ((got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12))
    return {"tokens": tokens, "hidden": hidden, "inter": inter, "experts": experts,
            "topk": topk, "rel_err_median": float(per_tok.median()),
            "rel_err_max": float(per_tok.max())}


def main(report: str | None) -> int:
    t0 = time.perf_counter()
    tol_median, tol_max = 1e-2, 4e-2  # bf16 outputs of a bf16 reference on the same weights
    results = []
    for args in ((200, 7168, 256, 16, 8, 0), (37, 7168, 2048, 16, 8, 1), (1, 1024, 512, 8, 2, 2)):
        try:
            r = case(*args)
            r["ok"] = r["rel_err_median"] <= tol_median and r["rel_err_max"] <= tol_max
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            r = {"case": args, "ok": False, "error": f"{type(e).__name__}: {e}"}
        print(("ok  " if r["ok"] else "BAD ") + json.dumps(r))
        results.append(r)
    ok = all(r["ok"] for r in results)
    out = {"ok": ok, "tol_median": tol_median, "tol_max": tol_max, "results": results,
           "seconds": round(time.perf_counter() - t0, 1)}
    if report:
        Path(report).write_text(json.dumps(out, indent=2) + "\n")
    print("marlin moe matches" if ok else "marlin moe differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
