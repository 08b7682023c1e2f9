"""Scaling out: shards, data-parallel replicas, the submitit launcher, `eagle3-status`.

Engine-agnostic parts run with engine=hf (seconds); the data-parallel run uses two real
vLLM replicas (uni executor) and must equal an unsharded vLLM run bit for bit.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open

from eagle3_extract import replicas
from eagle3_extract.extract import parallel
from eagle3_extract.check import status
from eagle3_extract.manifest import Manifest
from eagle3_extract.config import ConfigError, PreflightError, conf_dir, validate

BIN = Path(sys.executable).parent
N = 8
# files_per_dir=1: one subdir per sample, so a test can block one sample's directory
COMMON = [f"dataset.max_samples={N}", "model.max_model_len=1024", "engine.token_budget=1024",
          "output.files_per_dir=1"]
HF = ["engine=hf", *COMMON]
VLLM = ["engine=vllm", "engine.max_num_seqs=2", "engine.distributed_executor_backend=uni",
        *COMMON]


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("EAGLE3_", "HYDRA_")) and k != "VLLM_CPU_OMP_THREADS_BIND"}
    e.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    e.update(extra)
    return e


def run_cli(*args: str, timeout: int = 600, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "eagle3-extract"), *args], env=env(**extra_env),
                          capture_output=True, text=True, timeout=timeout)


def compose_cfg(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def data_files(root: Path) -> dict[int, Path]:
    return {int(p.stem): p for p in (root / "data").rglob("*.safetensors")}


def assert_same_files(got: Path, want: Path) -> None:
    """Same sample files, identical tensors and metadata."""
    a, b = data_files(got), data_files(want)
    assert sorted(a) == sorted(b) == list(range(N))
    for i in a:
        assert a[i].relative_to(got) == b[i].relative_to(want)
        with safe_open(a[i], "pt") as fa, safe_open(b[i], "pt") as fb:
            assert fa.metadata() == fb.metadata()
            assert sorted(fa.keys()) == sorted(fb.keys())
            for k in fa.keys():
                assert torch.equal(fa.get_tensor(k), fb.get_tensor(k)), (i, k)


def status_of(root: Path, *args: str) -> tuple[int, dict]:
    r = subprocess.run([str(BIN / "eagle3-status"), str(root), "--json", *args],
                       capture_output=True, text=True, timeout=120)
    return r.returncode, json.loads(r.stdout)


def shards_of(report: dict, count: int) -> list[dict]:
    return next(p for p in report["partitions"] if p["count"] == count)["shards"]


@pytest.fixture(scope="module")
def hf_ref(tmp_path_factory):
    from eagle3_extract.extract.job import run as extract

    out = tmp_path_factory.mktemp("hf_ref") / "out"
    extract(compose_cfg(*HF, f"output.dir={out}"))
    return out


# --- the partition and the per-replica setup (no engine) ---------------------------------


@pytest.mark.parametrize("count,n", [(1, 2), (2, 2), (3, 4), (4, 8)])
def test_replica_shards_partition_each_job_shard(count, n):
    idx = np.arange(1000)
    seen = np.zeros(len(idx), dtype=int)
    for i in range(count):
        for j, c in replicas.replica_shards(i, count, n):
            assert c == count * n
            mine = idx[idx % c == j]
            assert (mine % count == i).all()  # a replica stays inside its job's shard
            seen[mine] += 1
    assert (seen == 1).all()  # together: every sample exactly once


def plan(cfg, log_root):
    """replicas.plan_replicas on a composed job config's own groups."""
    return replicas.plan_replicas(int(cfg.parallel.data_parallel_size),
                                  (int(cfg.shard.index), int(cfg.shard.count)), cfg.engine,
                                  cfg.model, log_root)


def test_devices_split_per_replica(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5,GPU-abc")
    cfg = compose_cfg("model.tensor_parallel_size=2", "parallel.data_parallel_size=2",
                      "shard.count=3", "shard.index=1")
    reps = plan(cfg, tmp_path / "logs")
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in reps] == ["3,4", "5,GPU-abc"]
    assert [r.shard for r in reps] == [(1, 6), (4, 6)]
    assert [r.log_dir.name for r in reps] == ["replica-0", "replica-1"]
    too_many = compose_cfg("model.tensor_parallel_size=2", "model.pipeline_parallel_size=2",
                           "parallel.data_parallel_size=2")
    with pytest.raises(PreflightError, match=r"parallel\.data_parallel_size=2 x 4 devices"):
        plan(too_many, tmp_path)
    # HF runs one device per replica whatever the model's parallel sizes say
    hf = compose_cfg("engine=hf", "model.tensor_parallel_size=2", "parallel.data_parallel_size=4")
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in plan(hf, tmp_path)
            ] == ["3", "4", "5", "GPU-abc"]


