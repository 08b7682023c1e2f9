"""The timed phases, run on one engine instance over the same batches.

(1) prefill: engine.prefill, capture off: the baseline.
(2) host: engine.extract + release: capture, device-to-host copy, nothing else.
(3) disk: engine.extract into the real Writer, its threads writing batch i
    while the engine runs batch i+1, as the job does.
Diagnostics (--breakdown): the Writer alone on states already in memory, the
disk's raw fsync'd write bandwidth for the same files, the device-to-host copy
bandwidth, and where the vLLM driver's time goes per RPC.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import statistics
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3_extract.extract.job import extraction_loop
from eagle3_extract.layout import DATA_DIR
from eagle3_extract.types import Batch, ExtractedBatch
from eagle3_extract.extract.writer import Writer

FILES_PER_DIR = 10000


def tokens(batches: list[Batch]) -> int:
    return sum(b.num_tokens for b in batches)


def prefill(engine: Any, batches: list[Batch]) -> dict:
    for b in batches:
        engine.prefill(b)
    return {}


def extract_host(engine: Any, batches: list[Batch]) -> dict:
    """As the job's loop runs the engine (wait=False), with a consumer that only waits for
    each batch's copy and releases its slot, one batch behind."""
    prev = None
    for b in batches:
        eb = engine.extract(b, wait=False)
        if prev is not None:
            prev.wait()
            prev.release()
        prev = eb
    if prev is not None:
        prev.wait()
        prev.release()
    return {}


def new_writer(engine: Any, root: Path, threads: int, max_pending: int) -> Writer:
    stored = engine.storage.stored_dtype(engine.dtype)
    return Writer(root, "safetensors", FILES_PER_DIR, engine.layer_ids, engine.hidden_size,
                  stored, run_id="bench", threads=threads, max_pending=max_pending)


def extract_disk(engine: Any, batches: list[Batch], root: Path, threads: int,
                 max_pending: int) -> dict:
    """The job's own loop (job.extraction_loop): extract, submit, drain at the end.

    It splits the wall time (in engine.extract; blocked in submit because every
    slot is in flight; draining the writer after the last batch), and the Writer
    records when each batch's last file landed: `steady_tok_s`, tokens over the time
    between the first and the last batch landing, is the pipeline's rate once full,
    which is what a job of thousands of batches sees. The wall figure also holds the
    fill and the drain, a whole batch's write or more, which a run of a few batches
    cannot amortise.
    """
    writer = new_writer(engine, root, threads, max_pending)
    times = extraction_loop(engine, writer, batches)
    landed = sorted(writer.landed)
    steady = None
    if len(landed) > 1:
        steady = sum(n for _, n in landed[1:]) / (landed[-1][0] - landed[0][0])
    return {"bytes": writer.bytes, "files": writer.written, "steady_tok_s": steady,
            "extract_s": times.extract_s, "submit_s": times.submit_s,
            "drain_s": times.drain_s}


def writer_only(engine: Any, held: list[ExtractedBatch], root: Path, threads: int,
                max_pending: int) -> dict:
    """The Writer on states already in host memory: its ceiling with no engine in the way."""
    writer = new_writer(engine, root, threads, max_pending)
    try:
        for eb in held:
            writer.submit(dataclasses.replace(eb, release=lambda: None))
    finally:
        writer.close()
    return {"bytes": writer.bytes, "files": writer.written}


def hold_states(engine: Any, batches: list[Batch]) -> list[ExtractedBatch]:
    """Extract each batch once and keep private copies (the engine's slots are reused)."""
    held = []
    for b in batches:
        eb = engine.extract(b)
        try:
            held.append(dataclasses.replace(eb, states=[s.clone() for s in eb.states],
                                            release=lambda: None))
        finally:
            eb.release()
    return held


def list_files(root: Path) -> list[Path]:
    data = root / DATA_DIR
    return sorted(data.rglob("*.safetensors")) if data.is_dir() else []


def disk_bandwidth(root: Path, sizes: list[int], threads: int) -> dict:
    """Raw write bandwidth: files of the given sizes, written and fsync'd by `threads`
    threads, as the Writer does but with no serialisation. Random bytes (no shortcut
    for zeros)."""
    root.mkdir(parents=True, exist_ok=True)
    block = os.urandom(max(sizes))
    todo: queue.Queue = queue.Queue()
    for i, n in enumerate(sizes):
        todo.put((root / f"raw-{i:06d}.bin", n))
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            try:
                path, n = todo.get_nowait()
            except queue.Empty:
                return
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    view = memoryview(block)[:n]
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                return

    t0 = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(max(1, threads))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - t0
    for i in range(len(sizes)):
        (root / f"raw-{i:06d}.bin").unlink(missing_ok=True)
    if errors:
        raise errors[0]
    return {"seconds": seconds, "bytes": sum(sizes)}


def d2h_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict | None:
    """Device-to-host copy bandwidth into pinned and into pageable memory (GB/s)."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    out = {}
    for name, pin in (("pinned", True), ("pageable", False)):
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        dst.copy_(src)  # warm-up (first touch of pageable pages)
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[f"{name}_gb_s"] = round(nbytes / statistics.median(times) / 1e9, 2)
        del dst
    return out


@contextmanager
def rpc_timer(engine: Any):
    """Seconds per vLLM executor RPC (execute_model, sample_tokens, capture_flush, ...).

    Wraps the engine's executor.collective_rpc on this instance only; yields a
    dict that fills as calls are made. Nothing for engines without an executor.
    """
    totals: dict[str, float] = defaultdict(float)
    executor = getattr(engine, "executor", None)
    if executor is None:
        yield totals
        return
    inner = executor.collective_rpc

    def wrapped(method, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(method, *args, **kwargs)
        finally:
            totals[method if isinstance(method, str) else repr(method)] += (
                time.perf_counter() - t0)

    executor.collective_rpc = wrapped
    try:
        yield totals
    finally:
        executor.collective_rpc = inner


def timed(fn: Callable[[], dict]) -> tuple[float, dict]:
    """Wall seconds of one phase run. Every engine call returns only when its work is
    done (vLLM steps synchronously; HF synchronises in prefill and copies to the CPU
    in extract), so no device sync is needed here, nor wanted: it would open a CUDA
    context in the vLLM driver process."""
    t0 = time.perf_counter()
    extra = fn()
    return time.perf_counter() - t0, extra
