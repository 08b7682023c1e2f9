"""A SIGKILLed job's shared memory does not outlive it: its watcher (shm_watch.py) removes
what the killed processes leave in /dev/shm, and then exits itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_extract import shm_watch

pytestmark = pytest.mark.skipif(not shm_watch.SHM.is_dir(), reason="no /dev/shm")

# A stand-in for a job: what vLLM's processes make (a SharedMemory segment, a spawn
# context's lock, both registered with Python's resource tracker), a child that maps the
# segment too, and a nested job command (a second run_guarded in a child process).
JOB = r"""
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory
from eagle3_extract import shm_watch

def child(name):
    seg = shared_memory.SharedMemory(name=name)
    time.sleep(600)

if __name__ == "__main__":
    shm_watch.start()
    assert shm_watch.start() is shm_watch.start()  # once per process
    ctx = mp.get_context("spawn")
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    lock = ctx.Lock()
    p = ctx.Process(target=child, args=(seg.name,))
    p.start()
    nested = __import__("subprocess").Popen([sys.executable, "-c",
        "from eagle3_extract import shm_watch; import time; shm_watch.start(); time.sleep(600)"])
    print(seg.name, lock._semlock.name, flush=True)
    time.sleep(600)
"""


def _watchers(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if shm_watch.MODULE.encode() in cmd and str(pid).encode() in cmd:
                out.append(int(d))
    return out


def test_sigkill_of_the_whole_group_leaves_nothing_in_dev_shm(tmp_path):
    script = tmp_path / "job.py"  # a file: spawn re-imports the main module
    script.write_text(JOB)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        seg, sem = proc.stdout.readline().split()
        paths = [shm_watch.SHM / seg, shm_watch.SHM / f"sem.{sem.lstrip('/')}"]
        assert all(p.exists() for p in paths), paths
        time.sleep(2.5)  # the watcher has seen the processes map them
        assert _watchers(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the resource tracker goes with it
        proc.wait()
    deadline = time.monotonic() + 20
    while (any(p.exists() for p in paths) or _watchers(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in paths if p.exists()]
    assert not _watchers(proc.pid), "the watcher outlived its job"


def test_a_file_another_process_still_maps_is_left_alone(tmp_path):
    """Shared with a process outside the job: not the watcher's to remove."""
    from multiprocessing import shared_memory

    seg = shared_memory.SharedMemory(create=True, size=4096)  # this test maps it
    try:
        code = ("import time, sys\nfrom multiprocessing import shared_memory\n"
                "from eagle3_extract import shm_watch\nshm_watch.start()\n"
                f"s = shared_memory.SharedMemory(name={seg.name!r})\n"
                "print('ready', flush=True)\ntime.sleep(600)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                text=True, start_new_session=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(2.5)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while _watchers(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _watchers(proc.pid)
        assert (shm_watch.SHM / seg.name).exists()
    finally:
        seg.close()
        seg.unlink()


def test_sigkill_of_the_main_process_alone_ends_its_processes(tmp_path):
    """Only the main process killed (its children re-parented, the resource tracker alive):
    the watcher ends the rest of the tree and removes the shared memory."""
    from conftest import sigkill_main_leaves_nothing

    script = tmp_path / "job.py"
    script.write_text(JOB)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    seg, sem = proc.stdout.readline().split()
    paths = [shm_watch.SHM / seg, shm_watch.SHM / f"sem.{sem.lstrip('/')}"]
    t0 = time.monotonic()
    left = sigkill_main_leaves_nothing(proc, lambda names: time.monotonic() - t0 > 2.5)
    assert not left, f"outlived the job: {left}"
    assert not [p for p in paths if p.exists()]


def test_remove_unused_keeps_what_a_process_maps_and_unlinks_the_rest(tmp_path):
    """What an engine's close uses for the files only its workers mapped (vLLM's CPU
    communicators' cpushm_*): a worker ended before its own cleanup leaves them."""
    name = f"eagle3-test-{os.getpid()}-{time.monotonic_ns()}"
    path = shm_watch.SHM / name
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, os, sys, time\n"
        f"fd = os.open({str(path)!r}, os.O_CREAT | os.O_RDWR, 0o600)\n"
        "os.ftruncate(fd, 4096); m = mmap.mmap(fd, 4096); os.close(fd)\n"
        "print('mapped', flush=True); time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        noted = shm_watch.shm_inodes_of(holder.pid)
        assert os.stat(path).st_ino in noted
        assert shm_watch.remove_unused(noted) == [] and path.exists()  # still mapped
        holder.kill()
        holder.wait()
        assert shm_watch.remove_unused(noted) == [str(path)] and not path.exists()
    finally:
        holder.kill()
        path.unlink(missing_ok=True)


def test_a_watcher_that_cannot_start_is_a_warning_not_the_jobs_end(tmp_path, monkeypatch,
                                                                   caplog):
    """An interpreter this user may not execute again (another user's, a relative path
    from a directory since changed): the job runs on, without the safety net, and says so."""
    import sys

    from eagle3_extract import shm_watch

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o644)  # not executable: PermissionError from exec
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setattr(shm_watch, "_WATCHED", {})
    with caplog.at_level("WARNING"):
        assert shm_watch.start() is None
    assert "no /dev/shm watcher (PermissionError" in caplog.text
