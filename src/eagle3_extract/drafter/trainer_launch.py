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
"""

import sys


def _cpu_shim() -> None:
    import torch
    import speculators.train.trainer as trainer

    import speculators.train.checkpointer as checkpointer

    trainer.get_local_rank = lambda: "cpu"
    checkpointer.get_current_device = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None


def main(argv: list[str]) -> None:
    import torch

    if not torch.accelerator.is_available():
        _cpu_shim()
    from speculators.train.cli import main as train_main
    from speculators.train.config import TrainConfig

    train_main(TrainConfig.resolve(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
