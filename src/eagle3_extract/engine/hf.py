"""Reference engine on plain HF transformers.

The fallback for models vLLM cannot load and the oracle for tests and
`eagle3-verify`: same interface, same layer convention, same outputs as the
vLLM engine, computed by an independent code path (one sample per forward, no
padding, so nothing about batching can leak into the numbers).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from eagle3_extract.layout import Storage
from eagle3_extract.quant import quantize
from eagle3_extract.types import Batch, ExtractedBatch
from eagle3_extract.engine import ModelInfo
from eagle3_extract.engine.layers import attach_capture, find_decoder_layers

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import EngineConfig, ModelConfig


class HFEngine:
    def __init__(self, engine: EngineConfig, model: ModelConfig, info: ModelInfo,
                 layer_ids: list[int], storage: Storage):
        from transformers import AutoModelForCausalLM

        device = getattr(engine, "device", "auto")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.layer_ids = list(layer_ids)
        self.num_layers = info.num_layers
        self.hidden_size = info.hidden_size
        self.dtype = info.dtype
        self.storage = storage
        self._stored = self.storage.stored_dtype(info.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            info.path,
            torch_dtype=info.dtype,
            trust_remote_code=bool(model.trust_remote_code),
        ).to(self.device)
        self.model.eval()
        _, self.layers = find_decoder_layers(self.model)
        if len(self.layers) != self.num_layers:
            raise ValueError(
                f"{info.path}: found {len(self.layers)} decoder layers, config says "
                f"{self.num_layers}"
            )
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = attach_capture(self.layers, self.layer_ids, self._sink)
        # Reused (pinned on CUDA) host slots, as the vLLM engine has: a fresh
        # pageable allocation per sample made the copy cost 38% of prefill on an H200.
        rows = int(getattr(engine, "token_budget", 0) or 0)
        slots = max(1, int(getattr(engine, "host_buffers", 2) or 2))
        pin = self.device.type == "cuda"
        self._host = [
            torch.empty((rows, len(self.layer_ids), self.hidden_size), dtype=self._stored,
                        pin_memory=pin)
            for _ in range(slots if rows else 0)
        ]
        self._free = list(range(len(self._host)))
        self._free_lock = threading.Lock()

    def _acquire(self, rows: int) -> tuple[torch.Tensor, Any]:
        with self._free_lock:
            slot = self._free.pop() if self._free and rows <= self._host[0].shape[0] else None
        if slot is None:  # every slot held (a caller that keeps its states), or oversize
            return torch.empty((rows, len(self.layer_ids), self.hidden_size),
                               dtype=self._stored), lambda: None
        done = threading.Event()

        def release() -> None:
            if done.is_set():
                return
            done.set()
            with self._free_lock:
                self._free.append(slot)

        return self._host[slot], release

    def _sink(self, column: int, state: torch.Tensor) -> None:
        self._captured[column] = state[0]  # batch of one: [T, H]

    @torch.inference_mode()
    def prefill(self, batch: Batch) -> None:
        """The same forwards with the hooks detached (benchmark baseline)."""
        for h in self._hooks:
            h.remove()
        try:
            for sample in batch.samples:
                ids = torch.tensor([sample.input_ids], device=self.device)
                self.model.get_decoder()(input_ids=ids, use_cache=False)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            self._hooks = attach_capture(self.layers, self.layer_ids, self._sink)

    @torch.inference_mode()
    def extract(self, batch: Batch, wait: bool = True) -> ExtractedBatch:
        """Synchronous whatever `wait` says: the states are on the host when it returns."""
        t0 = time.perf_counter()
        host, release = self._acquire(sum(len(s) for s in batch.samples))
        states, finite, row = [], [], 0
        scales = [] if self.storage.fp8 else None
        for sample in batch.samples:
            self._captured.clear()
            ids = torch.tensor([sample.input_ids], device=self.device)
            # The LM head is not needed: run the base model only.
            self.model.get_decoder()(input_ids=ids, use_cache=False)
            got = sorted(self._captured)
            if got != list(range(len(self.layer_ids))):
                raise RuntimeError(f"captured layer columns {got}, expected {self.layer_ids}")
            out = torch.stack([self._captured[c] for c in got], dim=1)
            if out.shape != (len(sample), len(self.layer_ids), self.hidden_size):
                release()
                raise RuntimeError(
                    f"sample {sample.index}: captured {tuple(out.shape)}, expected "
                    f"({len(sample)}, {len(self.layer_ids)}, {self.hidden_size})"
                )
            finite.append(torch.isfinite(out).all())  # on the device; read once below
            if scales is not None:  # fp8 on the device, before the copy (quant.py)
                out, sc = quantize(out, self.storage.scale)
                scales.append(sc.cpu())
            view = host[row : row + len(sample)]
            view.copy_(out, non_blocking=view.is_pinned())
            states.append(view)
            row += len(sample)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        bad = [s.index for s, ok in zip(batch.samples, torch.stack(finite).tolist()) if not ok]
        if bad:
            release()
            raise RuntimeError(f"NaN or Inf in the hidden states of samples {bad}")
        return ExtractedBatch(batch.samples, states, release=release,
                              seconds=time.perf_counter() - t0, finite_checked=True,
                              scales=scales)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
