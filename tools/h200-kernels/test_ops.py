"""Each kit op against a torch reference on the GPU (vLLM's own native paths, ported).

    python3 tools/h200-kernels/test_ops.py KIT_DIR [REPORT.json]

The references follow vLLM 0.16.0's Python: `RMSNorm.forward_static`,
`RotaryEmbedding.forward_static`, `SiluAndMul.forward_native`, the native
`grouped_topk` and `fused_topk_bias` (fused_moe/router/), and the cache layouts of
`reshape_and_cache_flash` / `concat_and_cache_mla`. The in-place ops are also checked
to have written into their arguments (a capture that keeps a view sees that write).
Prints one line per op and exits 1 if any differs beyond its tolerance.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kit  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16
RESULTS: dict[str, dict] = {}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def record(name: str, err: float, tol: float, **extra) -> None:
    ok = err <= tol
    RESULTS[name] = {"rel_err": err, "tol": tol, "ok": ok, **extra}
    print(f"{'ok ' if ok else 'BAD'} {name}: rel err {err:.2e} (tol {tol:.0e}) {extra or ''}")


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def test_norms() -> None:
    g = torch.Generator(DEV).manual_seed(0)
    T, H, eps = 4096, 4096, 1e-5
    x = torch.randn(T, H, device=DEV, dtype=BF16, generator=g)
    r = torch.randn(T, H, device=DEV, dtype=BF16, generator=g)
    w = torch.rand(H, device=DEV, dtype=BF16, generator=g) + 0.5
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, eps)
    record("rms_norm", rel(out, rms_ref(x, w, eps)), 1e-2)
    x2, r2 = x.clone(), r.clone()
    ptr_x, ptr_r = x2.data_ptr(), r2.data_ptr()
    torch.ops._C.fused_add_rms_norm(x2, r2, w, eps)
    want_r = (x.float() + r.float()).to(BF16)  # the residual stream, rounded as vLLM's
    record("fused_add_rms_norm.residual", rel(r2, want_r), 1e-2,
           in_place=r2.data_ptr() == ptr_r)
    record("fused_add_rms_norm.out", rel(x2, rms_ref(want_r, w, eps)), 1e-2,
           in_place=x2.data_ptr() == ptr_x,
           input_rewritten=not torch.equal(x2, x))


def test_activations() -> None:
    g = torch.Generator(DEV).manual_seed(1)
    x = torch.randn(2048, 2 * 14336, device=DEV, dtype=BF16, generator=g)
    d = x.shape[-1] // 2
    for op, ref in (("silu_and_mul", F.silu(x[:, :d].float()) * x[:, d:].float()),
                    ("gelu_and_mul", F.gelu(x[:, :d].float()) * x[:, d:].float()),
                    ("gelu_tanh_and_mul",
                     F.gelu(x[:, :d].float(), approximate="tanh") * x[:, d:].float())):
        out = torch.empty(x.shape[0], d, device=DEV, dtype=BF16)
        getattr(torch.ops._C, op)(out, x)
        record(op, rel(out, ref), 1e-2)


def rope_ref(pos, x, head, cache, neox):
    """RotaryEmbedding.forward_static for one of query/key [T, heads * head]."""
    T = x.shape[0]
    cos, sin = cache[pos].float().chunk(2, dim=-1)
    xs = x.view(T, -1, head).float()
    rot = cache.shape[-1]
    xr, xp = xs[..., :rot], xs[..., rot:]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if neox:
        x1, x2 = xr.chunk(2, dim=-1)
        o = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xr[..., ::2], xr[..., 1::2]
        o = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((o, xp), dim=-1).view(T, -1).to(x.dtype)


def test_rotary() -> None:
    g = torch.Generator(DEV).manual_seed(2)
    T, head = 3000, 128
    pos = torch.randint(0, 8192, (T,), device=DEV, generator=g)
    for neox, rot, heads in ((True, 128, 32), (False, 64, 16)):  # Llama; DeepseekV3's rope
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=DEV).float() / rot))
        freqs = torch.outer(torch.arange(8192, device=DEV).float(), inv)
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(BF16)
        q = torch.randn(T, heads * head, device=DEV, dtype=BF16, generator=g)
        k = torch.randn(T, 8 * head, device=DEV, dtype=BF16, generator=g)
        q2, k2 = q.clone(), k.clone()
        torch.ops._C.rotary_embedding(pos, q2, k2, head, cache, neox)
        name = f"rotary_embedding.{'neox' if neox else 'gptj'}"
        record(name + ".q", rel(q2, rope_ref(pos, q, head, cache, neox)), 1e-2)
        record(name + ".k", rel(k2, rope_ref(pos, k, head, cache, neox)), 1e-2)


def test_caches() -> None:
    g = torch.Generator(DEV).manual_seed(3)
    T, blocks, bs = 1000, 64, 16
    slots = torch.randperm(blocks * bs, device=DEV, generator=g)[:T]
    scale = torch.ones(1, device=DEV, dtype=torch.float32)
    kv_c = torch.randn(T, 512, device=DEV, dtype=BF16, generator=g)  # Kimi-K2.5's ranks
    k_pe = torch.randn(T, 64, device=DEV, dtype=BF16, generator=g)
    cache = torch.zeros(blocks, bs, 576, device=DEV, dtype=BF16)
    torch.ops._C_cache_ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, "auto", scale)
    got = cache.view(-1, 576)[slots]
    record("concat_and_cache_mla", rel(got, torch.cat((kv_c, k_pe), -1)), 0.0,
           untouched_zero=bool((cache.view(-1, 576).abs().sum(-1) > 0).sum() == T))
    key = torch.randn(T, 8, 128, device=DEV, dtype=BF16, generator=g)
    val = torch.randn(T, 8, 128, device=DEV, dtype=BF16, generator=g)
    kc = torch.zeros(blocks, bs, 8, 128, device=DEV, dtype=BF16)
    vc = torch.zeros_like(kc)
    torch.ops._C_cache_ops.reshape_and_cache_flash(key, val, kc, vc, slots, "auto", scale,
                                                   scale)
    record("reshape_and_cache_flash", max(rel(kc.view(-1, 8, 128)[slots], key),
                                          rel(vc.view(-1, 8, 128)[slots], val)), 0.0)


def grouped_topk_ref(logits, n_group, topk_group, topk, renorm, scale, bias):
    """vLLM 0.16.0's native grouped_topk, sigmoid scoring with a correction bias."""
    scores = logits.float().sigmoid()
    n = scores.shape[0]
    biased = scores + bias.unsqueeze(0)
    group = biased.view(n, n_group, -1).topk(2, dim=-1)[0].sum(-1)
    gidx = group.topk(topk_group, dim=-1)[1]
    mask = torch.zeros_like(group).scatter_(1, gidx, 1)
    mask = mask.unsqueeze(-1).expand(n, n_group, scores.shape[-1] // n_group).reshape(n, -1)
    ids = biased.masked_fill(~mask.bool(), float("-inf")).topk(topk, dim=-1)[1]
    w = scores.gather(1, ids)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    return w * scale, ids


def same_choice(w, ids, w_ref, ids_ref) -> tuple[float, float]:
    """(share of tokens whose expert sets differ, rel err of the weights by expert)."""
    order, order_ref = ids.long().sort(-1), ids_ref.long().sort(-1)
    differ = float((order.values != order_ref.values).any(-1).float().mean())
    ws = w.float().gather(1, order.indices)
    ws_ref = w_ref.float().gather(1, order_ref.indices)
    return differ, rel(ws, ws_ref)


def test_routing() -> None:
    g = torch.Generator(DEV).manual_seed(4)
    T = 4096
    # Kimi-K2.5 / DeepseekV3: 384 (256) experts, sigmoid, correction bias, top-8; Kimi
    # has 1 group (n_group=1, topk_group=1), DeepseekV3 8 groups, top 4 groups.
    for E, n_group, topk_group, scale in ((384, 1, 1, 2.827), (256, 8, 4, 2.5)):
        logits = torch.randn(T, E, device=DEV, dtype=torch.float32, generator=g)
        bias = torch.randn(E, device=DEV, dtype=torch.float32, generator=g) * 0.1
        w, ids = torch.ops._moe_C.grouped_topk(logits, n_group, topk_group, 8, True, scale,
                                               bias, 1)
        w_ref, ids_ref = grouped_topk_ref(logits, n_group, topk_group, 8, True, scale, bias)
        differ, err = same_choice(w, ids, w_ref, ids_ref)
        record(f"grouped_topk.E{E}.g{n_group}", err, 1e-4, tokens_with_other_experts=differ)
        tw = torch.empty(T, 8, device=DEV, dtype=torch.float32)
        ti = torch.empty(T, 8, device=DEV, dtype=torch.int32)
        te = torch.empty(T, 8, device=DEV, dtype=torch.int32)
        torch.ops._moe_C.topk_sigmoid(tw, ti, te, logits, True, bias)
        s = logits.sigmoid()
        ids_ref = (s + bias).topk(8, -1)[1]
        w_ref = s.gather(1, ids_ref)
        differ, err = same_choice(tw, ti, w_ref / w_ref.sum(-1, keepdim=True), ids_ref)
        record(f"topk_sigmoid.E{E}", err, 1e-4, tokens_with_other_experts=differ)
    logits = torch.randn(T, 64, device=DEV, dtype=torch.float32, generator=g)
    tw = torch.empty(T, 6, device=DEV, dtype=torch.float32)
    ti = torch.empty(T, 6, device=DEV, dtype=torch.int32)
    te = torch.empty(T, 6, device=DEV, dtype=torch.int32)
    torch.ops._moe_C.topk_softmax(tw, ti, te, logits, True, None)
    p = logits.softmax(-1)
    w_ref, ids_ref = p.topk(6, -1)
    differ, err = same_choice(tw, ti, w_ref / w_ref.sum(-1, keepdim=True), ids_ref)
    record("topk_softmax.E64", err, 1e-4, tokens_with_other_experts=differ)


def test_align_and_sum() -> None:
    g = torch.Generator(DEV).manual_seed(5)
    T, k, E, block = 1000, 8, 64, 64
    ids = torch.stack([torch.randperm(E, device=DEV, generator=g)[:k] for _ in range(T)]
                      ).to(torch.int32)
    max_pad = T * k + E * (block - 1)
    sorted_ids = torch.empty(max_pad, dtype=torch.int32, device=DEV)
    expert_ids = torch.empty((max_pad + block - 1) // block, dtype=torch.int32, device=DEV)
    post = torch.empty(1, dtype=torch.int32, device=DEV)
    torch.ops._moe_C.moe_align_block_size(ids, E, block, sorted_ids, expert_ids, post, None)
    n = int(post.item())
    flat = ids.flatten()
    counts = torch.bincount(flat.long(), minlength=E)
    want_n = int(((counts + block - 1) // block * block).sum())
    seen = sorted_ids[:n]
    real = seen[seen < T * k].long()
    ok = (n == want_n and sorted(real.tolist()) == list(range(T * k))
          and all(int(flat[i]) == int(expert_ids[j // block]) for j, i in
                  enumerate(seen.tolist()) if i < T * k))
    record("moe_align_block_size", 0.0 if ok else 1.0, 0.0, padded=n, expected=want_n)
    x = torch.randn(T, k, 4096, device=DEV, dtype=BF16, generator=g)
    out = torch.empty(T, 4096, device=DEV, dtype=BF16)
    torch.ops._moe_C.moe_sum(x, out)
    record("moe_sum", rel(out, x.float().sum(1)), 1e-2)


def main(kit_dir: str, report: str | None) -> int:
    t0 = time.perf_counter()
    built = kit.load(kit_dir)
    for test in (test_norms, test_activations, test_rotary, test_caches, test_routing,
                 test_align_and_sum):
        try:
            test()
        except Exception as e:  # noqa: BLE001 - reported, and the run fails
            RESULTS[test.__name__] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(f"BAD {test.__name__}: {type(e).__name__}: {e}")
    ok = all(r["ok"] for r in RESULTS.values())
    out = {"ok": ok, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "build": built, "results": RESULTS, "seconds": round(time.perf_counter() - t0, 1)}
    if report:
        Path(report).write_text(json.dumps(out, indent=2) + "\n")
    print("all ops match" if ok else "some ops differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None))
