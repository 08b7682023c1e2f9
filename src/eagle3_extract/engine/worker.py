"""The capture inside vLLM's workers: a worker extension loaded by qualified name.

vLLM adds `worker_extension_cls` to its Worker's bases, so these methods run
in every worker process and the driver calls them with `collective_rpc`.

Capture is by forward hooks on the decoder layers (engine/layers.py), never a
copy of the model's layer loop: vLLM 0.16 calls layers positionally and
DeepseekV2/V3 (Kimi-K2.5) layers take a fourth `llama_4_scaling` argument that
a copied loop silently drops. Only TP rank 0 of each pipeline stage captures
(all TP ranks hold the same all-reduced stream), each stage the layers it owns.

Rows go into a preallocated device buffer in the order the model runner laid
out the tokens; per forward pass the extension records that order (request
ids) and the token positions, so the driver can cut rows per request and check
that every request ran whole, from position 0 (engine/vllm.py).
"""

from __future__ import annotations

import logging

import torch

from eagle3_extract.quant import FP8, quantize_into
from eagle3_extract.engine import cpu_gemm, hostbuf, resolve_layer_ids
from eagle3_extract.engine.layers import find_decoder_layers, residual_stream

log = logging.getLogger(__name__)

QUALNAME = f"{__name__}.CaptureExtension"


