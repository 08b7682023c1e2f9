"""What a SIGKILLed job leaves, removed by a watcher of its own: its processes and the
shared memory they held.

A job is a tree of processes: vLLM's EngineCore (about 600 MB) and its workers, Python's
resource tracker, a tokenizer pool, the trainer's process. A SIGKILL of the job's main
process reaches none of them: they are re-parented and run on. They, and vLLM's and
Python's shared memory in /dev/shm (psm_*, sem.mp-*; 400 MB for the tiny default's
engine) and our host buffers (eagle3-hs-*), would outlive the job: each is unlinked by
the process that made it or by the resource tracker when the job ends well, never after
a SIGKILL. The watcher is a small process in a session of its own (a kill of the job's
group does not reach it): it follows the job's process tree and notes which /dev/shm
files they map or hold open. Once the main process is gone, what is left of the tree
gets SIGTERM after TERM_AFTER_S and SIGKILL after KILL_AFTER_S (a job that ended well
has nothing left by then: an engine's worker that lingers is ended too); then it unlinks
the noted files that no process maps any more. A kill of everything at once (a
container's cgroup) takes the watcher too: a container's processes and /dev/shm go with
it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SHM = Path("/dev/shm")
POLL_S = 1.0
GIVE_UP_S = 900.0  # processes of the job still alive this long after it ended: leave it
TERM_AFTER_S = 2.0  # after the job's main process ended, its processes get SIGTERM,
KILL_AFTER_S = 6.0  # then SIGKILL


_WATCHED: dict[int, subprocess.Popen] = {}
MODULE = "eagle3_extract.shm_watch"


def start(pid: int | None = None) -> subprocess.Popen | None:
    """Watch process `pid` (default: this one) and what it starts, once per process (a
    Hydra multirun runs several jobs in one); None where there is no /proc or /dev/shm
    (then there is nothing to clean either)."""
    if not (SHM.is_dir() and Path("/proc/self/maps").exists()):
        return None
    pid = os.getpid() if pid is None else pid
    if pid in _WATCHED and _WATCHED[pid].poll() is None:
        return _WATCHED[pid]
    try:  # the interpreter by its absolute path: the job may change its directory
        _WATCHED[pid] = subprocess.Popen(
            [os.path.abspath(sys.executable), "-m", MODULE, str(pid), str(_start_time(pid))],
            start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, close_fds=True)
    except OSError as e:  # the watcher is a safety net, never a reason for the job to fail
        import logging

        logging.getLogger("eagle3_extract").warning(
            "no /dev/shm watcher (%s: %s): shared memory a SIGKILLed job leaves is not "
            "removed", type(e).__name__, e.strerror or e)
        return None
    return _WATCHED[pid]


def _is_watcher(pid: int) -> bool:
    """Another job's (or this job's other) watcher: followed, two would wait for each
    other forever."""
    try:
        return MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (a reused pid has another one), or None if it is
    gone or a zombie (dead, waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # gone already, or not ours to signal
        pass


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


def descendants(root: int) -> set[int]:
    """The live processes below `root` (its children, theirs, ...)."""
    parents, tree, grew = _parents(), {root}, True
    while grew:
        more = {p for p, pp in parents.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree - {root}


def shm_inodes_of(pid: int) -> set[int]:
    """The inodes of /dev/shm files process `pid` maps or holds open. Inodes, not names:
    glibc's sem_open maps a temp file it then links to the semaphore's name."""
    prefix = f"{SHM}/"
    found = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(prefix):
                found.add(int(parts[4]))
    except (OSError, ValueError):
        pass
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(prefix):
                    found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
            except OSError:
                continue
    except OSError:
        pass
    return found


def entries() -> dict[int, list[str]]:
    """The files in /dev/shm by inode."""
    out: dict[int, list[str]] = {}
    try:
        with os.scandir(SHM) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    out.setdefault(e.inode(), []).append(e.path)
    except OSError:
        pass
    return out


def in_use() -> set[int]:
    """The inodes of /dev/shm files any process maps or holds open."""
    used: set[int] = set()
    for p in _parents():
        used |= shm_inodes_of(p)
    return used


def shm_files_of(pid: int) -> set[str]:
    """The /dev/shm paths whose files process `pid` maps or holds open."""
    inodes, names = shm_inodes_of(pid), entries()
    return {path for i in inodes for path in names.get(i, [])}


def watch(main_pid: int, main_start: int | None) -> list[str]:
    """Follow the job's process tree until it is gone; return the paths it unlinked."""
    me = os.getpid()  # a child of the job too, not to be waited for
    alive = {main_pid: main_start} if main_start is not None else {}
    noted: set[int] = set()  # inodes
    ended_at = None
    while True:
        alive = {p: t for p, t in alive.items()  # a watcher may have been seen pre-exec
                 if _start_time(p) == t and (p == main_pid or not _is_watcher(p))}
        parents = _parents()
        grew = True
        while grew:  # descendants of anything we follow (their parents may be gone since)
            grew = False
            for p, pp in parents.items():
                if pp in alive and p not in alive and p != me and not _is_watcher(p):
                    t = _start_time(p)
                    if t is not None:
                        alive[p] = t
                        grew = True
        for p in alive:
            noted |= shm_inodes_of(p)
        if main_pid not in alive:
            ended_at = ended_at or time.monotonic()
            waited = time.monotonic() - ended_at
            if not alive or waited > GIVE_UP_S:
                break
            if waited >= TERM_AFTER_S:  # the job is over: nothing of it outlives it
                for p in alive:
                    _signal(p, signal.SIGKILL if waited >= KILL_AFTER_S else signal.SIGTERM)
        time.sleep(POLL_S)
    return remove_unused(noted)


def remove_unused(noted: set[int]) -> list[str]:
    """Unlink the /dev/shm files among the `noted` inodes that no process maps or holds
    open any more; return their paths."""
    left = {i: paths for i, paths in entries().items() if i in noted}
    if not left:
        return []
    used = in_use()
    removed = []
    for inode, paths in left.items():
        if inode not in used:
            for path in paths:
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
