"""Where the Writer's time goes, for one sample shape, on this machine's disk.

bench/throughput/run.py found phase (3) bound by the Writer on an H200 (docs/BENCHMARKS.md). This
times each step of writer.write_sample and check_invariants on a [T, L, H] bf16 sample,
the Writer alone for several thread counts with torch's intra-op threads at 1 (what
vLLM's multiproc executor sets in the driver process, where the Writer runs) and at
the core count, and, with a GPU, the HF engine's per-sample copy into fresh pageable
memory against a reused pinned buffer.

    python3 bench/throughput/writer_profile.py --dir /var/tmp/x --out profile.json [--shape 2048x4x4096]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import phases
from eagle3_extract.types import ExtractedBatch, Sample
from eagle3_extract.extract.writer import check_invariants, write_sample
from eagle3_extract.layout import INPUT_IDS_KEY, LOSS_MASK_KEY, STATES_KEY


def median_s(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def steps(states: torch.Tensor, sample: Sample, root: Path, reps: int) -> dict:
    """Seconds per sample for each step of the Writer's work, and two lower bounds."""
    from safetensors.torch import save, save_file

    root.mkdir(parents=True, exist_ok=True)
    path = root / "one.safetensors"
    ids = torch.tensor(sample.input_ids)
    mask = torch.tensor(sample.loss_mask, dtype=torch.uint8)
    tensors = {INPUT_IDS_KEY: ids, LOSS_MASK_KEY: mask, STATES_KEY: states}
    raw = states.view(torch.uint8).numpy()

    def fsync_file() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def raw_write() -> None:  # the same bytes, no serialisation: os.write from the tensor
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(raw).cast("B")
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)

    out = {}
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        out[f"isfinite_threads{n}_s"] = median_s(
            lambda: check_invariants(sample, states, states.shape[1], states.shape[2],
                                     states.dtype), reps)
    out["serialize_to_bytes_s"] = median_s(lambda: save(tensors), reps)
    out["save_file_no_fsync_s"] = median_s(lambda: save_file(tensors, str(path)), reps)
    out["save_file_then_fsync_s"] = median_s(lambda: (save_file(tensors, str(path)),
                                                      fsync_file()), reps)
    out["raw_write_fsync_s"] = median_s(raw_write, reps)
    out["write_sample_s"] = median_s(
        lambda: write_sample(root / "ws.safetensors", sample, states, "safetensors", [1],
                             "p"), reps)
    nbytes = states.numel() * states.element_size()
    return {k: {"s": v, "gb_s": nbytes / v / 1e9} for k, v in out.items()}


def writer_grid(states: torch.Tensor, sample: Sample, root: Path, samples: int) -> list:
    """The real Writer on `samples` copies of the sample (1 batch of them, held in memory)."""
    fake = SimpleNamespace(layer_ids=list(range(states.shape[1])), hidden_size=states.shape[2],
                           dtype=states.dtype)
    samples_ = [Sample(i, sample.input_ids, sample.loss_mask) for i in range(samples)]
    held = [ExtractedBatch(samples_, [states.clone() for _ in range(samples)])]
    nbytes = samples * states.numel() * states.element_size()
    rows = []
    for torch_threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(torch_threads)
        for threads in (1, 2, 4, 8):
            seconds, _ = phases.timed(lambda: phases.writer_only(fake, held, root, threads, 2))
            rows.append({"torch_threads": torch_threads, "writer_threads": threads,
                         "gb_s": nbytes / seconds / 1e9})
            for p in root.rglob("*.safetensors"):
                p.unlink()
    return rows


def d2h(shape: tuple, reps: int) -> dict | None:
    """HF engine: `.to("cpu")` into new pageable memory per sample vs a reused pinned buffer."""
    if not torch.cuda.is_available():
        return None
    src = torch.randn(shape, device="cuda").to(torch.bfloat16)
    pinned = torch.empty(shape, dtype=src.dtype, pin_memory=True)
    nbytes = src.numel() * src.element_size()

    def fresh() -> None:
        src.to("cpu")

    def reused() -> None:
        pinned.copy_(src)

    return {name: {"s": s, "gb_s": nbytes / s / 1e9}
            for name, s in (("fresh_pageable", median_s(fresh, reps)),
                            ("reused_pinned", median_s(reused, reps)))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="a directory on the disk to test")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--shape", default="2048x4x4096", help="T x L x H of one sample")
    p.add_argument("--samples", type=int, default=16, help="samples per Writer run")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    shape = tuple(int(x) for x in args.shape.split("x"))
    states = torch.randn(shape).to(torch.bfloat16)
    sample = Sample(0, list(range(shape[0])), [1] * shape[0])
    threads0 = torch.get_num_threads()
    result = {"shape": list(shape), "cpu_count": os.cpu_count(),
              "steps": steps(states, sample, args.dir / "steps", args.reps),
              "writer": writer_grid(states, sample, args.dir / "writer", args.samples),
              "d2h": d2h(shape, args.reps)}
    torch.set_num_threads(threads0)
    for name, v in result["steps"].items():
        print(f"  {name:28s} {v['s'] * 1e3:8.1f} ms  {v['gb_s']:6.2f} GB/s")
    for row in result["writer"]:
        print(f"  Writer torch_threads={row['torch_threads']:2d} threads={row['writer_threads']}"
              f"  {row['gb_s']:6.2f} GB/s")
    print(f"  d2h {result['d2h']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
