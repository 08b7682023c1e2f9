"""`eagle3-extract` end to end: real engines, the tiny model, the committed sample data.

Module-scoped runs are shared between tests (engine starts are the cost):
- `hf_run`: one subprocess run with engine=hf;
- `vllm_multirun`: one `-m` sweep with engine=vllm over output=safetensors,speculators_pt
  (two jobs, two engine starts in one process, two output dirs);
- the SIGKILL test adds two more vLLM starts (killed run, resumed run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open

from eagle3_extract import shm_watch
from eagle3_extract.config import ASSETS, PreflightError, conf_dir

BIN = Path(sys.executable).parent / "eagle3-extract"
N = 12  # samples per run
COMMON = [f"dataset.max_samples={N}", "model.max_model_len=1024", "engine.token_budget=1024"]
# Small batches so the SIGKILL lands between files; uni executor: one process, fast start.
VLLM = ["engine=vllm", "engine.max_num_seqs=2", "engine.distributed_executor_backend=uni"]


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("EAGLE3_", "HYDRA_"))}
    e.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    e.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0")
    e.update(extra)
    return e


def run_cli(*args: str, timeout: int = 600, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN), *args], env=env(**extra_env), capture_output=True,
                          text=True, timeout=timeout)


def compose_cfg(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def data_files(root: Path, ext: str = ".safetensors") -> dict[int, Path]:
    return {int(p.name[: -len(ext)]): p for p in (root / "data").rglob(f"*{ext}")}


def load_st(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def expected_samples(*overrides: str):
    """The data stage's samples for a config, computed independently of the job."""
    from transformers import AutoTokenizer

    from eagle3_extract.config import max_length
    from eagle3_extract.dataset.samples import build_dataset

    cfg = compose_cfg(*overrides)
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    data = build_dataset(cfg.dataset, tok, max_length(cfg.dataset, cfg.model))
    return {int(data.indices[j]): data.sample(j) for j in range(len(data))}


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "out"
    t0 = time.time()
    r = run_cli("engine=hf", f"output.dir={out}", *COMMON)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r, time.time() - t0


