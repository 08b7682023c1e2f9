"""Per-sample files, written atomically on writer threads while the engine runs.

Only this module writes `output.dir/data`, through the names layout.py
defines: temp name in the same directory, fsync, `os.replace`. So "the final
file exists" is what "done" means for resume, and a SIGKILL at any moment
leaves at most temp files, which the next run deletes.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from eagle3_extract.safetensors_file import save_safetensors
from eagle3_extract.layout import (EXTENSIONS, SCALES_KEY, STATES_KEY, sample_path, sample_temp)
from eagle3_extract.types import ExtractedBatch, Sample


class WriterError(RuntimeError):
    """A sample could not be written, or broke an invariant; the job must stop."""


def _fsync_replace(tmp: Path, final: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)


def check_invariants(sample: Sample, states: torch.Tensor, num_layers: int, hidden: int,
                     dtype: torch.dtype, check_finite: bool = True,
                     scales: torch.Tensor | None = None) -> None:
    """Rows == tokens, [T, L, H], the stored dtype, all finite, fp8 with its scales:
    checked before any write.

    `check_finite=False` when the engine already checked every row on the device
    (the vLLM engine does): on the host it is the writer's most expensive step.
    """
    want = (len(sample), num_layers, hidden)
    if tuple(states.shape) != want:
        raise WriterError(f"sample {sample.index}: states {tuple(states.shape)}, expected {want}")
    if states.dtype != dtype:
        raise WriterError(f"sample {sample.index}: states dtype {states.dtype}, expected {dtype}")
    if len(sample.loss_mask) != len(sample.input_ids):
        raise WriterError(f"sample {sample.index}: loss_mask and input_ids lengths differ")
    if check_finite and states.dtype != torch.float8_e4m3fn and not bool(
            torch.isfinite(states).all()):
        raise WriterError(f"sample {sample.index}: NaN or Inf in the hidden states")
    if (states.dtype == torch.float8_e4m3fn) != (scales is not None):
        raise WriterError(f"sample {sample.index}: {states.dtype} states "
                          f"{'without' if scales is None else 'with'} scales")
    if scales is not None:
        from eagle3_extract.quant import check_scales

        why = check_scales(states, scales)
        if why:
            raise WriterError(f"sample {sample.index}: {why}")


def write_sample(path: Path, sample: Sample, states: torch.Tensor, fmt: str,
                 layer_ids: list[int], run_id: str,
                 scales: torch.Tensor | None = None) -> int:
    """Write one sample atomically; return its size in bytes. fp8 states go with their
    `scales` (speculators 0.9.0's fp8 layout, quant.py)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = sample_temp(path)
    input_ids = torch.tensor(sample.input_ids, dtype=torch.int64)
    if fmt == "safetensors":
        save_safetensors(
            {
                "input_ids": input_ids,
                "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.uint8),
                STATES_KEY: states.contiguous(),
                **({SCALES_KEY: scales} if scales is not None else {}),
            },
            tmp,
            metadata={
                "sample_index": str(sample.index),
                "layer_ids": json.dumps(list(layer_ids)),
                "run_id": run_id,
                "truncated": json.dumps(bool(sample.truncated)),
            },
        )
    elif fmt == "speculators_pt":
        # speculators 0.3.0 v1 layout. clone(): torch.save stores a view's whole
        # storage, which here is the engine's shared host buffer.
        torch.save(
            {
                "input_ids": input_ids,
                "loss_mask": torch.tensor(sample.loss_mask, dtype=torch.int64),
                STATES_KEY: [states[:, j, :].clone() for j in range(states.shape[1])],
            },
            tmp,
        )
    else:
        raise WriterError(f"output.format={fmt!r} is not one of {sorted(EXTENSIONS)}")
    _fsync_replace(tmp, path)
    return path.stat().st_size


class _Pending:
    """One batch in flight: its samples are written by any thread; the last releases it."""

    def __init__(self, eb: ExtractedBatch):
        self.eb = eb
        self.left = len(eb.samples)
        self.lock = threading.Lock()

    def finish_one(self) -> bool:
        with self.lock:
            self.left -= 1
            return self.left == 0


class Writer:
    """Writer threads fed from the main loop; at most `max_pending` batches in flight.

    `submit()` blocks while `max_pending` batches are unwritten (bounded memory)
    and re-raises the first writer error in the main thread. Each batch's
    `release()` is called exactly once, after all its samples are written (or
    failed). `on_sample(sample, nbytes)` is called after each file lands.
    """

    def __init__(self, root: Path, fmt: str, files_per_dir: int, layer_ids: list[int],
                 hidden_size: int, dtype: torch.dtype, run_id: str, threads: int = 2,
                 max_pending: int = 2,
                 on_sample: Callable[[Sample, int], None] | None = None):
        if fmt not in EXTENSIONS:
            raise WriterError(f"output.format={fmt!r} is not one of {sorted(EXTENSIONS)}")
        self.root, self.fmt, self.files_per_dir = Path(root), fmt, files_per_dir
        self.layer_ids, self.hidden_size, self.dtype = list(layer_ids), hidden_size, dtype
        self.run_id = run_id
        self.on_sample = on_sample
        self.written = 0
        self.bytes = 0
        self.tokens = 0
        # (time, tokens) when each batch's last file landed: the steady rate's clock.
        self.landed: list[tuple[float, int]] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._slots = threading.Semaphore(max(1, max_pending))
        self._tasks: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._work, name=f"eagle3-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    def path(self, index: int) -> Path:
        return sample_path(self.root, index, self.files_per_dir, self.fmt)

    def raise_if_failed(self) -> None:
        if self._error is not None:
            err = self._error
            if isinstance(err, WriterError):
                raise err
            raise WriterError(f"writer thread failed: {type(err).__name__}: {err}") from err

    def submit(self, eb: ExtractedBatch) -> None:
        if len(eb.states) != len(eb.samples):
            eb.release()
            raise WriterError(f"{len(eb.states)} states for {len(eb.samples)} samples")
        while not self._slots.acquire(timeout=0.2):
            self.raise_if_failed()
        try:
            self.raise_if_failed()
        except BaseException:
            self._slots.release()
            eb.release()
            raise
        if not eb.samples:
            eb.release()
            self._slots.release()
            return
        pending = _Pending(eb)
        for i in range(len(eb.samples)):
            self._tasks.put((pending, i))

    def _work(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            pending, i = item
            sample, states = pending.eb.samples[i], pending.eb.states[i]
            scales = pending.eb.scales[i] if pending.eb.scales is not None else None
            try:
                if self._error is None:
                    pending.eb.wait()  # the engine's copy has landed and passed its checks
                    check_invariants(sample, states, len(self.layer_ids), self.hidden_size,
                                     self.dtype, check_finite=not pending.eb.finite_checked,
                                     scales=scales)
                    n = write_sample(self.path(sample.index), sample, states, self.fmt,
                                     self.layer_ids, self.run_id, scales)
                    with self._lock:
                        self.written += 1
                        self.bytes += n
                        self.tokens += len(sample)
                    if self.on_sample is not None:
                        self.on_sample(sample, n)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                with self._lock:
                    if self._error is None:
                        self._error = e
            finally:
                if pending.finish_one():
                    with self._lock:
                        self.landed.append((time.perf_counter(),
                                            sum(len(s) for s in pending.eb.samples)))
                    try:
                        pending.eb.release()
                    except BaseException as e:  # noqa: BLE001
                        with self._lock:
                            if self._error is None:
                                self._error = e
                    self._slots.release()

    def close(self) -> None:
        """Write everything submitted, stop the threads, re-raise the first error."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._tasks.put(None)
            for t in self._threads:
                t.join()
        self.raise_if_failed()
