"""The shared host buffer: how captured states leave vLLM's worker processes.

States never travel through `collective_rpc`: pickled through the executor's
message queue they cost 83% of the throughput on an H200 (4,604 vs 27,262
tok/s, docs/engine.md). The driver instead creates a file in /dev/shm holding
`slots` buffers of `[rows, layers, hidden]`; each capturing worker maps it and
writes one call's rows into a slot with one device-to-host copy, page-locked
with cudaHostRegister on CUDA. The driver hands a slot to the writer and
reuses it once the writer releases it, so writing overlaps the next prefill.

The file is unlinked as soon as every worker has mapped it (`unlink`): the
memory lives exactly as long as the processes that map it, so no kill, SIGKILL
included, can leave it behind. Until then its name carries the driver's pid,
and the next job removes one whose driver is gone (`remove_orphans`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import tempfile
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SHM_DIR_ENV = "EAGLE3_SHM_DIR"
PREFIX = "eagle3-hs-"


def host_identity() -> str:
    """Hostname and boot id: equal only for processes on the same running kernel."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def shm_dir() -> Path:
    env = os.environ.get(SHM_DIR_ENV)
    if env:
        return Path(env)
    return Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def remove_orphans(directory: Path | None = None) -> int:
    """Remove buffers whose creating process is gone (a SIGKILLed job's)."""
    directory = directory or shm_dir()
    removed = 0
    for entry in directory.glob(f"{PREFIX}*"):
        try:
            pid = int(entry.name[len(PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            entry.unlink(missing_ok=True)
            removed += 1
    return removed


@dataclass(frozen=True)
class Layout:
    """The file's regions, as driver and workers both map them (64-byte aligned):

    states [slots, rows, L, H] as stored (model dtype or e4m3), scales [slots, rows, S]
    float32 (fp8 only), finite [slots, stages, rows] uint8 (each capturing pipeline
    stage's per-row flag, computed on the device), ready [slots, stages] int64: the
    ticket of the call whose rows are in the slot, written by each stage *after* its
    rows (on CUDA by the same stream, so the copies before it have landed).
    """

    slots: int
    rows: int
    layers: int
    hidden: int
    dtype: torch.dtype
    scale_cols: int = 0
    stages: int = 1

    def regions(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        s, r = self.slots, self.rows
        out = [("states", (s, r, self.layers, self.hidden), self.dtype)]
        if self.scale_cols:
            out.append(("scales", (s, r, self.scale_cols), torch.float32))
        out += [("finite", (s, self.stages, r), torch.uint8),
                ("ready", (s, self.stages), torch.int64)]
        return out

    def offsets(self) -> tuple[dict[str, int], int]:
        offsets, end = {}, 0
        for name, shape, dtype in self.regions():
            offsets[name] = -(-end // 64) * 64
            end = offsets[name] + math.prod(shape) * dtype.itemsize
        return offsets, end


def map_file(path: str, layout: Layout) -> dict[str, torch.Tensor]:
    """Every region of the file as a tensor (scales absent when not fp8)."""
    offsets, total = layout.offsets()
    raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    out = {}
    for name, shape, dtype in layout.regions():
        a = offsets[name]
        out[name] = raw[a:a + math.prod(shape) * dtype.itemsize].view(dtype).view(*shape)
    return out


class HostBuffer:
    """The driver's side: the file, the mapping and the free-slot list."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.shape = (layout.slots, layout.rows, layout.layers, layout.hidden)
        self.dtype = layout.dtype  # as stored: the model's, or float8_e4m3fn (quant.py)
        self.host = host_identity()
        directory = shm_dir()
        self.path = str(directory / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        with open(self.path, "wb") as f:
            f.truncate(layout.offsets()[1])
        regions = map_file(self.path, layout)
        self.tensor, self.scales = regions["states"], regions.get("scales")
        self.finite, self.ready = regions["finite"], regions["ready"]
        self._free = list(range(layout.slots))
        self._cv = threading.Condition()
        log.debug("host buffer %s: %.0f MiB, %s", self.path, self.nbytes / 2**20, layout)

    @property
    def nbytes(self) -> int:
        return self.layout.offsets()[1]

    def acquire(self) -> int:
        """A free slot; waits while the writer holds every slot."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            return self._free.pop(0)

    def release(self, slot: int) -> None:
        with self._cv:
            if slot in self._free:
                raise RuntimeError(f"host buffer slot {slot} released twice")
            self._free.append(slot)
            self._cv.notify()

    def unlink(self) -> None:
        """Remove the name; the mappings (driver's and workers') stay valid."""
        path = self.__dict__.pop("path", None)
        if path:
            Path(path).unlink(missing_ok=True)

    close = unlink


def attach(path: str, layout: Layout, driver_host: str, pin: bool
           ) -> tuple[dict[str, torch.Tensor], bool]:
    """The worker's side: map the driver's buffer; page-lock it where CUDA can.

    A worker on another host refuses: a path that exists there (a network
    filesystem) would not be coherent shared memory.
    """
    if host_identity() != driver_host or not os.path.exists(path):
        raise RuntimeError(
            f"host buffer {path} belongs to the driver on {driver_host}; this capturing "
            f"worker runs on {host_identity()}: capturing stages must share the driver's host"
        )
    regions = map_file(path, layout)
    pinned = False
    if pin:
        first = regions["states"]
        err = torch.cuda.cudart().cudaHostRegister(first.data_ptr(), layout.offsets()[1], 0)
        pinned = int(err) == 0
        if not pinned:
            log.warning("cudaHostRegister failed (%s): unpinned copies", err)
    return regions, pinned