@pytest.fixture(scope="module")
def vllm_multirun(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    r = run_cli("-m", "output=safetensors,speculators_pt", *VLLM, *COMMON,
                EAGLE3_OUTPUT_ROOT=str(root))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    return root, r


# --- engine=hf ----------------------------------------------------------------------


def test_hf_end_to_end_files_manifest_token_freq(hf_run):
    out, r, _ = hf_run
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete"
    assert m["layer_ids"] == [2, 4, 5, 8]  # eagle3 default for the 8-layer tiny Llama
    assert m["model"]["architecture"] == "LlamaForCausalLM" and m["model"]["num_layers"] == 8
    assert m["model"]["config_sha256"] and m["model"]["dtype"] == "bfloat16"
    assert set(m["versions"]) >= {"vllm", "torch", "transformers", "speculators",
                                  "eagle3_extract"}
    assert m["patches"] and m["patches"]["series"]  # the applied-patch manifest
    assert m["config"]["output"]["dir"] == str(out)
    c = m["counts"]
    assert c["samples"] == c["written"] == c["written_this_run"] == N and c["resumed"] == 0
    assert set(c["skipped"]) >= {"malformed_json", "no_assistant_turn", "overlong"}
    t = m["timings"]
    for key in ("preflight_s", "engine_start_s", "extract_s", "total_s", "tokens_per_s"):
        assert t[key] > 0
    # the HF engine loaded beside tokenization: it began inside preflight, and the job
    # waited at most for what of its start preflight did not cover
    assert 0 < t["engine_start_at_s"] < t["preflight_s"]
    assert t["engine_wait_s"] <= max(
        0.0, t["engine_start_at_s"] + t["engine_start_s"] - t["preflight_s"]) + 0.05
    run = json.loads((out / "run.json").read_text())
    assert run["run_id"] == m["run_id"]

    files = data_files(out)
    assert sorted(files) == list(range(N))  # sample dataset: every row usable
    assert all(p.parent == out / "data" / "00000" for p in files.values())
    want = expected_samples(*COMMON)
    tokens = 0
    for i, p in files.items():
        t, meta = load_st(p)
        s = want[i]
        assert t["input_ids"].dtype == torch.int64 and t["input_ids"].tolist() == s.input_ids
        assert t["loss_mask"].dtype == torch.uint8 and t["loss_mask"].tolist() == s.loss_mask
        hs = t["hidden_states"]
        assert hs.shape == (len(s), 4, 128) and hs.dtype == torch.bfloat16
        assert torch.isfinite(hs).all()
        # layers are distinct states, not one layer repeated
        assert not torch.equal(hs[:, 0], hs[:, 1]) and not torch.equal(hs[:, 2], hs[:, 3])
        assert meta["sample_index"] == str(i) and meta["run_id"] == m["run_id"]
        assert json.loads(meta["layer_ids"]) == [2, 4, 5, 8]
        tokens += len(s)
    assert m["tokens"]["total"] == tokens
    assert m["bytes"]["data"] == sum(p.stat().st_size for p in files.values())

    freq = json.loads((out / "token_freq.json").read_text())
    assert freq["tokens"] == sum(freq["all"].values()) == tokens
    assert freq["loss_tokens"] == sum(freq["loss"].values()) == m["tokens"]["loss"]
    first = want[0]
    eot = str(first.input_ids[-1])
    assert freq["loss"][eot] >= N  # each conversation ends with an assistant <|eot_id|>

    # Hydra's logs live under output.dir, nothing in a stray ./outputs
    logs = list((out / "logs").glob("*/extract.log"))
    assert len(logs) == 1 and (logs[0].parent / ".hydra" / "config.yaml").is_file()
    assert "done: 12 samples" in logs[0].read_text()
    assert not [p for p in out.rglob("*") if p.name.endswith("pt")]


def test_rerun_resumes_nothing_and_refuses_a_different_config(hf_run):
    from eagle3_extract.extract.job import preflight
    from eagle3_extract.extract.job import run as extract

    out, _, _ = hf_run
    before = {p: p.stat().st_mtime_ns for p in data_files(out).values()}
    base = ["engine=hf", f"output.dir={out}", *COMMON]
    for changed, what in [
        (["layers=explicit", "layers.ids=[1,3]"], "layer_ids"),
        (["dataset.seed=1"], "dataset.seed"),
        (["dataset.max_length=500"], "dataset.max_length"),
        (["output=speculators_pt"], "output.format"),
        (["model.dtype=float32"], "model.dtype"),
    ]:
        with pytest.raises(PreflightError, match=rf"output.dir=.*different.*{what}"):
            preflight(compose_cfg(*base, *changed, f"output.dir={out}"))
    # performance knobs and the engine choice are not part of the identity
    m = extract(compose_cfg(*base, "engine.token_budget=2048", "output.writer_threads=1",
                            "engine.max_num_seqs=3"))
    assert m["counts"]["written_this_run"] == 0 and m["counts"]["resumed"] == N
    assert "engine_start_s" not in m["timings"]  # nothing to do: no engine started
    assert {p: p.stat().st_mtime_ns for p in data_files(out).values()} == before


def no_template_tokenizer(tmp_path: Path) -> Path:
    d = tmp_path / "tok"
    shutil.copytree(ASSETS / "tokenizer", d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("case", [
    "dataset_missing", "dataset_empty", "no_chat_template", "layer_out_of_range",
    "layers_not_increasing", "output_not_writable", "token_budget", "model_path",
    "config_value", "vllm_arg_typo", "vllm_arg_ours", "vllm_arg_truncates",
])
def test_preflight_errors_name_the_key(case, tmp_path, offline):
    from eagle3_extract.extract.job import preflight

    out = tmp_path / "out"
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "a_file").write_text("x")
    overrides, match = {
        "dataset_missing": (["dataset=local", f"dataset.path={tmp_path}/nope.jsonl"],
                            r"dataset\.path=.*no such file"),
        "dataset_empty": (["dataset=local", f"dataset.path={tmp_path}/empty.jsonl"],
                          r"dataset\.path=.*no rows"),
        "no_chat_template": ([f"model.tokenizer={no_template_tokenizer(tmp_path)}"],
                             r"no chat template.*model\.tokenizer"),
        "layer_out_of_range": (["layers=explicit", "layers.ids=[1,9]"],
                               r"layers\.ids.*\[9\] out of range.*8 decoder layers"),
        "layers_not_increasing": (["layers=explicit", "layers.ids=[3,2]"],
                                  r"layers\.ids.*strictly increasing"),
        "output_not_writable": ([f"output.dir={tmp_path}/a_file/sub"],
                                r"output\.dir=.*not writable"),
        "token_budget": (["engine.token_budget=100"], r"engine\.token_budget=100"),
        "model_path": (["model.path=/nonexistent/model"], r"model\.path='/nonexistent/model'"),
        "config_value": (["dataset.overlong=drop"], r"dataset\.overlong='drop'"),
        "vllm_arg_typo": (["engine=vllm", "+engine.vllm_args.max_num_partial_prefils=2"],
                          r"engine\.vllm_args\.max_num_partial_prefils is not a vLLM.*"
                          r"did you mean max_num_partial_prefills"),
        "vllm_arg_ours": (["engine=vllm", "+engine.vllm_args.tensor_parallel_size=2"],
                          r"engine\.vllm_args\.tensor_parallel_size: set "
                          r"model\.tensor_parallel_size"),
        "vllm_arg_truncates": (["engine=vllm", "+engine.vllm_args.enable_prefix_caching=true"],
                               r"engine\.vllm_args\.enable_prefix_caching=True is not "
                               r"supported"),
    }[case]
    engine = [] if any(o.startswith("engine=") for o in overrides) else ["engine=hf"]
    cfg = compose_cfg(*engine, f"output.dir={out}", *overrides)
    with pytest.raises(PreflightError, match=match):
        preflight(cfg)
    assert not (out / "run.json").exists()


def test_vllm_args_are_checked_against_engine_args_read_from_its_source():
    """The preflight reads EngineArgs' field names from vLLM's source instead of importing
    it (10 s); the parse must give exactly the imported dataclass's fields."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from eagle3_extract.engine.vllm_args import engine_arg_fields

    assert engine_arg_fields() == {f.name for f in dataclasses.fields(EngineArgs)}


def python_c(code: str, *args) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter of this environment, its argv[1:] the args."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env(),
                          capture_output=True, text=True, timeout=300)


def test_a_vllm_job_without_vllm_installed_is_one_line_exit_2(tmp_path):
    """engine=vllm where vLLM cannot be found (an environment made without it): preflight's
    EngineArgs check says so in one line, not a traceback, and nothing is written."""
    code = ("import sys\n"
            "sys.modules['vllm'] = None  # what find_spec reports for a missing package\n"
            "sys.argv = ['eagle3-extract', 'engine=vllm', 'output.dir=' + sys.argv[1]]\n"
            "from eagle3_extract.cli import extract_main\n"
            "extract_main()\n")
    r = python_c(code, tmp_path / "out")
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("eagle3-extract: error: engine=vllm: vLLM is not installed"), err
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "out" / "run.json").exists()


def test_preflight_of_a_vllm_job_leaves_vllm_to_the_engine_start(tmp_path):
    """Preflight (no engine start) checks engine.vllm_args without importing vLLM: the
    import is the engine start's, which runs beside tokenization; a typo still fails."""
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from eagle3_extract.config import conf_dir, PreflightError\n"
        "from eagle3_extract.extract.job import preflight\n"
        "with initialize_config_dir(config_dir=str(conf_dir()), version_base='1.3'):\n"
        "    base = ['engine=vllm', 'output.dir=' + sys.argv[1]]\n"
        "    try:\n"
        "        preflight(compose('config', overrides=base + ['+engine.vllm_args.max_num_seq=4']),\n"
        "                  start_engine=False)\n"
        "    except PreflightError as e:\n"
        "        assert 'max_num_seqs' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('the typo passed')\n"
        "    preflight(compose('config', overrides=base), start_engine=False).lock.release()\n"
        "print(sorted(m for m in sys.modules if m.startswith('vllm')))\n")
    r = python_c(code, tmp_path / "out")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "vllm.engine" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


