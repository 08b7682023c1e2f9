"""MLA prefill's varlen attention: FlashAttention-2's kernel against the float32 stand-in.

    python3 tools/h200-kernels/test_varlen.py OUT.json [--heads 8,64] [--tokens 32768]

vllm_fa2_C.py runs `varlen_fwd` through torch's vendored FlashAttention-2 kernel on a CUDA
device and through torch in float32 elsewhere (or with EAGLE3_VARLEN_KERNEL=torch). This
checks, at MLA prefill's shapes (q and k of 192 = 128 nope + 64 rope, v padded to 192 as
vLLM's `_pad_v` does for FA2, causal, one batch of the bench mix's lengths under the token
budget), that both give the same output and log-sum-exp, and times each: what the stand-in
cost the runs made with it, and MLA prefill attention's share of a layer's time at the
heads a TP rank (8) and a PP stage (64) hold. On CPU it only times the stand-in (there
is no FA2 kernel there), so the script is rehearsed here as it runs there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "bench"))

import mix  # noqa: E402
import vllm_fa2_C as fa  # noqa: E402

QK, V = 192, 128


def batch(tokens: int, seed: int) -> list[int]:
    """Sequence lengths of the mix packed to at most `tokens` (as the job's budget does)."""
    out: list[int] = []
    for n in mix.lengths(tokens * 4, seed):
        if sum(out) + n <= tokens:
            out.append(n)
    return out


def call(q, k, v, lens, scale):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=q.device)
    out, lse = torch.ops._vllm_fa2_C.varlen_fwd(
        q, k, v, None, cu, cu, None, None, None, None, max(lens), max(lens), 0.0, scale,
        False, True, -1, -1, 0.0, False, 0, None)
    return out[..., :V], lse


def timed(fn, repeats: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--heads", default="8,64")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    lens = batch(args.tokens, 0)
    total = sum(lens)
    results = []
    for heads in (int(h) for h in args.heads.split(",")):
        g = torch.Generator(device=dev).manual_seed(heads)
        q = torch.randn(total, heads, QK, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(total, heads, QK, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.nn.functional.pad(
            torch.randn(total, heads, V, device=dev, dtype=torch.bfloat16, generator=g),
            (0, QK - V))
        scale = QK ** -0.5
        row = {"heads": heads, "tokens": total, "sequences": len(lens), "max_len": max(lens),
               "flash_takes": fa.flash_takes(q, k, v)}
        os.environ["EAGLE3_VARLEN_KERNEL"] = "torch"
        ref_out, ref_lse = call(q, k, v, lens, scale)
        row["torch_s"] = timed(lambda: call(q, k, v, lens, scale), args.repeats)
        os.environ["EAGLE3_VARLEN_KERNEL"] = "flash"
        if row["flash_takes"]:
            out, lse = call(q, k, v, lens, scale)
            row["flash_s"] = timed(lambda: call(q, k, v, lens, scale), args.repeats)
            row["speedup"] = row["torch_s"] / row["flash_s"]
        else:  # CPU: no FA2 kernel; the stand-in is tested in tests/test_kernel_kit.py
            out, lse = ref_out, ref_lse
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        lse_err = (lse.float() - ref_lse.float()).abs().max().item()
        row.update(out_rel_err=err, lse_max_abs_err=lse_err, ok=err < 1e-2 and lse_err < 1e-2)
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "lengths": lens, "results": results,
              "ok": all(r["ok"] for r in results)}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