def test_cpu_replicas_get_disjoint_cores():
    assert replicas.cpu_binds(list(range(8)), 2, 2) == ["0,1|2,3", "4,5|6,7"]
    assert replicas.cpu_binds([0, 1, 2], 2, 1) == ["0", "1"]
    assert replicas.cpu_binds([0, 1], 2, 2) is None  # too few: leave binding to vLLM


def test_replica_overrides_replace_shard_and_keep_the_rest(tmp_path):
    root = tmp_path / "a b,c" / "it's"
    ov = replicas.replica_overrides(
        ["engine=hf", "shard.index=1", "+shard.count=3", "parallel.data_parallel_size=2",
         "layers=explicit", "layers.ids=[1,3]", "output.dir=/elsewhere"],
        (4, 6), root, tmp_path / "logs x")
    cfg = compose_cfg(*[o for o in ov if not o.startswith("hydra.")])
    assert (cfg.shard.index, cfg.shard.count, cfg.parallel.data_parallel_size) == (4, 6, 1)
    assert cfg.output.dir == str(root) and list(cfg.layers.ids) == [1, 3]
    assert cfg.engine.name == "hf"
    assert ov[-1] == f"hydra.run.dir='{tmp_path}/logs x'"


# --- shards and the submitit launcher ----------------------------------------------------


def test_launcher_configs_extend_the_plugins_schema():
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        slurm = compose("config", overrides=["hydra/launcher=slurm",
                                             "hydra.launcher.partition=gpu"],
                        return_hydra_config=True).hydra.launcher
        local = compose("config", overrides=["hydra/launcher=local"],
                        return_hydra_config=True).hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and local._target_.endswith("LocalLauncher")
    assert (slurm.tasks_per_node, slurm.gpus_per_node, slurm.partition) == (1, 8, "gpu")
    assert slurm.max_num_timeout > 0  # requeue is safe: jobs resume from their files


def test_submitit_local_two_shard_sweep_equals_unsharded(hf_ref, tmp_path):
    out = tmp_path / "out"
    r = run_cli("-m", "hydra/launcher=local", "shard.count=2", "shard.index=range(0,2)",
                *HF, f"output.dir={out}", EAGLE3_OUTPUT_ROOT=str(tmp_path))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "Submitit 'local' sweep" in r.stdout + r.stderr
    results = list((tmp_path / "multirun").glob("*/.submitit/*/*_result.pkl"))
    assert len(results) == 2  # both shards ran as submitit jobs
    assert_same_files(out, hf_ref)
    for i in (0, 1):
        m = json.loads((out / f"manifest.shard-0000{i}-of-00002.json").read_text())
        assert m["status"] == "complete" and m["counts"]["samples"] == N // 2
    rc, rep = status_of(out)
    assert rc == 0 and rep["complete"] and rep["totals"]["done"] == N


# --- a half-finished run: failed replica, other partitions, a killed shard; then resume --