@pytest.mark.engine
def test_nested_vllm_args_reach_vllm_as_plain_values(tmp_path, offline):
    """A nested override (attention_config={backend: ...}) was a DictConfig that vLLM's
    pydantic configs refused at engine start; now plain dicts, accepted by EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs

    from eagle3_extract.engine.vllm_args import engine_args
    from eagle3_extract.models.config import inspect_model

    cfg = compose_cfg("engine=vllm", f"output.dir={tmp_path}/out",
                      "+engine.vllm_args.attention_config={backend:CPU_ATTN}",
                      "+engine.vllm_args.block_size=32")
    args = engine_args(cfg.engine, cfg.model, inspect_model(cfg.model))
    assert type(args["attention_config"]) is dict and args["block_size"] == 32
    vc = EngineArgs(**args).create_engine_config()
    assert vc.attention_config.backend.name == "CPU_ATTN" and vc.cache_config.block_size == 32
    assert not vc.cache_config.enable_prefix_caching
    assert not vc.scheduler_config.enable_chunked_prefill


def test_preflight_disk_space(tmp_path, offline):
    from eagle3_extract.extract.job import preflight

    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        with pytest.raises(PreflightError, match=r"output\.dir=.*need about.*GB free"):
            preflight(compose_cfg("engine=hf", f"output.dir={mnt}/out"))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_preflight_failure_exits_2_fast_without_traceback(tmp_path):
    (tmp_path / "a_file").write_text("x")
    t0 = time.time()
    # an output.dir that cannot be created: Hydra's log dir must not crash first either
    r = run_cli("engine=hf", f"output.dir={tmp_path}/a_file/out")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "output.dir=" in r.stderr and "not writable" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert time.time() - t0 < 90  # seconds, not an engine start (slow shared CI box)


def test_two_shards_share_one_directory(tmp_path, offline):
    from eagle3_extract.extract.job import run as extract

    out = tmp_path / "out"
    base = ["engine=hf", f"output.dir={out}", "dataset.max_samples=5",
            "model.max_model_len=1024", "engine.token_budget=1024", "shard.count=2"]
    for i in (1, 0):
        m = extract(compose_cfg(*base, f"shard.index={i}"))
        assert m["counts"]["samples"] == m["counts"]["written_this_run"] == [3, 2][i]
    assert sorted(data_files(out)) == [0, 1, 2, 3, 4]
    for i, want in ((0, [0, 2, 4]), (1, [1, 3])):
        m = json.loads((out / f"manifest.shard-0000{i}-of-00002.json").read_text())
        assert m["status"] == "complete" and m["shard"] == {"index": i, "count": 2}
        assert m["counts"]["samples"] == len(want)
        assert (out / f"token_freq.shard-0000{i}-of-00002.json").is_file()
    assert not (out / "manifest.json").exists()


# --- engine=vllm ----------------------------------------------------------------------


@pytest.mark.engine
def test_vllm_multirun_two_jobs_own_dirs(vllm_multirun, hf_run):
    from speculators.train.data import Eagle3SampleFileDataset

    root, r = vllm_multirun
    st = root / "tiny" / "sample" / "eagle3"
    pt = root / "tiny" / "sample" / "eagle3-speculators"
    for d in (st, pt):
        m = json.loads((d / "manifest.json").read_text())
        assert m["status"] == "complete" and m["counts"]["written_this_run"] == N
        assert m["engine"]["name"] == "vllm" and m["config"]["output"]["dir"] == str(d)
        assert len(list((d / "logs").glob("*/extract.log"))) == 1  # each job its own logs
    assert sorted(data_files(st)) == list(range(N))
    assert sorted(data_files(pt, ".pt")) == list(range(N))
    # nothing but samples ends in "pt" under the speculators_pt dir
    pt_like = [p for p in pt.rglob("*") if p.is_file() and p.name.endswith("pt")]
    assert sorted(pt_like) == sorted(data_files(pt, ".pt").values())

    # speculators 0.3.0's own loader reads the speculators_pt output
    ds = Eagle3SampleFileDataset(max_len=1024, datapath=str(pt))
    assert len(ds) == N
    by_index = {int(Path(f).stem): k for k, f in enumerate(ds.data)}
    for i, p in data_files(st).items():
        t, _ = load_st(p)
        item = ds[by_index[i]]
        hs = t["hidden_states"]
        assert item["input_ids"].tolist() == t["input_ids"][1:].tolist()
        assert item["loss_mask"].tolist() == t["loss_mask"][1:].tolist()
        # same engine, same data: the two formats hold identical states
        assert torch.equal(item["verifier_last_hidden_states"], hs[1:, -1].float())
        assert torch.equal(item["hidden_states"], hs[:-1, :-1].flatten(1).float())

    # vLLM and the HF reference agree (bf16 tolerance): same layers, same order
    hf_out = hf_run[0]
    for i, p in data_files(st).items():
        v, _ = load_st(p)
        h, _ = load_st(data_files(hf_out)[i])
        assert torch.equal(v["input_ids"], h["input_ids"])
        a, b = v["hidden_states"].float(), h["hidden_states"].float()
        rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
        assert rel.mean() < 0.03 and rel.max() < 0.1, (i, rel.max(dim=0).values)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.mark.engine
def test_sigkill_of_the_main_process_leaves_no_engine_worker_or_tracker(tmp_path):
    """kill -9 of eagle3-extract's main process alone (not its group), engine up: its
    worker (its engine core runs in the main process), resource tracker and watcher are
    gone within seconds."""
    from conftest import sigkill_main_leaves_nothing

    args = [str(BIN), "engine=vllm", "engine.max_num_seqs=2", f"output.dir={tmp_path / 'o'}",
            "dataset.max_samples=400", "model.max_model_len=1024", "engine.token_budget=1024"]
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(args, env=env(), stdout=log, stderr=subprocess.STDOUT)
        left = sigkill_main_leaves_nothing(
            proc, lambda names: any(n.startswith("VLLM::") for n in names))
    assert not left, f"outlived the job: {left}"


@pytest.mark.engine
def test_an_error_after_tokenization_stops_the_engine_loading_beside_it(tmp_path):
    """The engine loads while preflight tokenizes (engine/start.py). When tokenization
    ends in an error (here: no row is usable), the job prints it in one line and exits 2
    after ending the engine's processes itself: none is left when it exits (its watcher,
    which would end them 2 s later, has nothing to do). The tokenizer workers fork before
    the engine's thread starts (a fork beside it can hang a worker)."""
    from conftest import follow_tree, still_alive

    rows = (ASSETS / "sample" / "conversations.jsonl").read_text().splitlines() * 1000
    dataset = tmp_path / "chats.jsonl"
    dataset.write_text("\n".join(rows) + "\n")
    args = [str(BIN), "engine=vllm", "dataset=local", f"dataset.path={dataset}",
            "dataset.overlong=skip", "dataset.max_length=16", "model.max_model_len=1024",
            "engine.token_budget=1024", f"output.dir={tmp_path / 'o'}"]
    with open(tmp_path / "err", "w") as err, open(tmp_path / "out", "w") as out:
        proc = subprocess.Popen(args, env=env(EAGLE3_TOKENIZED_CACHE="off"),
                                stdout=out, stderr=err)
        seen = follow_tree(proc, lambda names: False, timeout=300)
        rc = proc.wait()
        left = [p for p in still_alive(seen) if shm_watch.MODULE not in p]
    text = (tmp_path / "err").read_text()
    # torch warns on a host without CUDA when vLLM imports it, and vLLM's CPU worker's
    # torch binds its memory to the NUMA node from C++ (not ours, not on a GPU host)
    lines = [ln for ln in text.strip().splitlines()
             if "No CUDA runtime is found" not in ln and "NUMA binding" not in ln]
    assert rc == 2 and len(lines) == 1, text
    assert lines[0].startswith("eagle3-extract: error: dataset.path=") and "none of" in lines[0]
    assert "overlong" in lines[0]
    # it was loading: vLLM's worker, the spawn of it, or the resource tracker its spawn
    # context starts (our fork pool's semaphores never start one)
    assert any("VLLM" in n or "spawn" in n or "resource_tracker" in n
               for _, n in seen.values()), seen
    assert not left, f"outlived the job: {left}"
    # 35,000 rows (enough that the engine start spawns before they are done on a busy
    # 2-core CI host): tokenized by forked workers, forked before the engine's thread started
    assert "beside running threads" not in (tmp_path / "out").read_text()


