"""Trust nothing, round 4 (issue 35): shards that start together agree on one identity,
exports verify what they read, no row stops a job, a folder that is not ours is never
touched, permission problems and bad interpolations are one line, a missing merge and
an edited tokenized set are named. engine=hf on the tiny model: no vLLM start."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_job import COMMON, compose_cfg, data_files, run_cli

from eagle3_extract.errors import PreflightError

HF = ["engine=hf", *COMMON]
BIN = Path(sys.executable).parent
REFUSED = "holds a run with a different data-determining config"


# root reads anything: without these two capabilities it meets the permission bits
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search", "--"]


def cli(name: str, *args: str, no_dac: bool = False) -> subprocess.CompletedProcess:
    """One of our argparse commands (`no_dac`: as root without its override of file
    permissions, as any other user is)."""
    pre = NO_DAC if no_dac and os.geteuid() == 0 else []
    return subprocess.run([*pre, str(BIN / name), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    from eagle3_extract.extract.job import run

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = tmp_path_factory.mktemp("untrusted") / "out"
    run(compose_cfg(*HF, f"output.dir={out}"))
    return out


# --- 1. shards agree before any of them writes a sample --------------------------------


def _claim(root: str, ident: dict, barrier, results, k: int) -> None:
    from eagle3_extract.manifest import claim_run_json

    barrier.wait()
    try:
        results.put((k, "resume" if claim_run_json(Path(root), ident) else "created"))
    except PreflightError:
        results.put((k, "refused"))


@pytest.mark.parametrize("attempt", range(5))
def test_run_identity_is_claimed_once_by_shards_starting_together(tmp_path, attempt):
    """8 processes released by one barrier, two identities: one creates run.json, those
    of its identity resume, every other is refused; run.json is whole."""
    from eagle3_extract.manifest import with_run_id

    a, b = with_run_id({"layer_ids": [2, 4]}), with_run_id({"layer_ids": [1, 2, 3, 4]})
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(8), ctx.Queue()
    idents = [a, b] * 4
    procs = [ctx.Process(target=_claim, args=(str(tmp_path), i, barrier, results, k))
             for k, i in enumerate(idents)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    got = [got[k] for k in range(len(idents))]
    winner = json.loads((tmp_path / "run.json").read_text())
    assert got.count("created") == 1
    for ident, result in zip(idents, got):
        same = ident["run_id"] == winner["run_id"]
        assert result in (("created", "resume") if same else ("refused",)), (ident, result)
    assert not [p for p in tmp_path.iterdir() if p.name != "run.json"]  # no temp left


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() - t0 < timeout, f"{path} never appeared"
        time.sleep(0.02)


@pytest.mark.parametrize("first", ["default-layers", "other-layers"])
def test_a_shard_with_other_settings_is_refused_while_the_first_tokenizes(tmp_path, first):
    """Shard 0 with one layer set tokenizes 4,000 rows; shard 1 with another, started
    then, is refused in one line, exit 2, before its engine starts; shard 0 runs on."""
    from test_job import BIN as EXTRACT
    from test_job import env

    rows = tmp_path / "rows.jsonl"
    with open(rows, "w") as f:
        for i in range(4000):
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"question {i}: " + "word " * 40},
                {"role": "assistant", "content": f"answer {i}: " + "reply " * 40}]}) + "\n")
    out = tmp_path / "out"
    settings = {"default-layers": [], "other-layers": ["layers=explicit", "layers.ids=[1,2]"]}
    second = "other-layers" if first == "default-layers" else "default-layers"
    common = ["engine=hf", "dataset=local", f"dataset.path={rows}", "shard.count=2",
              "model.max_model_len=1024", "engine.token_budget=1024", f"output.dir={out}"]
    e = env(EAGLE3_TOKENIZED_CACHE="off")
    p0 = subprocess.Popen([str(EXTRACT), *common, "shard.index=0", "dry_run=true",
                           *settings[first]], env=e, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out / "run.json", p0)
        tokenizing = p0.poll() is None  # run.json is claimed before the rows are tokenized
        t0 = time.time()
        r1 = subprocess.run([str(EXTRACT), *common, "shard.index=1", *settings[second]], env=e,
                            capture_output=True, text=True, timeout=300)
        refused_in = time.time() - t0
        assert p0.wait(timeout=300) == 0, p0.stderr.read()[-2000:]
    finally:
        p0.kill()
    assert tokenizing
    assert r1.returncode == 2, r1.stderr[-2000:]
    lines = r1.stderr.strip().splitlines()
    assert len(lines) == 1 and REFUSED in lines[0] and "layer_ids" in lines[0], r1.stderr
    assert "engine started" not in r1.stdout
    assert not (out / "manifest.shard-00001-of-00002.json").exists()
    print(f"refused in {refused_in:.1f} s")


def test_shards_started_within_milliseconds_one_identity_wins(tmp_path):
    from test_job import BIN as EXTRACT
    from test_job import env

    out = tmp_path / "out"
    common = [*HF, "shard.count=2", f"output.dir={out}"]
    procs = [subprocess.Popen([str(EXTRACT), *common, "shard.index=0"], env=env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
             subprocess.Popen([str(EXTRACT), *common, "shard.index=1", "layers=explicit",
                               "layers.ids=[1,2]"], env=env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    assert REFUSED in next(err for rc, err in results if rc == 2)
    from eagle3_extract.run_state import read_manifests, run_ids

    run = read_manifests(out)
    assert len(run_ids(out, list(run.layouts[2].values()))) == 1


def test_a_mixed_directory_from_an_older_version_is_named_and_refused(tmp_path, done_run):
    """What the old version left: shard 1 of another layer set beside shard 0."""
    from eagle3_extract.drafter.export import main as export_main
    from eagle3_extract.drafter.train import preflight as train_preflight
    from eagle3_extract.extract.job import run

    mixed, other = tmp_path / "mixed", tmp_path / "other"
    run(compose_cfg(*HF, "shard.count=2", "shard.index=0", f"output.dir={mixed}"))
    run(compose_cfg(*HF, "shard.count=2", "shard.index=1", "layers=explicit",
                    "layers.ids=[1,2]", f"output.dir={other}"))
    name = "manifest.shard-00001-of-00002.json"
    shutil.copy(other / name, mixed / name)
    for i, p in data_files(other).items():
        dst = mixed / p.relative_to(other)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(p, dst)
    st = cli("eagle3-status", str(mixed))
    assert st.returncode == 1 and "MIXED: this directory mixes 2 runs" in st.stdout, st.stdout
    assert export_main([str(mixed), str(tmp_path / "exp")]) == 2
    assert not (tmp_path / "exp").exists()
    with pytest.raises(PreflightError, match="mixes 2 runs"):
        from hydra import compose, initialize_config_dir

        from eagle3_extract.config import conf_dir

        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("train", overrides=[f"data.dir={mixed}",
                                              f"output.dir={tmp_path / 'drafter'}"])
        train_preflight(cfg)


# --- 2. eagle3-export verifies what it reads --------------------------------------------


def test_export_refuses_a_deleted_file_a_flipped_bit_and_an_out_inside(tmp_path, done_run,
                                                                       capsys):
    from eagle3_extract.drafter.export import main as export_main

    gone = tmp_path / "gone"
    shutil.copytree(done_run, gone)
    victim = data_files(gone)[3]
    victim.unlink()
    assert export_main([str(gone), str(tmp_path / "e1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "shard 0/1: 12 samples written, 11 whole files" in err[0], err

    flipped = tmp_path / "flipped"
    shutil.copytree(done_run, flipped)
    victim = data_files(flipped)[5]
    data = bytearray(victim.read_bytes())
    data[len(data) - 100] ^= 0x10  # one bit of a state (the header still parses)
    victim.write_bytes(bytes(data))
    assert export_main([str(flipped), str(tmp_path / "e2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(victim) in err[0] and "content checksum" in err[0], err
    assert not (tmp_path / "e2").exists() and not list(tmp_path.glob(".e2.tmp-*"))

    assert export_main([str(done_run), str(done_run / "export")]) == 2
    err = capsys.readouterr().err
    assert "is inside" in err and not (done_run / "export").exists()
    assert export_main([str(done_run), str(tmp_path / "ok")]) == 0
    rec = json.loads((tmp_path / "ok" / "export.json").read_text())
    assert rec["checked"] == {"files": 12, "without_checksum": 0}


# --- 3. no row stops a job --------------------------------------------------------------

GOOD = [{"messages": [{"role": "user", "content": f"hi {i}"},
                      {"role": "assistant", "content": f"hello {i}"}]} for i in range(8)]
BAD = {
    # a lone surrogate escape: valid JSON, not text (the tokenizer raises on it)
    "invalid_utf8": '{"messages": [{"role": "user", "content": "\\ud800"}, '
                    '{"role": "assistant", "content": "x"}]}',
    "malformed_json": "[" * 100_000 + "]" * 100_000,  # nested past json's recursion
    "malformed_json#2": '{"messages": [{"role": "user", "content": "a"}, {"role": '
                        '"assistant", "content": "b"}], "n": ' + "7" * 5000 + "}",
    # tool_calls that are not a list: the chat template raises a TypeError of its own
    "row_error": '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", '
                 '"content": "b", "tool_calls": 5}]}',
}


def _rows_file(path: Path) -> Path:
    lines = [json.dumps(r) for r in GOOD]
    for k, bad in enumerate(BAD.values()):
        lines.insert(1 + 2 * k, bad)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("num_proc", [1, 2])
def test_every_row_renders_or_is_counted_in_process_and_in_the_pool(tmp_path, num_proc):
    from transformers import AutoTokenizer

    from eagle3_extract.config import ASSETS
    from eagle3_extract.dataset.samples import build_dataset

    rows = _rows_file(tmp_path / "rows.jsonl")
    cfg = compose_cfg("dataset=local", f"dataset.path={rows}", f"dataset.num_proc={num_proc}")
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    data = build_dataset(cfg.dataset, tok, 1000)
    skipped = {k: v for k, v in data.report["skipped"].items() if v}
    assert len(data) == len(GOOD)
    assert skipped == {"invalid_utf8": 1, "malformed_json": 2, "row_error": 1}, skipped


def test_the_job_runs_through_such_rows_and_counts_them(tmp_path):
    rows = _rows_file(tmp_path / "rows.jsonl")
    out = tmp_path / "out"
    r = run_cli(*HF, "dataset=local", f"dataset.path={rows}", f"output.dir={out}")
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["written"] == len(GOOD) and m["counts"]["skipped_total"] == 4


def _huge_row(mb: int) -> dict:
    return {"messages": [{"role": "user", "content": "word " * (mb * 1024 * 1024 // 5)},
                         {"role": "assistant", "content": "ok"}]}


@pytest.mark.parametrize("overlong", ["truncate", "skip"])
def test_a_50_mb_row_is_skipped_unread_and_counted_not_an_oom(tmp_path, overlong):
    """Rendering and tokenizing one 50 MB row peaked at 12.7 GB and the job was killed;
    over dataset.max_row_bytes (default from max_length) it is skipped before it is parsed,
    counted, and every other row written. Peak RSS of the job (wait4) is measured."""
    import subprocess

    from test_job import env

    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps(r) for r in GOOD]
    lines.insert(3, json.dumps(_huge_row(50)))
    rows.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    proc = subprocess.Popen([str(BIN / "eagle3-extract"), *HF, "dataset=local",
                             f"dataset.path={rows}", f"dataset.overlong={overlong}",
                             "dataset.max_samples=null", f"output.dir={out}"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=600)
    peak_mb = __import__("resource").getrusage(
        __import__("resource").RUSAGE_CHILDREN).ru_maxrss / 1024
    assert proc.returncode == 0, stderr[-2000:]
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["written"] == len(GOOD), m["counts"]
    assert m["data"]["skipped"]["row_too_large"] == 1, m["data"]["skipped"]
    assert peak_mb < 2500, f"peak RSS {peak_mb:.0f} MB"
    print(f"peak RSS with a 50 MB row, overlong={overlong}: {peak_mb:.0f} MB")


def test_a_parsed_row_over_the_bound_is_skipped_before_it_is_rendered(tmp_path):
    """A .json file is parsed whole; its long row is still never rendered or tokenized."""
    from transformers import AutoTokenizer

    from eagle3_extract.config import ASSETS
    from eagle3_extract.dataset.samples import build_dataset

    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([*GOOD, _huge_row(2)]))
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    cfg = compose_cfg("dataset=local", f"dataset.path={rows}", "dataset.max_row_bytes=100000")
    data = build_dataset(cfg.dataset, tok, 1000)
    assert len(data) == len(GOOD) and data.report["skipped"]["row_too_large"] == 1
    assert "dataset.max_row_bytes 100000" in str(data.report["skipped_examples"])


def test_a_json_file_with_a_huge_integer_skips_that_row(tmp_path):
    from eagle3_extract.dataset.rows import Malformed, _read_json

    p = tmp_path / "rows.json"
    p.write_text("[" + json.dumps(GOOD[0]) + ", {\"n\": " + "9" * 5000 + "}]")
    rows = _read_json(p)
    assert rows[0] == GOOD[0] and isinstance(rows[1], Malformed)
    assert rows[1].reason == "malformed_json" and "5000 digits" in rows[1].error


# --- 4. a folder that is not ours -------------------------------------------------------


def test_a_folder_that_is_not_a_run_is_refused_and_untouched(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "app"
    out.mkdir()
    (out / "data").symlink_to(elsewhere)
    (out / "manifest.json").write_text('{"app": "not ours"}')
    (out / "notes.txt").write_text("mine")
    before = {p.name: (p.is_symlink(), p.lstat().st_mtime_ns) for p in out.iterdir()}
    r = run_cli(*HF, f"output.dir={out}")
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not empty and holds no eagle3-extract run" in lines[0]
    assert {p.name: (p.is_symlink(), p.lstat().st_mtime_ns) for p in out.iterdir()} == before
    assert (out / "manifest.json").read_text() == '{"app": "not ours"}'
    assert not list(elsewhere.iterdir())


# --- 5, 6, 7. permissions, logs, interpolations -----------------------------------------


def test_permission_problems_are_one_line_naming_the_path(done_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(done_run, run)
    sub = run / "data" / "00000"
    try:
        sub.chmod(0)
        st = cli("eagle3-status", str(run), no_dac=True)
        assert st.returncode == 2 and st.stderr.count("\n") == 1, st.stderr
        assert str(sub) in st.stderr and "cannot be read" in st.stderr
        va = cli("eagle3-validate", str(run), "--no-report", no_dac=True)
        assert va.returncode == 1 and "Traceback" not in va.stderr, va.stderr
        assert "data/00000: unreadable: cannot be read" in va.stdout, va.stdout
        assert "sample files missing" not in va.stdout
        sub.chmod(0o755)
        run.chmod(0)  # the whole run
        for name in ("eagle3-validate", "eagle3-status", "eagle3-export"):
            args = [str(run), str(tmp_path / "x")] if name == "eagle3-export" else [str(run)]
            r = cli(name, *args, no_dac=True)
            assert r.returncode == 2 and r.stderr.count("\n") == 1, (name, r.stderr)
            assert "Traceback" not in r.stderr and str(run) in r.stderr, (name, r.stderr)
    finally:
        run.chmod(0o755)
        sub.chmod(0o755)


def test_logs_never_fall_back_to_a_shared_directory(tmp_path):
    from eagle3_extract.config import _logdir

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    first, second = _logdir(str(blocker / "out1")), _logdir(str(blocker / "out2"))
    assert first != second
    for d in (first, second):
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert not str(d).startswith(str(blocker))
    r = run_cli(*HF, f"output.dir={blocker / 'out'}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "is not writable" in r.stderr


def test_an_unresolvable_interpolation_is_one_line_exit_2(tmp_path):
    r = run_cli(*HF, "output.dir=${oc.env:EAGLE3_NO_SUCH_VAR}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "EAGLE3_NO_SUCH_VAR" in r.stderr and "Traceback" not in r.stderr


# --- 8, 9. the merge, the tokenized set's counts ----------------------------------------


def test_a_missing_merge_is_reported_with_the_command_that_restores_it(tmp_path):
    from eagle3_extract.extract.job import run

    out = tmp_path / "out"
    common = [*HF, "shard.count=2", "output.draft_vocab_size=100", f"output.dir={out}"]
    for i in range(2):
        run(compose_cfg(*common, f"shard.index={i}"))
    assert cli("eagle3-status", str(out)).returncode == 0
    (out / "token_freq.json").unlink()
    shutil.rmtree(out / "vocab")
    st = cli("eagle3-status", str(out))
    assert st.returncode == 1 and "the merge is missing (token_freq.json, vocab/d2t.npy, " \
        "vocab/t2d.npy): rerun any one shard" in st.stdout, st.stdout
    va = cli("eagle3-validate", str(out), "--no-report")
    assert va.returncode == 1 and "merge: every shard is complete" in va.stdout, va.stdout
    run(compose_cfg(*common, "shard.index=0"))  # what the message says
    assert cli("eagle3-status", str(out)).returncode == 0
    assert cli("eagle3-validate", str(out), "--no-report").returncode == 0


def test_an_edited_count_in_the_tokenized_set_is_not_reused(tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    from eagle3_extract.config import ASSETS
    from eagle3_extract.dataset import tokenized_cache as tc
    from eagle3_extract.dataset.samples import build_dataset

    monkeypatch.setenv(tc.CACHE_ENV, str(tmp_path / "cache"))
    cfg = compose_cfg("dataset.max_samples=6")
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
    data, reused = tc.cached("k" * 24, lambda: build_dataset(cfg.dataset, tok, 1000))
    assert not reused and tc.load("k" * 24) is not None
    meta_path = tmp_path / "cache" / ("k" * 24) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["report"]["usable"] += 1000
    meta_path.write_text(json.dumps(meta))
    assert tc.load("k" * 24) is None
    assert "damaged" in caplog.text and "counts" in caplog.text


@pytest.mark.parametrize("damage", ["cut_short", "header_not_json", "tokenizer_too_big"])
def test_a_bad_checkpoint_or_tokenizer_is_one_line_before_any_engine(tmp_path, damage):
    """A model.safetensors cut short or with a header that is not JSON (vLLM: 'WorkerProc
    initialization failed'; HF: SafetensorError), or a tokenizer with ids past the model's
    vocab_size (IndexError in the first forward pass): one line, exit 2, in preflight."""
    import shutil
    import time

    from eagle3_extract.models.tiny import build_tiny_model

    model = tmp_path / "model"
    shutil.copytree(build_tiny_model("llama"), model)
    st, cfg_path = model / "model.safetensors", model / "config.json"
    if damage == "cut_short":
        st.write_bytes(st.read_bytes()[:-4096])
        text = "the header says"
    elif damage == "header_not_json":
        data = bytearray(st.read_bytes())
        data[8:24] = b"this is not JSON"
        st.write_bytes(bytes(data))
        text = "unreadable (JSONDecodeError"
    else:
        cfg = json.loads(cfg_path.read_text())
        cfg["vocab_size"] = 512  # the tokenizer has 1000
        cfg_path.write_text(json.dumps(cfg))
        text = "has 1000 tokens, the model's vocab_size is 512"
    t0 = time.monotonic()
    r = run_cli(*HF, f"model.path={model}", f"output.dir={tmp_path / 'out'}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and text in lines[0], r.stderr[-2000:]
    assert time.monotonic() - t0 < 60 and not (tmp_path / "out" / "data").exists()