def test_half_finished_run_status_then_each_shard_resumes(hf_ref, tmp_path, offline):
    from eagle3_extract.extract.job import run as extract

    out = tmp_path / "out"
    odd = lambda: {i for i in data_files(out) if i % 2}  # noqa: E731 - shard 1/2's files

    # two replicas; replica 1's samples (odd indices) must go to data/0000<i>: plain files
    blockers = [out / "data" / f"{i:05d}" for i in (1, 3, 5, 7)]
    extract(compose_cfg(*HF, f"output.dir={out}", "dry_run=true"))  # the run's run.json first
    (out / "data").mkdir(parents=True)
    for b in blockers:
        b.write_text("in the way")
    ov = [*HF, f"output.dir={out}", "parallel.data_parallel_size=2"]
    assert parallel.launch(compose_cfg(*ov), ov, tmp_path / "logs") == 1
    assert "Traceback" in (tmp_path / "logs" / "replica-1" / "console.log").read_text()
    assert sorted(data_files(out)) == [0, 2, 4, 6]
    rc, rep = status_of(out)
    assert rc == 1 and [s["state"] for s in shards_of(rep, 2)] == ["complete", "failed"]
    for b in blockers:
        b.unlink()

    # shard 1 of 4 is half of shard 1 of 2: another partition's work counts on resume
    extract(compose_cfg(*HF, f"output.dir={out}", "shard.count=4", "shard.index=1"))
    rc, rep = status_of(out)
    assert rc == 1 and not rep["complete"]
    two = shards_of(rep, 2)
    assert [s["state"] for s in two] == ["complete", "failed"]
    assert (two[0]["samples"], two[0]["done"], two[1]["done"]) == (4, 4, 2)
    assert [s["state"] for s in shards_of(rep, 4)] == ["missing", "complete", "missing",
                                                       "missing"]
    assert rep["totals"]["samples"] == N and rep["totals"]["done"] == len(data_files(out))

    # shard 1/2 killed during its engine start: its manifest says running
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([str(BIN / "eagle3-extract"), *VLLM, f"output.dir={out}",
                             "shard.count=2", "shard.index=1"], env=env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    manifest = out / "manifest.shard-00001-of-00002.json"
    deadline = time.time() + 300
    while (json.loads(manifest.read_text()).get("process") or {}).get("pid") != proc.pid:
        assert proc.poll() is None and time.time() < deadline, "no running manifest"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    m = json.loads(manifest.read_text())
    assert m["status"] == "running"
    rc, rep = status_of(out)
    killed = shards_of(rep, 2)[1]
    assert rc == 1 and killed["state"] == "failed" and "is gone" in killed["reason"]
    assert (killed["samples"], killed["done"]) == (4, 2)
    text = subprocess.run([str(BIN / "eagle3-status"), str(out)], capture_output=True,
                          text=True, timeout=120).stdout
    assert "NOT COMPLETE" in text and "is gone" in text
    # the same manifest seen from where its pid cannot be checked: stale after a while
    m["process"]["host"] = "elsewhere"
    entries = list(status.verified_files(out, "safetensors")[0].values())
    man = Manifest.from_dict(m)
    assert status._shard(man, 1, 2, entries, 1e9).state == "running"
    assert "stale" in status._shard(man, 1, 2, entries, 0.0).reason

    assert odd() == {1, 5}
    m = extract(compose_cfg(*HF, f"output.dir={out}", "shard.count=2", "shard.index=1"))
    assert (m["counts"]["resumed"], m["counts"]["written_this_run"]) == (2, 2)
    rc, rep = status_of(out)
    assert rc == 0 and rep["complete"]
    # each shard's report counts its own tokens; the two add up to the whole
    shard_tokens = [json.loads(p.read_text())["data"]["tokens"]
                    for p in sorted(out.glob("manifest.shard-*-of-00002.json"))]
    assert m["data"]["shard"] == {"index": 1, "count": 2} and len(shard_tokens) == 2
    assert rep["totals"]["tokens"] == rep["totals"]["tokens_total"] == sum(shard_tokens)
    assert_same_files(out, hf_ref)


def test_status_reads_the_writer_layout():
    from eagle3_extract import layout
    from eagle3_extract.extract import writer

    # One definition: status scans with the layout module, the writer names files with it.
    assert status.verified_files is layout.verified_files
    assert writer.sample_path is layout.sample_path and writer.EXTENSIONS is layout.EXTENSIONS


def test_status_of_a_dir_without_run_is_an_error(tmp_path):
    r = subprocess.run([str(BIN / "eagle3-status"), str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no readable run.json" in r.stderr


# --- data-parallel replicas --------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_ref") / "out"
    r = run_cli(*VLLM, f"output.dir={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.engine
def test_two_vllm_replicas_equal_the_unsharded_run(vllm_ref, tmp_path):
    out = tmp_path / "out"
    # The replicas split the cores this process may run on; an in-process vLLM CPU engine
    # earlier in the lane binds its threads (ours restores the mask when it closes), and
    # one CI run saw this process on one core. The job is given the whole machine here.
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        r = run_cli(*VLLM, "parallel.data_parallel_size=2", f"output.dir={out}")
    finally:
        os.sched_setaffinity(0, mask)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert_same_files(out, vllm_ref)
    for i in (0, 1):
        m = json.loads((out / f"manifest.shard-0000{i}-of-00002.json").read_text())
        assert m["status"] == "complete" and m["engine"]["name"] == "vllm"
        assert m["counts"]["written_this_run"] == N // 2
    assert "replica 0: pid" in log and "devices 0," in log and "devices 1," in log  # own cores
    assert "done: 2 replicas, 8 samples" in log
    logs = sorted(p.parent.name for p in (out / "logs").glob("*/replica-*/extract.log"))
    assert logs == ["replica-0", "replica-1"]
    assert status_of(out)[0] == 0
    # the dataset was tokenized once, by the launcher; each replica loaded that set
    for p in (out / "logs").glob("*/replica-*/extract.log"):
        assert "samples from the launcher's tokenized set" in p.read_text()


def test_a_tokenized_set_of_another_run_is_refused(tmp_path, offline, monkeypatch):
    from eagle3_extract.extract.preflight import TOKENIZED_ENV, preflight

    plan = preflight(compose_cfg(*HF, f"output.dir={tmp_path}/a"))
    plan.mine.save(tmp_path / "t", {"ident": plan.ident})
    monkeypatch.setenv(TOKENIZED_ENV, str(tmp_path / "t"))
    same = preflight(compose_cfg(*HF, f"output.dir={tmp_path}/b"))
    assert (same.mine.indices == plan.mine.indices).all() and (same.mine.ids == plan.mine.ids).all()
    with pytest.raises(PreflightError, match=f"{TOKENIZED_ENV}=.*tokenized for run"):
        preflight(compose_cfg(*HF, f"output.dir={tmp_path}/c", "dataset.seed=3"))


def test_preflight_runs_once_in_the_parent_and_fails_fast(tmp_path, offline):
    out = tmp_path / "out"
    ov = [*HF, "parallel.data_parallel_size=2", f"output.dir={out}", "layers=explicit",
          "layers.ids=[1,99]"]
    with pytest.raises(PreflightError, match=r"layers\.ids"):
        parallel.launch(compose_cfg(*ov), ov, tmp_path / "logs")
    assert not (tmp_path / "logs").exists()  # no replica started
    with pytest.raises(ConfigError, match=r"parallel\.data_parallel_size=0"):
        validate(compose_cfg("parallel.data_parallel_size=0"))


def test_ctrl_c_stops_every_replica(tmp_path, offline, caplog):
    caplog.set_level(logging.INFO, logger="eagle3_extract")
    logs = tmp_path / "logs"
    consoles = [logs / f"replica-{r}" / "console.log" for r in (0, 1)]

    def interrupt() -> None:
        while not all(c.exists() for c in consoles):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    ov = [*HF, f"output.dir={tmp_path}/out", "parallel.data_parallel_size=2"]
    assert parallel.launch(compose_cfg(*ov), ov, logs) == 128 + signal.SIGINT
    pids = [int(p) for p in re.findall(r"replica \d+: pid (\d+)", caplog.text)]
    assert len(pids) == 2 and all(_gone(p, 5) for p in pids)
    assert "stopping 2 replicas" in caplog.text


def test_a_replica_dies_with_its_launcher(tmp_path):
    """A SIGKILLed launcher leaves no replica behind (holding GPUs, racing a rerun)."""
    replica = ("from eagle3_extract.replicas import die_with_launcher; die_with_launcher(); "
               "import time; print('armed', flush=True); time.sleep(120)")
    launcher = ("import os, subprocess, sys, time; "
                f"os.environ['{replicas.PARENT_ENV}'] = str(os.getpid()); "
                f"p = subprocess.Popen([sys.executable, '-c', {replica!r}]); "
                "print(p.pid, flush=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "armed"
    assert not _gone(child, 0.1)
    proc.kill()
    proc.wait()
    assert _gone(child, 10)


def _gone(pid: int, within: float = 60) -> bool:
    deadline = time.time() + within
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True  # exited, not reaped yet
        except FileNotFoundError:
            return True
        if time.time() > deadline:
            return False
        time.sleep(0.1)


def test_validate_across_shard_layouts_names_the_shards_that_finish_it(tmp_path, offline):
    """Shard 0 of 2, then shard 1 of 2 redone as shards 1 and 3 of 4 (more nodes): every
    file is there, but the latest layout is unfinished. eagle3-validate (and export) refuse
    in one problem that names the shards to run; running them finds the files, writes none
    again, and the dir validates, the earlier layout a warning."""
    from eagle3_extract.drafter.export import ExportError, export
    from eagle3_extract.extract.job import run as extract
    from eagle3_extract.check.validate import validate as validate_dir

    out = tmp_path / "mixed"
    extract(compose_cfg(*HF, f"output.dir={out}", "shard.count=2", "shard.index=0"))
    for k in (1, 3):
        extract(compose_cfg(*HF, f"output.dir={out}", "shard.count=4", f"shard.index={k}"))
    assert len(data_files(out)) == N
    report = validate_dir(out)
    assert not report["ok"]
    first = report["problems"][0]
    assert first["code"] == "mixed_layouts" and "shard.index=<each of [0, 2]>" in first["message"]
    with pytest.raises(ExportError, match="mixed|several shard layouts"):
        export(out, tmp_path / "export")
    before = {i: p.stat().st_mtime_ns for i, p in data_files(out).items()}
    for k in (0, 2):
        m = extract(compose_cfg(*HF, f"output.dir={out}", "shard.count=4", f"shard.index={k}"))
        assert m["progress"]["written_this_run"] == 0
    assert {i: p.stat().st_mtime_ns for i, p in data_files(out).items()} == before
    report = validate_dir(out)
    assert report["ok"], report["problems"][:3]
    assert [w["code"] for w in report["warnings"]] == ["stale_manifest"]
