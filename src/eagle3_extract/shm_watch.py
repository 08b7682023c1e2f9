"""What a SIGKILLed job leaves in /dev/shm, removed by a watcher of its own.

vLLM's workers and Python's multiprocessing keep shared memory in /dev/shm (psm_*,
sem.mp-*; 400 MB for the tiny default's engine), as do our host buffers (eagle3-hs-*).
Each is unlinked by the process that made it or by Python's resource tracker when the
job ends, but a SIGKILL of the job's process group takes the tracker with it, and the
entries stay in the host's RAM until reboot. The watcher is a small process in a session
of its own (a kill of the job's group does not reach it): it notes which /dev/shm files
the job's processes map or hold open, and once all of them are gone it unlinks those of
the noted files that no process maps any more. On a normal exit it finds nothing to do.
A kill of everything at once (a container's cgroup) takes the watcher too: a container's
/dev/shm goes with it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

SHM = Path("/dev/shm")
POLL_S = 1.0
GIVE_UP_S = 900.0  # processes of the job still alive this long after it ended: leave it


def start(pid: int | None = None) -> subprocess.Popen | None:
    """Watch process `pid` (default: this one) and what it starts; None where there is
    no /proc or /dev/shm (then there is nothing to clean either)."""
    if not (SHM.is_dir() and Path("/proc/self/maps").exists()):
        return None
    pid = os.getpid() if pid is None else pid
    return subprocess.Popen(
        [sys.executable, "-m", "eagle3_extract.shm_watch", str(pid), str(_start_time(pid))],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, close_fds=True)


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (a reused pid has another one), or None if it is
    gone or a zombie (dead, waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _parents() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
                out[int(d)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError):
                continue
    return out


def shm_files_of(pid: int) -> set[str]:
    """The /dev/shm paths process `pid` maps or holds open."""
    prefix = f"{SHM}/"
    found = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[5] if line.count(" ") >= 5 else ""
            if path.startswith(prefix):
                found.add(path.removesuffix(" (deleted)"))
    except (OSError, IndexError):
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                found.add(target.removesuffix(" (deleted)"))
    except OSError:
        pass
    return found


def watch(main_pid: int, main_start: int | None) -> list[str]:
    """Follow the job's process tree until it is gone; return the paths it unlinked."""
    me = os.getpid()  # a child of the job too, not to be waited for
    alive = {main_pid: main_start} if main_start is not None else {}
    noted: set[str] = set()
    ended_at = None
    while True:
        alive = {p: t for p, t in alive.items() if _start_time(p) == t}
        parents = _parents()
        grew = True
        while grew:  # descendants of anything we follow (their parents may be gone since)
            grew = False
            for p, pp in parents.items():
                if pp in alive and p not in alive and p != me:
                    t = _start_time(p)
                    if t is not None:
                        alive[p] = t
                        grew = True
        for p in alive:
            noted |= shm_files_of(p)
        if main_pid not in alive:
            ended_at = ended_at or time.monotonic()
            if not alive or time.monotonic() - ended_at > GIVE_UP_S:
                break
        time.sleep(POLL_S)
    leftovers = [p for p in sorted(noted) if os.path.exists(p)]
    if not leftovers:
        return []
    in_use: set[str] = set()
    for p in _parents():
        in_use |= shm_files_of(p)
    removed = []
    for path in leftovers:
        if path not in in_use:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                continue
    return removed


def main(argv: list[str]) -> int:
    pid, start_time = int(argv[0]), (int(argv[1]) if argv[1:] and argv[1] != "None" else None)
    watch(pid, start_time)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
