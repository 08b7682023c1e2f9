"""Trust nothing, lose nothing: verified resume, one writer per shard, faults end cleanly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_job import COMMON, compose_cfg, data_files, run_cli

from eagle3_extract.errors import PreflightError
from eagle3_extract.layout import file_problem

BIN = Path(sys.executable).parent
HF = ["engine=hf", *COMMON]


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("rel") / "out"
    r = run_cli(*HF, f"output.dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def status(root: Path) -> tuple[int, dict]:
    r = subprocess.run([str(BIN / "eagle3-status"), str(root), "--json"], capture_output=True,
                       text=True, timeout=120)
    return r.returncode, json.loads(r.stdout)


def test_file_problem_sees_a_cut_or_foreign_file(done_run, tmp_path):
    f = sorted(data_files(done_run).values())[0]
    assert file_problem(f, "safetensors") is None
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(f.read_bytes()[:-100])
    assert "header says" in file_problem(cut, "safetensors")
    cut.write_bytes(f.read_bytes()[:5])
    assert "no safetensors header" in file_problem(cut, "safetensors")
    cut.write_bytes(b"not a sample at all, but long enough to have a header")
    assert file_problem(cut, "safetensors")


def test_a_truncated_file_is_redone_and_status_agrees(done_run, tmp_path, offline):
    from eagle3_extract.extract.job import run

    out = tmp_path / "out"
    shutil.copytree(done_run, out)
    victim = sorted(data_files(out).items())[3]
    original = victim[1].read_bytes()
    victim[1].write_bytes(original[: len(original) // 2])  # a disk that lost the tail
    rc, rep = status(out)
    assert rc == 1 and not rep["complete"] and rep["totals"]["damaged"] == 1
    m = run(compose_cfg(*HF, f"output.dir={out}"))
    assert m["counts"]["redone_damaged"] == 1 and m["counts"]["written_this_run"] == 1
    assert victim[1].read_bytes() == original  # the same sample, whole again
    rc, rep = status(out)
    assert rc == 0 and rep["complete"] and rep["totals"]["damaged"] == 0


def test_a_rerun_finds_a_relabelled_file_and_on_request_a_flipped_bit(done_run, tmp_path,
                                                                      offline):
    """A finished file whose header names another run is redone by any rerun; one with a
    bit flipped in its tensors by a rerun with output.recheck=content (one read of the
    output), counted. The default reads headers only: the docs say what it cannot see."""
    from eagle3_extract.extract.job import run

    out = tmp_path / "out"
    shutil.copytree(done_run, out)
    files = sorted(data_files(out).items())
    relabelled, flipped = files[1][1], files[4][1]
    want = {p: p.read_bytes() for p in (relabelled, flipped)}
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    data = want[relabelled]
    relabelled.write_bytes(data.replace(run_id.encode(), ("f" * len(run_id)).encode(), 1))
    data = bytearray(want[flipped])
    data[-3] ^= 0x10
    flipped.write_bytes(bytes(data))
    m = run(compose_cfg(*HF, f"output.dir={out}"))
    assert m["counts"]["redone_damaged"] == 1 and m["counts"]["written_this_run"] == 1
    assert relabelled.read_bytes() == want[relabelled]
    assert flipped.read_bytes() != want[flipped]  # the header check cannot see it
    m = run(compose_cfg(*HF, f"output.dir={out}", "output.recheck=content"))
    assert m["counts"]["redone_damaged"] == 1 and m["counts"]["written_this_run"] == 1
    assert flipped.read_bytes() == want[flipped]
    rc, rep = status(out)
    assert rc == 0 and rep["complete"] and rep["totals"]["damaged"] == 0


HOLDER = """
import sys, time
from pathlib import Path
from eagle3_extract.lock import ShardLock
ShardLock.acquire(Path(sys.argv[1]), (int(sys.argv[2]), int(sys.argv[3])))
print("locked", flush=True)
time.sleep(300)
"""


def hold(root: Path, index: int, count: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(root), str(index), str(count)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_overlaps():
    from eagle3_extract.lock import overlaps

    assert overlaps((0, 1), (3, 4)) and overlaps((0, 2), (2, 4)) and overlaps((1, 2), (3, 4))
    assert not overlaps((0, 2), (1, 2)) and not overlaps((0, 2), (1, 4))
    assert overlaps((1, 3), (2, 4))  # index 5 is in both


def test_a_second_job_on_a_live_shard_is_refused_and_touches_nothing(tmp_path):
    out = tmp_path / "out"
    holder = hold(out, 0, 2)
    try:
        # the live job claimed the run identity first (a disjoint shard's dry run makes it)
        assert run_cli(*HF, f"output.dir={out}", "shard.count=2", "shard.index=1",
                       "dry_run=true").returncode == 0
        temp = out / "data" / "00000" / f".000000000.safetensors.tmp-{holder.pid}"
        temp.parent.mkdir(parents=True)
        temp.write_bytes(b"a live job's write in progress")
        for shard in (["shard.count=4", "shard.index=2"], []):  # both overlap shard 0/2
            r = run_cli(*HF, f"output.dir={out}", *shard)
            assert r.returncode == 2, r.stderr[-2000:]
            line = r.stderr.strip().splitlines()[-1]
            assert f"being written by pid {holder.pid}" in line and "overlaps shard" in line
        assert temp.exists()  # its start-up cleanup never ran
        r = run_cli(*HF, f"output.dir={out}", "shard.count=2", "shard.index=1")  # disjoint
        assert r.returncode == 0, r.stderr[-2000:]
    finally:
        holder.kill()
        holder.wait()
    # a SIGKILLed holder's lock is stale: taken over, and its temp is cleaned up
    r = run_cli(*HF, f"output.dir={out}", "shard.count=2", "shard.index=0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not temp.exists() and not list((out / ".locks").glob("shard-*.lock"))


def test_a_full_disk_ends_in_one_line_and_a_failed_manifest(tmp_path, offline, monkeypatch):
    from eagle3_extract.extract import job
    from eagle3_extract.errors import JobError

    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    real = shutil.disk_usage
    try:
        # Past preflight's free-space check (which would refuse this dir), to a disk that
        # really fills up while the job writes (~3 MB of states into 2 MB).
        monkeypatch.setattr(job.shutil, "disk_usage",
                            lambda p: real(p)._replace(free=1 << 40))
        out = mnt / "out"
        with pytest.raises(JobError) as err:
            job.run(compose_cfg(*HF, f"output.dir={out}"))
        msg = str(err.value)
        assert "\n" not in msg and f"output.dir={str(out)!r}" in msg
        assert "disk is full" in msg and "GB still needed" in msg
        m = json.loads((out / "manifest.json").read_text())
        assert m["status"] == "failed"
        assert not list(out.glob(".reserve-*"))
        written = data_files(out)
        assert all(file_problem(p, "safetensors") is None for p in written.values())
    finally:
        monkeypatch.undo()
        subprocess.run(["umount", str(mnt)], check=False)


def test_the_manifest_credits_the_engine_that_wrote_the_files(done_run, tmp_path, offline):
    from eagle3_extract.extract.job import run

    out = tmp_path / "out"
    shutil.copytree(done_run, out)
    first = json.loads((out / "manifest.json").read_text())
    assert first["produced_by"] == {"hf": 12}
    again = run(compose_cfg("engine=vllm", *COMMON, f"output.dir={out}"))  # nothing to do
    assert again["counts"]["written_this_run"] == 0
    assert again["produced_by"] == {"hf": 12} and again["engine"]["name"] == "hf"


@pytest.mark.parametrize("override,match", [
    ("+dataset.pth=/x", "+dataset.pth: dataset has no key 'pth'; did you mean dataset.path?"),
    ("model.pth=/x", "model.pth: Key 'pth' not in 'ModelConfig'"),
    ("dataset.max_samples=many", "dataset.max_samples: Value 'many'"),
    ("+foo=1", "+foo: the config has no key 'foo'"),
    ("datset=sample", "Key 'datset' not in 'Config'"),
])
def test_config_errors_are_one_line_and_exit_2(override, match, tmp_path):
    r = run_cli(*HF, "dry_run=true", override, f"output.dir={tmp_path}/out", timeout=120)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], r.stderr
    assert not (tmp_path / "out" / "run.json").exists()


@pytest.mark.parametrize("override,match", [
    ("dataset.path=some-org/some-chats dataset.format=hub", "dataset.path='some-org/some-chats' is a Hugging "
     "Face hub name, the hub (127.0.0.1:9) cannot be reached"),
    ("model.path=some-org/some-model", "model.path='some-org/some-model' is a Hugging Face "
     "hub name"),
    ("dataset.path={fifo}", "is a named pipe (FIFO), not a regular file"),
])
def test_refusals_are_one_line_on_stderr_and_nothing_on_stdout(override, match, tmp_path):
    """No network (the hub's endpoint a closed port, no offline mode): one line within
    seconds, not half a minute of retries; not repeated as a log line on stdout."""
    import os

    os.mkfifo(tmp_path / "rows.jsonl")
    override = override.format(fifo=tmp_path / "rows.jsonl").split()
    r = run_cli(*HF, "dry_run=true", *override, f"output.dir={tmp_path}/out", timeout=120,
                HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], r.stderr
    assert "local path" in lines[0] or "FIFO" in lines[0]
    assert "ERROR" not in r.stdout and match not in r.stdout, r.stdout


def test_extra_vllm_args_are_still_additions(tmp_path):
    r = run_cli(*HF, "dry_run=true", "+engine.vllm_args.block_size=32",
                f"output.dir={tmp_path}/out", timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_max_model_len_above_the_models_limit_fails_in_preflight(tmp_path, offline):
    from eagle3_extract.extract.job import preflight

    with pytest.raises(PreflightError, match=r"model\.max_model_len=8192 is above the model's "
                                             r"limit of 4096"):
        preflight(compose_cfg(*HF, "model.max_model_len=8192", "engine.token_budget=8192",
                              f"output.dir={tmp_path}/out"))
    assert not (tmp_path / "out" / "run.json").exists()  # nothing locked to the bad value


def test_help_imports_neither_torch_nor_vllm():
    code = ("import sys; sys.argv = ['eagle3-extract', '--help']\n"
            "from eagle3_extract.cli import extract_main\n"
            "try:\n    extract_main()\nexcept SystemExit:\n    pass\n"
            "print('HEAVY', 'torch' in sys.modules, 'vllm' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "HEAVY False False" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.engine
def test_the_embedded_default_is_quiet_and_fits_a_laptop(tmp_path):
    """`make extract`'s job: peak memory of the whole process tree (driver + vLLM worker)
    sampled while it runs, and what it prints."""
    import time

    import psutil

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("EAGLE3_", "HYDRA_", "VLLM_CPU_KVCACHE"))}
    env["EAGLE3_OUTPUT_ROOT"] = str(tmp_path)
    proc = subprocess.Popen([str(BIN / "eagle3-extract")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak = 0
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    print(f"peak RSS of the tree: {peak / 2**30:.2f} GiB")
    assert peak < 4 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"
    assert "done: 35 samples" in out
    assert "INFO" not in out.replace("[eagle3_extract][INFO]", "")  # no engine INFO lines
    assert "incorrect outputs" not in out and "Loading safetensors" not in out


def test_two_jobs_racing_on_one_dir(tmp_path):
    """Started together: one runs, the other is refused in one line; the data is whole."""
    from test_job import BIN as EXTRACT
    from test_job import env

    out = tmp_path / "out"
    procs = [subprocess.Popen([str(EXTRACT), *HF, f"output.dir={out}"], env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], [(rc, err[-1500:]) for rc, err in results]
    refused = next(err for rc, err in results if rc == 2).strip().splitlines()[-1]
    assert "being written by pid" in refused
    rc, rep = status(out)
    assert rc == 0 and rep["complete"] and rep["totals"]["damaged"] == 0


def test_float16_for_a_bfloat16_checkpoint_fails_in_preflight(tmp_path, offline):
    from eagle3_extract.extract.job import preflight

    with pytest.raises(PreflightError, match=r"model\.dtype=float16 for a bfloat16 checkpoint"):
        preflight(compose_cfg(*HF, "model.dtype=float16", f"output.dir={tmp_path}/out"))
    preflight(compose_cfg(*HF, "model.dtype=float32", f"output.dir={tmp_path}/ok")).close()


@pytest.mark.parametrize("cmd", [["eagle3-status"], ["eagle3-validate", "--no-report"]])
def test_output_into_a_closed_pipe_is_no_traceback(done_run, cmd):
    """`eagle3-status DIR | head -1`: the reader is gone before the writer is done."""
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # the reader is gone: every write fails with EPIPE
    try:
        r = subprocess.run([str(BIN / cmd[0]), str(done_run), *cmd[1:]], stdout=w_fd,
                           stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(w_fd)
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 141
