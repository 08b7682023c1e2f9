"""The plain values that travel between the stages of the data flow.

data -> batching -> engine -> writer: each stage takes and returns these, so
each can be tested alone and the engine can be swapped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass(frozen=True)
class Sample:
    """One tokenized conversation.

    `index` is the sample's identity: its position in the seeded dataset order.
    Resume, sharding and file names all key on it.
    """

    index: int
    input_ids: list[int]
    loss_mask: list[int]  # 1 on tokens of assistant turns, else 0; len == len(input_ids)
    truncated: bool = False  # cut to max_length under the "truncate" overlong policy

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Batch:
    """Samples prefilled together, under the engine's token budget."""

    samples: list[Sample]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.samples)


@dataclass
class ExtractedBatch:
    """What an engine returns for one batch.

    `states[i]` is `[T_i, L, H]` for `samples[i]`, layers in layer-id order, on the
    CPU, as stored: in the model dtype, or fp8 e4m3 with `scales[i]` float32
    `[T_i, 1, 1]` or `[T_i, L, 1]` (quant.py; `scales` is None otherwise). The tensors may be views into a reused host buffer:
    call `release()` once they are written (the engine waits for a free buffer
    before it reuses one). Rows == tokens is asserted before this is built.
    """

    samples: list[Sample]
    states: list[torch.Tensor]
    release: Callable[[], None] = field(default=lambda: None)
    seconds: float = 0.0
    finite_checked: bool = False  # the engine already refused NaN/Inf rows (on the device)
    scales: list[torch.Tensor] | None = None
    # Blocks until the states have landed and checks them (raises); None: already there.
    ready: Callable[[], None] | None = None

    def wait(self) -> None:
        """Before reading `states`: the engine may still be copying them (vLLM on CUDA
        overlaps the copy with the next prefill). Idempotent; raises what the check found."""
        if self.ready is not None:
            self.ready()


class Engine(Protocol):
    """A prefill engine that captures the residual stream at `layer_ids`.

    Layer convention (vLLM / EAGLE-3): id k in 1..N-1 is `hidden_states +
    residual` entering decoder layer k; id N is the final state before the
    final norm. Every engine (vLLM, HF reference) follows it.
    """

    layer_ids: list[int]
    num_layers: int
    hidden_size: int
    dtype: torch.dtype

    def extract(self, batch: Batch, wait: bool = True) -> ExtractedBatch:
        """`wait=False`: the states may still be arriving; `ExtractedBatch.wait()` first."""
        ...

    def prefill(self, batch: Batch) -> None:
        """The same forward passes with capture off: the benchmark's baseline."""
        ...

    def close(self) -> None: ...