class CaptureExtension:
    """Mixed into vLLM's Worker; `self.model_runner` is the worker's runner."""

    def cpu_gemm_upcast(self) -> int:
        """Float32 products for bf16 linears where the CPU build lacks oneDNN (cpu_gemm.py)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        if not cpu_gemm.needs_upcast(runner.device):
            return 0
        if not getattr(self, "_cpu_gemm_upcast", 0):
            self._cpu_gemm_upcast = cpu_gemm.upcast_linears(runner.model)
            log.debug("CPU build without oneDNN: %d bf16 linears in float32",
                      self._cpu_gemm_upcast)
        return self._cpu_gemm_upcast

    def capture_setup(self, layer_ids: list[int], max_rows: int,
                      scale_cols: int = 0) -> dict | None:
        """Attach hooks for the layers this rank owns; return its capture plan.

        `scale_cols` > 0: the rows are stored as fp8 with that many float32 scales
        per token (1: over every layer, len(layer_ids): per layer; quant.py),
        quantized here on the device before the copy to the host.
        """
        from vllm.distributed import get_pp_group, get_tp_group
        from vllm.model_executor.models.utils import PPMissingLayer

        runner = self.model_runner  # type: ignore[attr-defined]
        self.cpu_gemm_upcast()
        path, layers = find_decoder_layers(runner.model)
        self.capture_layer_ids = resolve_layer_ids(list(layer_ids), len(layers))
        for handle in getattr(self, "_capture_hooks", []):
            handle.remove()
        self._capture_hooks: list = []
        self._columns: list[int] = []
        self._device_buf: torch.Tensor | None = None
        self._scale_cols = int(scale_cols)
        self._steps: list[tuple[list[str], int, int]] = []
        self._rows = 0
        self.capture_enabled = True
        if get_tp_group().rank_in_group != 0:
            return None
        self._columns = [c for c, k in enumerate(layer_ids)
                         if not isinstance(layers[k - 1], PPMissingLayer)]
        if not self._columns:
            return None
        hidden = runner.model_config.get_hidden_size()
        shape = (max_rows, len(layer_ids), hidden)
        # On CUDA the copy of call i runs on a side stream while call i+1's prefill runs:
        # two device buffers, the hooks of one call filling one while the other is copied.
        self._overlap = runner.device.type == "cuda"
        self._device_bufs = [torch.empty(shape, dtype=runner.model_config.dtype,
                                         device=runner.device)
                             for _ in range(2 if self._overlap else 1)]
        self._buf = 0
        self._device_buf = self._device_bufs[0]
        self._copy_stream = torch.cuda.Stream(runner.device) if self._overlap else None
        self._copied: list = [None] * len(self._device_bufs)  # events: buffer k was read
        self._positions = torch.empty(max_rows, dtype=torch.long, device=runner.device)
        self._finite = torch.empty(max_rows, dtype=torch.uint8, device=runner.device)
        self._ticket = torch.empty(1, dtype=torch.int64, device=runner.device)
        if self._scale_cols:
            if self._scale_cols == 1 and self._columns != list(range(len(layer_ids))):
                raise RuntimeError("one fp8 scale per token spans every layer; this stage "
                                   f"owns columns {self._columns}: use fp8_scale=token_layer")
            self._device_q = torch.empty(shape, dtype=FP8, device=runner.device)
            self._device_s = torch.empty((max_rows, self._scale_cols), dtype=torch.float32,
                                         device=runner.device)
        held = [*self._device_bufs, self._positions, self._finite, self._ticket]
        if self._scale_cols:
            held += [self._device_q, self._device_s]
        for column in self._columns:
            hook = self._hook(column, first=column == self._columns[0])
            self._capture_hooks.append(
                layers[layer_ids[column] - 1].register_forward_hook(hook, with_kwargs=True))
        self._pp_rank = pp_rank = get_pp_group().rank_in_group
        log.debug("capture on PP rank %d (%s, %d layers): ids %s", pp_rank, path, len(layers),
                 [layer_ids[c] for c in self._columns])
        return {"pp_rank": pp_rank, "pp_size": get_pp_group().world_size,
                "columns": self._columns, "layers_path": path, "num_layers": len(layers),
                "overlap": self._overlap, "device_bytes": sum(t.nbytes for t in held)}

    def _hook(self, column: int, first: bool):
        def hook(module, args, kwargs, output):
            if not self.capture_enabled:
                return
            state = residual_stream(output)
            rows = state.shape[0]
            if first:  # the first captured layer of a forward pass opens a step
                start = self._rows
                if start + rows > self._device_buf.shape[0]:
                    raise RuntimeError(
                        f"capture buffer overflow: {start + rows} rows > "
                        f"{self._device_buf.shape[0]}; lower engine.token_budget")
                positions = args[0] if args else kwargs["positions"]
                if positions.dim() == 2:  # M-RoPE: [3, T]
                    positions = positions[0]
                self._positions[start:start + rows].copy_(positions[:rows])
                req_ids = [r for r in self.model_runner.input_batch.req_ids if r is not None]
                self._steps.append((req_ids, start, rows))
                self._rows = start + rows
            _, start, step_rows = self._steps[-1]
            if rows != step_rows:
                raise RuntimeError(f"layer id {self.capture_layer_ids[column]} saw {rows} rows, "
                                   f"the step has {step_rows}")
            self._device_buf[start:start + rows, column].copy_(state)

        return hook

    def capture_reset(self, enabled: bool = True) -> None:
        """Start a call; `enabled=False` makes the hooks no-ops (the prefill baseline)."""
        self._steps, self._rows = [], 0
        self.capture_enabled = enabled

    def capture_attach_host(self, path: str, layout: hostbuf.Layout, driver_host: str):
        """Map the driver's shared host buffer (engine/hostbuf.py)."""
        if self._device_buf is None:
            return None
        self._host, self._host_pinned = hostbuf.attach(path, layout, driver_host,
                                                       pin=self._device_buf.is_cuda)
        if not self._host_pinned:
            self._overlap = False  # a pageable copy is synchronous anyway
        return {"pinned": self._host_pinned}

    def capture_flush(self, slot: int, ticket: int) -> dict | None:
        """Copy this call's rows into host slot `slot`: one device-to-host copy per call.

        Returns the layout only (columns owned, steps, positions); the rows, their
        per-row finite flags (computed on the device) and, last, `ticket` as the slot's
        ready mark go into the host buffer. On CUDA with a pinned buffer that happens on
        a side stream and this returns at once: the copy overlaps the next call's
        prefill, and the driver's writer waits for the mark (VllmEngine._wait_ready).
        """
        if self._device_buf is None:
            return None
        rows, steps = self._rows, self._steps
        positions = self._positions[:rows].to("cpu")  # the main stream: its prefill is done
        if self._overlap:
            main = torch.cuda.current_stream()
            self._copy_stream.wait_stream(main)
            with torch.cuda.stream(self._copy_stream):
                self._copy_out(slot, ticket, rows)
                done = torch.cuda.Event()
                done.record()
            self._copied[self._buf] = done
            self._buf ^= 1
            self._device_buf = self._device_bufs[self._buf]
            if self._copied[self._buf] is not None:  # the next call's hooks overwrite it
                main.wait_event(self._copied[self._buf])
        else:
            self._copy_out(slot, ticket, rows)
            if self._device_buf.is_cuda:
                torch.cuda.current_stream().synchronize()
            self._host["ready"][slot, self._pp_rank] = ticket
        self._steps, self._rows = [], 0
        return {"columns": self._columns, "steps": steps, "positions": positions}

    def _copy_out(self, slot: int, ticket: int, rows: int) -> None:
        """Finite flags, fp8 (if asked), the copies, then the ready mark, in stream order."""
        c0, c1 = self._columns[0], self._columns[-1] + 1
        host, pinned = self._host, self._host_pinned
        captured = self._device_buf[:rows, c0:c1]
        finite = self._finite[:rows]
        if self._scale_cols:  # fp8 on the device: the copy moves half the bytes
            s0, s1 = (c0, c1) if self._scale_cols > 1 else (0, 1)
            quantize_into(captured, self._device_q[:rows, c0:c1], self._device_s[:rows, s0:s1])
            captured = self._device_q[:rows, c0:c1]
            # a NaN/Inf row has a non-finite scale (quant.quantize_into)
            finite.copy_(torch.isfinite(self._device_s[:rows, s0:s1]).all(dim=1))
            host["scales"][slot, :rows, s0:s1].copy_(self._device_s[:rows, s0:s1],
                                                     non_blocking=pinned)
        else:  # one reduction, no [rows, L, H] temporary: NaN and Inf survive a sum
            finite.copy_(torch.isfinite(captured.sum(dim=(1, 2), dtype=torch.float32)))
        host["states"][slot, :rows, c0:c1].copy_(captured, non_blocking=pinned)
        host["finite"][slot, self._pp_rank, :rows].copy_(finite, non_blocking=pinned)
        if self._overlap:
            self._ticket.fill_(ticket)
            host["ready"][slot, self._pp_rank:self._pp_rank + 1].copy_(self._ticket,
                                                                       non_blocking=True)
