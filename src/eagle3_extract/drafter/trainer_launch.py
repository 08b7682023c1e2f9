"""Runs `speculators train` (speculators 0.9.0) inside the trainer's own environment.

Started by eagle3-train as `<trainer python> trainer_launch.py <speculators train flags>`;
a plain script (no import of eagle3_extract: that environment has transformers 5 and no
vLLM). On a machine with an accelerator it is exactly `speculators train`. Without one
(this project's CI, a laptop) speculators 0.9.0 stops at "Cannot access accelerator device
when none is available": its Trainer moves the model and every batch to
`get_local_rank()`, an int, i.e. a GPU index, its timers call
`torch.accelerator.synchronize()`, and its checkpointer loads an epoch checkpoint to resume
from onto `get_current_device()`, which says "cuda:0" without an accelerator. Here those
three are answered for the CPU; nothing else of the trainer changes (its fused loss needs Triton: eagle3-train passes
`--loss-implementation eager` on CPU).

On a CPU without native bf16 matmuls (no AVX-512: torch.ops.mkldnn says so), Muon's
Newton-Schulz iteration, which torch runs in bf16, falls to torch's scalar bf16 GEMM: 17x
slower than float32 at the drafter's shapes, 80 s of a 120 s step on CI's AVX2 hosts. There
the same iteration runs in float32 (the result rounded to bf16 as torch's is).
"""

import sys


def _cpu_shim() -> None:
    import torch
    import speculators.train.trainer as trainer

    import speculators.train.checkpointer as checkpointer

    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None


def newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim._muon._zeropower_via_newtonschulz, its products in float32."""
    import torch

    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x.bfloat16()


def _cpu_muon_float32() -> bool:
    import torch
    import torch.optim._muon as muon

    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    muon._zeropower_via_newtonschulz = newton_schulz_float32
    return True


def main(argv: list[str]) -> None:
    import torch

    if not torch.accelerator.is_available():
        _cpu_shim()
        _cpu_muon_float32()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
