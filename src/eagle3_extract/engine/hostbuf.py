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
import os
import socket
import tempfile
import threading
import uuid
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


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _scales_offset(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return -(-_nbytes(shape, dtype) // 64) * 64  # the scales start 64-byte aligned


def map_file(path: str, shape: tuple[int, ...], dtype: torch.dtype, scale_cols: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(states [slots, rows, L, H] in `dtype`, scales [slots, rows, scale_cols] float32
    or None): the one file's two regions, as driver and workers both map it."""
    slots, rows = shape[0], shape[1]
    offset = _scales_offset(shape, dtype)
    total = offset + 4 * slots * rows * scale_cols if scale_cols else _nbytes(shape, dtype)
    raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    states = raw[:_nbytes(shape, dtype)].view(dtype).view(*shape)
    scales = (raw[offset:].view(torch.float32).view(slots, rows, scale_cols)
              if scale_cols else None)
    return states, scales


class HostBuffer:
    """The driver's side: the file, the mapping and the free-slot list."""

    def __init__(self, slots: int, rows: int, layers: int, hidden: int, dtype: torch.dtype,
                 scale_cols: int = 0):
        self.shape = (slots, rows, layers, hidden)
        self.dtype = dtype  # as stored: the model's, or float8_e4m3fn (quant.py)
        self.scale_cols = scale_cols
        self.host = host_identity()
        directory = shm_dir()
        self.path = str(directory / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        with open(self.path, "wb") as f:
            f.truncate(_scales_offset(self.shape, dtype) + 4 * slots * rows * scale_cols)
        self.tensor, self.scales = map_file(self.path, self.shape, dtype, scale_cols)
        self._free = list(range(slots))
        self._cv = threading.Condition()
        log.debug("host buffer %s: %.0f MiB, %s %s", self.path, self.nbytes / 2**20,
                  self.shape, dtype)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * 4
        return self.tensor.numel() * self.dtype.itemsize + scales

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


def attach(path: str, shape: tuple[int, ...], dtype: torch.dtype, scale_cols: int,
           driver_host: str, pin: bool) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """The worker's side: map the driver's buffer; page-lock it where CUDA can.

    A worker on another host refuses: a path that exists there (a network
    filesystem) would not be coherent shared memory.
    """
    if host_identity() != driver_host or not os.path.exists(path):
        raise RuntimeError(
            f"host buffer {path} belongs to the driver on {driver_host}; this capturing "
            f"worker runs on {host_identity()}: capturing stages must share the driver's host"
        )
    states, scales = map_file(path, shape, dtype, scale_cols)
    pinned = False
    if pin:
        nbytes = os.path.getsize(path)
        err = torch.cuda.cudart().cudaHostRegister(states.data_ptr(), nbytes, 0)
        pinned = int(err) == 0
        if not pinned:
            log.warning("cudaHostRegister failed (%s): unpinned copies", err)
    return states, scales, pinned
