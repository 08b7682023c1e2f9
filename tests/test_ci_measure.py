""".ci/measure.py, CI's cost table: a stage's CPU time includes what its daemonized
descendants used (a docker daemon, an engine's workers outliving their parent), its peak
memory is the tree's, and the table checks the machine's totals against the budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURE = ROOT / ".ci" / "measure.py"

# a parent that starts a grandchild in its own session and exits at once: the grandchild
# (about 1.5 CPU-seconds and 60 MB resident) is reparented to the wrapper, not to the parent
DAEMONIZES = r"""
import subprocess, sys
subprocess.Popen([sys.executable, "-c", '''
import time
hold = bytearray(60 * 2**20)
for i in range(0, len(hold), 4096):
    hold[i] = 1
t = time.process_time()
while time.process_time() - t < 1.5:
    sum(range(200000))  # user time: on some VMs the clock read itself is a system call
time.sleep(1.5)
'''], start_new_session=True)
"""


def test_a_stage_counts_its_daemonized_descendants_cpu_and_memory(tmp_path):
    record = tmp_path / "stages.tsv"
    r = subprocess.run([sys.executable, str(MEASURE), "stage", "a stage", str(record), "--",
                        sys.executable, "-c", DAEMONIZES], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    name, wall, cpu, user, system, tree_mib, largest_mib, rc = \
        record.read_text().rstrip("\n").split("\t")
    assert name == "a stage" and rc == "0"
    assert int(cpu) >= 1 and int(user) >= 1  # the grandchild's busy loop, reaped here
    assert int(tree_mib) >= 60 and int(largest_mib) >= 60


def test_the_exit_status_is_the_commands_and_the_table_reads_the_budget(tmp_path):
    record, start, watch = tmp_path / "s.tsv", tmp_path / "start.json", tmp_path / "m.json"
    assert subprocess.run([sys.executable, str(MEASURE), "start", str(start)]).returncode == 0
    r = subprocess.run([sys.executable, str(MEASURE), "stage", "fails", str(record), "--",
                        "bash", "-c", "exit 3"])
    assert r.returncode == 3
    watch.write_text('{"peak_bytes": 18253611008, "at_s": 1}')  # 17 GiB
    out = subprocess.run([sys.executable, str(MEASURE), "table", str(record), str(start),
                          str(watch)], capture_output=True, text=True).stdout
    assert "fails" in out and out.splitlines()[1].split()[-1] == "3"
    assert "OVER: peak GiB 17.0 > 16.0" in out


def test_usage_is_exit_2():
    r = subprocess.run([sys.executable, str(MEASURE), "stage", "x"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "measure.py stage NAME" in r.stderr