@pytest.mark.engine
def test_vllm_sigkill_then_resume_gives_the_uninterrupted_result(vllm_multirun, tmp_path):
    ref = data_files(vllm_multirun[0] / "tiny" / "sample" / "eagle3")
    out = tmp_path / "killed"
    args = [str(BIN), *VLLM, f"output.dir={out}", *COMMON]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(args, env=env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 500
        while len(data_files(out)) < 3:
            assert proc.poll() is None, "run ended before it could be killed"
            assert time.time() < deadline, "no files appeared"
            time.sleep(0.02)
        group = [int(d) for d in os.listdir("/proc") if d.isdigit() and _pgid(int(d)) == proc.pid]
        held = set().union(*(shm_watch.shm_files_of(p) for p in group))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # what the job's processes mapped in /dev/shm under a name (the uni executor's engine
    # has little: our host buffer is unlinked once mapped; tests/test_shm_watch.py kills
    # vLLM-like segments and locks) goes within seconds, by the job's watcher
    deadline = time.time() + 20
    while [p for p in held if os.path.exists(p)] and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in held if os.path.exists(p)]
    assert not list(Path("/dev/shm").glob(f"eagle3-hs-{proc.pid}-*"))
    killed_with = sorted(data_files(out))
    assert 3 <= len(killed_with) < N, killed_with
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "running"  # it never got to say otherwise
    # a writer killed mid-file leaves a temp like this one; the rerun must remove it
    todo = min(set(range(N)) - set(killed_with))
    stale = out / "data" / "00000" / f".{todo:09d}.safetensors.tmp-999999"
    stale.write_bytes(b"partial")

    r = run_cli(*VLLM, f"output.dir={out}", *COMMON)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete"
    assert m["counts"]["resumed"] == len(killed_with)
    assert m["counts"]["written_this_run"] == N - len(killed_with)
    got = data_files(out)
    assert sorted(got) == sorted(ref) == list(range(N))
    assert [p.name for p in out.rglob(".*") if p.parent.name != "logs"
            and p.name not in (".hydra", ".locks")] == []
    assert not list((out / ".locks").glob("shard-*"))  # the lock went with the job
    for i in range(N):
        a, ma = load_st(got[i])
        b, mb = load_st(ref[i])
        assert ma == mb
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.engine
def test_vllm_sigterm_finishes_writes_says_interrupted_and_resumes(vllm_multirun, tmp_path):
    """SIGTERM, what a cluster sends, ends the job as Ctrl-C does."""
    ref = data_files(vllm_multirun[0] / "tiny" / "sample" / "eagle3")
    out = tmp_path / "termed"
    args = [str(BIN), *VLLM, f"output.dir={out}", *COMMON]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(args, env=env(), stdout=log, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        deadline = time.time() + 500
        while len(data_files(out)) < 2:
            assert proc.poll() is None, "run ended before the signal"
            assert time.time() < deadline, "no files appeared"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the job's own process only
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert "interrupted by SIGTERM" in last and "rerun the same command to resume" in last
    assert "Traceback" not in err
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "interrupted"
    assert not list(Path("/dev/shm").glob(f"eagle3-hs-{proc.pid}-*"))
    assert not list((out / ".locks").glob("shard-*")) and not list(out.glob(".reserve-*"))
    first = sorted(data_files(out))
    assert all(not p.name.startswith(".") for p in (out / "data").rglob("*") if p.is_file())
    r = run_cli(*VLLM, f"output.dir={out}", *COMMON)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["status"] == "complete" and m["counts"]["resumed"] == len(first)
    assert m["produced_by"] == {"vllm": N}
    got = data_files(out)
    assert sorted(got) == sorted(ref)
    assert all(load_st(got[i])[0]["hidden_states"].equal(load_st(ref[i])[0]["hidden_states"])
               for i in range(N))


def test_stale_json_temps_are_removed_for_own_files_only(tmp_path):
    from eagle3_extract.manifest import clean_json_temps

    names = [".manifest.json.tmp-1", ".token_freq.json.tmp-2", ".run.json.tmp-3",
             ".run.json.tmp-4", ".manifest.shard-00001-of-00002.json.tmp-5", "manifest.json"]
    for n in names:
        (tmp_path / n).write_text("{")
    old = time.time() - 600
    os.utime(tmp_path / ".run.json.tmp-3", (old, old))  # a dead run's; -4 may be live
    assert clean_json_temps(tmp_path, ["manifest.json", "token_freq.json"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".manifest.shard-00001-of-00002.json.tmp-5", ".run.json.tmp-4", "manifest.json"]


def test_the_job_names_the_disk_when_the_writer_sets_the_pace():
    from eagle3_extract.extract.job import DISK_BOUND_SHARE, LoopTimes, disk_limit_note

    engine_bound = LoopTimes(extract_s=30.0, submit_s=DISK_BOUND_SHARE * 30.0, drain_s=2.0)
    assert disk_limit_note(engine_bound, 30.0, 10**9, 2) is None  # the drain is not counted
    disk_bound = LoopTimes(extract_s=30.0, submit_s=6.0)
    note = disk_limit_note(disk_bound, 30.0, 36 * 10**9, 2)
    assert note.startswith("the disk was the limit: the engine waited 6.0 s (20% of")
    assert "1.20 GB/s with output.writer_threads=2" in note and "\n" not in note
    assert disk_limit_note(LoopTimes(), 0.0, 0, 2) is None  # nothing extracted
