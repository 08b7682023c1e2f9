#!/usr/bin/env python3
"""What each CI stage costs: wall seconds, CPU seconds (user + system) and peak memory.

    measure.py stage NAME RECORD -- COMMAND...   run it, append its costs to RECORD (TSV)
    measure.py watch OUT                         the machine's peak memory in use, until killed
    measure.py start OUT                         the machine's CPU counters now
    measure.py table RECORD START WATCH          the table, the machine's totals, the budget

A stage's CPU time is what its whole process tree used, daemons it started included: the
wrapper is the tree's child subreaper (prctl PR_SET_CHILD_SUBREAPER), so a process whose
parent exits (dockerd, the build's containers, an engine's workers) is reparented to it and
its rusage reaches RUSAGE_CHILDREN when reaped. "tree peak" is the largest sum of resident
memory over the tree, sampled each second; "largest process" is the kernel's ru_maxrss.
The machine's counters (/proc/stat, MemTotal - MemAvailable) check the stages' sum: the
issue's budget (30 minutes wall, 55 CPU-minutes, 16 GiB) is read against those.
Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
HZ = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36
BUDGET = {"wall_s": 30 * 60, "cpu_s": 55 * 60, "mem_gib": 16.0}
FIELDS = ["stage", "wall_s", "cpu_s", "user_s", "sys_s", "tree_peak_mib", "largest_mib",
          "exit"]


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree_rss(root: int) -> int:
    """Bytes resident in `root`'s descendants (not root: the wrapper itself)."""
    kids, total, todo = children_map(), 0, [root]
    while todo:
        for pid in kids.get(todo.pop(), []):
            todo.append(pid)
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * PAGE
            except (OSError, IndexError, ValueError):
                pass
    return total


def stage(name: str, record: Path, cmd: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"measure: prctl(PR_SET_CHILD_SUBREAPER) failed (errno {ctypes.get_errno()}): "
              "CPU of daemonized processes is not counted", file=sys.stderr)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(1.0):
            peak = max(peak, tree_rss(os.getpid()))

    t0 = time.monotonic()
    child = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):  # CI's kill of this stage reaches the command
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rc = child.wait()
    wall = time.monotonic() - t0
    # orphans the command left (reparented here): reap those that end within a grace
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.2)
    done.set()
    sampler.join()
    left = children_map().get(os.getpid(), [])
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = {"stage": name, "wall_s": round(wall), "cpu_s": round(use.ru_utime + use.ru_stime),
           "user_s": round(use.ru_utime), "sys_s": round(use.ru_stime),
           "tree_peak_mib": round(peak / 2**20), "largest_mib": round(use.ru_maxrss / 1024),
           "exit": rc}
    with open(record, "a") as f:
        f.write("\t".join(str(row[k]) for k in FIELDS) + "\n")
    if left:
        print(f"measure: {name}: {len(left)} process(es) still running after the stage "
              f"(pids {left[:8]}); their CPU is not counted", file=sys.stderr)
    return rc


def cpu_jiffies() -> tuple[int, int]:
    """(user + nice, system + irq + softirq) of the whole machine, in clock ticks."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return v[0] + v[1], v[2] + v[5] + v[6]


def mem_used() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def write_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def watch(out: Path) -> int:
    peak, at = 0, 0.0
    t0 = time.monotonic()
    while True:
        used = mem_used()
        if used > peak:
            peak, at = used, time.monotonic() - t0
            write_atomic(out, {"peak_bytes": peak, "at_s": round(at)})
        time.sleep(2)


def start(out: Path) -> int:
    user, system = cpu_jiffies()
    write_atomic(out, {"time": time.time(), "user": user, "system": system})
    return 0


def table(record: Path, start_file: Path, watch_file: Path) -> int:
    rows = [dict(zip(FIELDS, line.rstrip("\n").split("\t")))
            for line in record.read_text().splitlines() if line.strip()]
    s = json.loads(start_file.read_text())
    user, system = cpu_jiffies()
    wall = time.time() - s["time"]
    cpu = (user - s["user"] + system - s["system"]) / HZ
    peak = json.loads(watch_file.read_text())["peak_bytes"] / 2**30 if watch_file.exists() else 0
    w = max(len(r["stage"]) for r in rows) if rows else 10
    print(f"== ci: costs ({'stage':<{w}}  wall s   CPU s (user + sys)  tree peak MiB  "
          "largest process MiB  exit)")
    for r in rows:
        print(f"== ci:        {r['stage']:<{w}}  {r['wall_s']:>6}  {r['cpu_s']:>6} "
              f"({r['user_s']:>5} + {r['sys_s']:>4})  {r['tree_peak_mib']:>13}  "
              f"{r['largest_mib']:>19}  {r['exit']:>4}")
    summed = sum(int(r["cpu_s"]) for r in rows)
    print(f"== ci: machine: {wall:.0f} s wall, {cpu:.0f} CPU s ({cpu / 60:.1f} CPU-minutes; "
          f"the stages' sum {summed} s), peak memory in use {peak:.1f} GiB")
    over = [f"{what} {have} > {limit}" for what, have, limit in (
        ("wall minutes", round(wall / 60, 1), BUDGET["wall_s"] / 60),
        ("CPU-minutes", round(cpu / 60, 1), BUDGET["cpu_s"] / 60),
        ("peak GiB", round(peak, 1), BUDGET["mem_gib"])) if have > limit]
    print("== ci: budget (30 min wall, 55 CPU-minutes, 16 GiB): "
          + ("within" if not over else "OVER: " + ", ".join(over)))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "stage" and "--" in argv:
        sep = argv.index("--")
        return stage(argv[1], Path(argv[2]), argv[sep + 1:])
    if len(argv) == 2 and argv[0] == "watch":
        return watch(Path(argv[1]))
    if len(argv) == 2 and argv[0] == "start":
        return start(Path(argv[1]))
    if len(argv) == 4 and argv[0] == "table":
        return table(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
