"""One writer per shard of an output dir: an exclusive lock taken in preflight.

Shards of one run may share a directory (a k8s Indexed Job, data-parallel
replicas), so the lock is per shard: `<root>/.locks/shard-<i>-of-<c>.lock`, held
with flock(2) for the job's lifetime. A lock file whose flock can be taken
belongs to a dead job (the kernel drops a lock with its process, SIGKILL
included): it is taken over. A live lock refuses every job whose shard overlaps
it (shard i of c and j of d share indices when i = j mod gcd(c, d)), except the
data-parallel launcher's lock for its own replicas. A guard lock serialises the
check, so two jobs starting together cannot both pass it.

flock works on local filesystems and, through NFSv4's lock manager, across the
nodes of a shared one.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from eagle3_extract.errors import PreflightError

LOCK_DIR = ".locks"


def overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Do shard a = (i, c) and shard b = (j, d) share any sample index?"""
    return (a[0] - b[0]) % math.gcd(a[1], b[1]) == 0


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


class ShardLock:
    """Held from `acquire` until `release` (or the process ends)."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, root: Path, shard: tuple[int, int]) -> "ShardLock":
        locks = root / LOCK_DIR
        locks.mkdir(parents=True, exist_ok=True)
        guard = os.open(locks / "guard", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for other in locks.glob("shard-*.lock"):
                cls._check(other, shard)
            path = locks / f"shard-{shard[0]}-of-{shard[1]}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_flock(fd):  # held by this process (an earlier plan in it)
                os.close(fd)
                raise PreflightError(f"output.dir={str(root)!r}: shard {shard[0]}/{shard[1]} "
                                     "is already locked by this process")
            holder = {"host": socket.gethostname(), "pid": os.getpid(),
                      "shard": list(shard), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(holder).encode())
            return cls(path, fd)
        finally:
            os.close(guard)  # drops the guard's flock

    @staticmethod
    def _check(other: Path, shard: tuple[int, int]) -> None:
        holder = _live_holder(other)
        if holder is None:  # nobody holds it: a dead job's
            other.unlink(missing_ok=True)
            return
        theirs = tuple(holder.get("shard") or (0, 1))
        if not overlaps(shard, theirs):
            return
        here = socket.gethostname()
        if holder.get("host") == here and holder.get("pid") in (os.getpid(), os.getppid()):
            return  # this process's own, or its data-parallel launcher's
        raise PreflightError(
            f"output.dir={str(other.parent.parent)!r}: shard {theirs[0]}/{theirs[1]} is being "
            f"written by pid {holder.get('pid')} on {holder.get('host')} (since "
            f"{holder.get('since')}), which overlaps shard {shard[0]}/{shard[1]}; wait for "
            "that job, or set output.dir to another directory")

    def release(self) -> None:
        fd = self.__dict__.pop("_fd", None)
        if fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(fd)


def _live_holder(path: Path) -> dict[str, Any] | None:
    """Who holds the shard lock `path` ({} when its record is unreadable), or None when
    no live job does (gone, or its flock can be taken: a dead job's)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return None
    try:
        if _try_flock(fd):
            return None
        try:
            return json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            return {}
    finally:
        os.close(fd)


def when_alone(root: Path, fn: Callable[[], Any]) -> Any:
    """`fn()` under the guard lock when no other job holds a shard lock in `root` (this
    process's own do not count); None otherwise. The guard serialises it with every
    `ShardLock.acquire`, so no shard starts in between."""
    locks = root / LOCK_DIR
    if not locks.is_dir():
        return fn()
    guard = os.open(locks / "guard", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(guard, fcntl.LOCK_EX)
        for other in locks.glob("shard-*.lock"):
            holder = _live_holder(other)
            if holder is not None and (holder.get("host"), holder.get("pid")) != (
                    socket.gethostname(), os.getpid()):
                return None
        return fn()
    finally:
        os.close(guard)


# --- whose process wrote a manifest, and is it still there --------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    # field 22 (starttime); the command name in parentheses may contain spaces
    return int(stat.rsplit(")", 1)[1].split()[19])


def process_identity() -> dict[str, Any]:
    """This process, precisely enough to tell later whether it is still alive.

    pid alone is not enough: pids are reused, and containers on one host (same
    hostname with host networking) have their own pid namespaces.
    """
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_ns": pid_ns,
            "boot_id": _read("/proc/sys/kernel/random/boot_id"), "start": _start_ticks(pid)}


def process_alive(ident: dict[str, Any] | None) -> bool | None:
    """True/False when `ident` can be checked from here, None when it cannot."""
    if not ident or ident.get("start") is None:
        return None
    here = process_identity()
    if any(ident.get(k) != here[k] for k in ("host", "pid_ns", "boot_id")):
        return None
    return _start_ticks(int(ident["pid"])) == ident["start"]
