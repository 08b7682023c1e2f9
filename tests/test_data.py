"""dataset/ (messages, render, samples): rows -> tokenized samples, loss masks, skip reasons, seeded identity.

All with the committed tokenizer and its real chat template (no engine needed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from eagle3_extract.config import ASSETS, PreflightError
from eagle3_extract.dataset.rows import read_rows
from eagle3_extract.dataset.messages import SKIP_REASONS, to_messages
from eagle3_extract.dataset.render import Renderer
from eagle3_extract.dataset.samples import build_dataset, seeded_order, tokenize_rows

SAMPLE = ASSETS / "sample" / "conversations.jsonl"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))


def ds_cfg(path, **kw):
    base = dict(name="t", path=str(path), split="train", hub_config=None, data_files=None,
                format="auto", max_samples=None, seed=0, shuffle=True, max_length=None,
                overlong="truncate")
    base.update(kw)
    return OmegaConf.create(base)


def masked_runs(tok, ids, mask):
    """The decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_hand_checked_conversation_mask(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Say bye"},
        {"role": "assistant", "content": "Bye."},
    ]
    ids, mask = Renderer(tok).tokenize(msgs)
    text = tok.decode(ids)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello! How can I help?<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSay bye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>"
    )
    # Exactly the assistant contents and their end-of-turn token; no header, no user text.
    assert masked_runs(tok, ids, mask) == ["Hello! How can I help?<|eot_id|>", "Bye.<|eot_id|>"]
    # And by position: the masked tokens are a contiguous range ending at each <|eot_id|>.
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    eots = [i for i, t in enumerate(ids) if t == eot]
    assert mask[eots[2]] == 1 and mask[eots[4]] == 1
    assert mask[eots[0]] == mask[eots[1]] == mask[eots[3]] == 0
    hello = tok("Hello! How can I help?", add_special_tokens=False)["input_ids"]
    start = eots[2] - len(hello)
    assert ids[start:eots[2]] == hello
    assert mask[start - 1] == 0 and all(mask[start:eots[2] + 1])


def test_mask_equals_template_generation_tags_on_sample(tok):
    """An independent oracle: the committed template marks assistant spans with
    {% generation %}, which transformers turns into `assistant_masks`."""
    rows = read_rows(ds_cfg(SAMPLE))
    r = Renderer(tok)
    assert len(rows) >= 30
    for row in rows:
        msgs = to_messages(row)
        ids, mask = r.tokenize(msgs)
        ref = tok.apply_chat_template(msgs, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        assert ids == ref["input_ids"]
        assert mask == ref["assistant_masks"]


def test_slow_tokenizer_path_gives_the_same_mask(tok):
    rows = read_rows(ds_cfg(SAMPLE))[:5]
    fast, slow = Renderer(tok), Renderer(tok)
    slow.fast = False  # the prefix-tokenization path used for tokenizers without offsets
    for row in rows:
        msgs = to_messages(row)
        assert fast.tokenize(msgs) == slow.tokenize(msgs)


QWEN_LIKE = (
    # Renders the last assistant turn differently from earlier ones (as Qwen3 does with
    # its think block) and adds a newline after every turn.
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{% if m['role'] == 'assistant' and loop.last %}[final] {% endif %}"
    "{{ m['content'] }}<|eot_id|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_mask_with_template_that_rewrites_earlier_turns(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = QWEN_LIKE
    msgs = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "second answer"},
    ]
    ids, mask = Renderer(t).tokenize(msgs)
    # middle turn: content + end token (fallback path); last: everything the model would
    # generate after the prompt, without the template's trailing newline.
    assert masked_runs(t, ids, mask) == ["first answer<|eot_id|>",
                                         "[final] second answer<|eot_id|>"]


def test_sharegpt_and_openai_rows_are_equivalent(tok):
    share = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"},
                               {"from": "gpt", "value": "a"}, {"from": "user", "value": "q2"},
                               {"from": "chatgpt", "value": "a2"}]}
    openai = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"},
                           {"role": "user", "content": "q2"},
                           {"role": "assistant", "content": [{"type": "text", "text": "a2"}]}]}
    assert to_messages(share) == to_messages(openai)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "hello"}]})
BAD_ROWS = {
    "malformed_json": '{"messages": [ {"role": "user", ',
    "bad_row": json.dumps({"text": "no conversation here"}),
    "empty_conversation": json.dumps({"messages": []}),
    "unknown_role": json.dumps({"conversations": [{"from": "robot", "value": "x"},
                                                  {"from": "gpt", "value": "y"}]}),
    "bad_content": json.dumps({"messages": [{"role": "user", "content": {"x": 1}},
                                            {"role": "assistant", "content": "y"}]}),
    "no_assistant_turn": json.dumps({"messages": [{"role": "user", "content": "only me"}]}),
}


def test_each_bad_row_kind_is_skipped_and_counted(tok, tmp_path):
    lines = [GOOD]
    for line in BAD_ROWS.values():
        lines += [line, GOOD]
    path = write_lines(tmp_path / "rows.jsonl", lines)
    data = build_dataset(ds_cfg(path, shuffle=False), tok, 2047)
    rep = data.report
    assert rep["rows"] == len(lines)
    for reason in BAD_ROWS:
        assert rep["skipped"][reason] == 1, reason
    assert set(rep["skipped"]) == set(SKIP_REASONS)
    assert rep["skipped_total"] == len(BAD_ROWS) == len(lines) - len(data)
    # identities: bad rows keep their place in the order (unshuffled: index == line)
    assert data.indices.tolist() == [i for i, ln in enumerate(lines) if ln == GOOD]
    assert {e["reason"] for e in rep["skipped_examples"]} == set(BAD_ROWS)


def test_template_error_is_skipped_and_counted(tok, tmp_path):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                       "{{ raise_exception('no system prompts') }}{% endif %}"
                       "{{ m['content'] }}{% endfor %}")
    sys_row = json.dumps({"messages": [{"role": "system", "content": "s"},
                                       {"role": "user", "content": "u"},
                                       {"role": "assistant", "content": "a"}]})
    path = write_lines(tmp_path / "rows.jsonl", [GOOD, sys_row])
    data = build_dataset(ds_cfg(path, shuffle=False), t, 2047)
    assert data.report["skipped"]["template_error"] == 1 and len(data) == 1


def test_overlong_truncate_and_skip(tok):
    full = build_dataset(ds_cfg(SAMPLE), tok, 2047)
    cut = 300
    n_long = int((full.lengths > cut).sum())
    assert 0 < n_long < len(full)
    tr = build_dataset(ds_cfg(SAMPLE, overlong="truncate"), tok, cut)
    assert len(tr) + tr.report["skipped"]["no_loss_tokens"] == len(full)
    assert tr.lengths.max() == cut
    assert tr.report["truncated"] == int(tr.truncated.sum()) > 0
    for j in range(len(tr)):  # a truncated sample is the prefix of the full one
        s = tr.sample(j)
        f = full.sample(int(np.flatnonzero(full.indices == s.index)[0]))
        assert s.input_ids == f.input_ids[:cut] and s.loss_mask == f.loss_mask[:cut]
        assert s.truncated == (len(f) > cut)
    sk = build_dataset(ds_cfg(SAMPLE, overlong="skip"), tok, cut)
    assert sk.report["skipped"]["overlong"] == n_long
    assert len(sk) == len(full) - n_long and not sk.truncated.any()


def test_truncation_that_leaves_no_assistant_token_is_counted(tok, tmp_path):
    row = json.dumps({"messages": [{"role": "user", "content": "x" * 400},
                                   {"role": "assistant", "content": "y"}]})
    path = write_lines(tmp_path / "rows.jsonl", [GOOD, row])
    data = build_dataset(ds_cfg(path, shuffle=False), tok, 100)
    assert data.report["skipped"]["no_loss_tokens"] == 1 and data.indices.tolist() == [0]


def test_seeded_order_identity(tok):
    a = seeded_order(100, 7, True, None)
    assert a == seeded_order(100, 7, True, None) and sorted(a) == list(range(100))
    assert a != seeded_order(100, 8, True, None)
    assert seeded_order(100, 7, True, 10) == a[:10]  # max_samples after shuffling
    assert seeded_order(5, 7, False, None) == list(range(5))
    rows = read_rows(ds_cfg(SAMPLE))
    r = Renderer(tok)
    small = tokenize_rows(rows, seeded_order(len(rows), 3, True, 8), r, 2047, "truncate")
    big = tokenize_rows(rows, seeded_order(len(rows), 3, True, None), r, 2047, "truncate")
    assert small.indices.tolist() == list(range(8))
    for j in range(8):  # same index -> same sample, whatever max_samples is
        assert small.sample(j) == big.sample(j)


def test_parallel_tokenization_equals_serial(tok, tmp_path):
    lines = [json.dumps(r) for r in read_rows(ds_cfg(SAMPLE))]
    lines[3:3] = list(BAD_ROWS.values())  # skips land in several workers' spans
    path = write_lines(tmp_path / "rows.jsonl", lines)
    rows = read_rows(ds_cfg(path))
    order = seeded_order(len(rows), 5, True, None)
    r = Renderer(tok)
    one = tokenize_rows(rows, order, r, 300, "truncate", num_proc=1)
    two = tokenize_rows(rows, order, r, 300, "truncate", num_proc=2)
    for k in ("indices", "offsets", "ids", "mask", "truncated"):
        assert np.array_equal(getattr(one, k), getattr(two, k)), k
    assert one.report == two.report and one.report["skipped_total"] == len(BAD_ROWS)


def test_parallel_tokenization_forks_before_what_starts_beside_it(tok, caplog):
    """on_workers (where the job starts the engine's thread) runs once the workers exist,
    before any row is tokenized; a fork beside a live thread is named (on the H200, 16
    workers forked while vLLM started hung the job: a copied lock held forever)."""
    import multiprocessing
    import threading

    rows = read_rows(ds_cfg(SAMPLE))
    order = seeded_order(len(rows), 5, True, None)
    seen = []
    with caplog.at_level("WARNING", logger="eagle3_extract.dataset.samples"):
        two = tokenize_rows(rows, order, Renderer(tok), 300, "truncate", num_proc=2,
                            on_workers=lambda: seen.append(len(multiprocessing.active_children())))
        one = tokenize_rows(rows, order, Renderer(tok), 300, "truncate",
                            on_workers=lambda: seen.append(-1))
    assert seen == [2, -1] and two.report == one.report
    # (conftest's /dev/shm notes thread runs beside every test: not the code's own)
    assert "beside running threads" not in caplog.text.replace(
        "beside running threads ['tests-shm-notes']", "")
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="engine-start")
    other.start()
    try:
        with caplog.at_level("WARNING", logger="eagle3_extract.dataset.samples"):
            tokenize_rows(rows, order, Renderer(tok), 300, "truncate", num_proc=2)
    finally:
        stop.set()
        other.join()
    assert "'engine-start']" in caplog.text


def test_parallel_tokenization_under_the_jobs_sigterm_handler_is_quiet(tok, tmp_path, capfd):
    """The job raises Interrupted on SIGTERM; the pool's workers must not inherit that (a
    finished pool printed `Interrupted: 15` tracebacks), and a pool leaves no semaphore."""
    import signal

    from eagle3_extract.errors import raise_interrupted

    shm_before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    rows = read_rows(ds_cfg(SAMPLE))
    order = seeded_order(len(rows), 5, True, None)
    old = signal.signal(signal.SIGTERM, raise_interrupted)
    try:
        two = tokenize_rows(rows, order, Renderer(tok), 300, "truncate", num_proc=2)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert two.report["usable"] > 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Interrupted" not in err, err
    if os.path.isdir("/dev/shm"):  # new and mapped by no process (other lanes' are live)
        import time

        from eagle3_extract import shm_watch

        def leaked() -> list[str]:
            used = shm_watch.in_use()
            return sorted(p for i, paths in shm_watch.entries().items() if i not in used
                          for p in paths if os.path.basename(p) not in shm_before)

        deadline = time.monotonic() + 5  # another lane's may be between unmap and unlink
        while leaked() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not leaked()


def test_json_and_parquet_files(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = read_rows(ds_cfg(SAMPLE))[:6]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ref = build_dataset(ds_cfg(SAMPLE, max_samples=None, shuffle=False), tok, 2047)
    for name in ("d.json", "d.parquet"):
        d = build_dataset(ds_cfg(tmp_path / name, shuffle=False), tok, 2047)
        assert len(d) == 6
        assert [d.sample(j) for j in range(6)] == [ref.sample(j) for j in range(6)]


def test_datasets_loader_path(tok, tmp_path, monkeypatch):
    """format=hub goes through `datasets.load_dataset` (here on a local dataset dir, the
    same call a hub id takes; the hub itself is not reachable from the tests)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rows = read_rows(ds_cfg(SAMPLE))[:5]
    (tmp_path / "repo" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "repo" / "data" / "train-0.parquet")
    got = read_rows(ds_cfg(tmp_path / "repo", format="hub", split="train"))
    assert list(got) == rows


def test_unreadable_datasets_raise_preflight_errors(tok, tmp_path):
    with pytest.raises(PreflightError, match="dataset.path=.*no such file"):
        read_rows(ds_cfg(tmp_path / "missing.jsonl"))
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(PreflightError, match="dataset.path=.*not valid JSON"):
        read_rows(ds_cfg(tmp_path / "broken.json"))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PreflightError, match="has no rows"):
        build_dataset(ds_cfg(tmp_path / "empty.jsonl"), tok, 2047)
    write_lines(tmp_path / "junk.jsonl", [BAD_ROWS["bad_row"], BAD_ROWS["malformed_json"]])
    with pytest.raises(PreflightError, match="none of 2 rows is usable"):
        build_dataset(ds_cfg(tmp_path / "junk.jsonl"), tok, 2047)


def test_tokenizer_without_chat_template_is_refused(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = None
    with pytest.raises(PreflightError, match="no chat template.*model.tokenizer"):
        Renderer(t)


def test_sample_dataset_shape(tok):
    """The committed sample: >= 30 multi-turn conversations, one format, varied lengths,
    a system prompt shared by several."""
    rows = read_rows(ds_cfg(SAMPLE))
    assert len(rows) >= 30 and all(set(r) == {"messages"} for r in rows)
    systems = [r["messages"][0]["content"] for r in rows if r["messages"][0]["role"] == "system"]
    assert max(systems.count(s) for s in set(systems)) >= 5
    assert sum(len(r["messages"]) >= 4 for r in rows) >= 20
    d = build_dataset(ds_cfg(SAMPLE), tok, 2047)
    assert d.lengths.min() < 100 and d.lengths.max() > 800 and len(d) == len(rows)


def test_a_hub_name_without_network_fails_in_seconds(tmp_path, monkeypatch):
    """No offline mode, the hub's endpoint a closed port: one PreflightError naming the
    fixes, from the probe (seconds), not after the libraries' half minute of retries;
    with offline mode, at once."""
    import time

    from eagle3_extract import hub

    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE",
                "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub, "_reachable", {})
    t0 = time.monotonic()
    with pytest.raises(PreflightError, match=r"dataset\.path='org/chats' is a Hugging Face "
                       r"hub name, the hub \(127\.0\.0\.1:9\) cannot be reached.*local path"):
        read_rows(ds_cfg("org/chats", format="hub"))
    assert time.monotonic() - t0 < hub.PROBE_S + 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PreflightError, match="HF_HUB_OFFLINE is set.*HF cache"):
        read_rows(ds_cfg("org/chats", format="hub"))


def test_a_path_that_is_not_a_regular_file_is_refused_as_what_it_is(tmp_path):
    import os

    os.mkfifo(tmp_path / "rows.jsonl")
    with pytest.raises(PreflightError, match=r"is a named pipe \(FIFO\), not a regular file"):
        read_rows(ds_cfg(tmp_path / "rows.jsonl"))
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(PreflightError, match="is a directory, not a regular file"):
        read_rows(ds_cfg(tmp_path / "dir.jsonl"))
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    with pytest.raises(PreflightError, match="no such file .a symbolic link to nothing"):
        read_rows(ds_cfg(tmp_path / "dangling.jsonl"))


def test_a_shard_tokenizes_only_its_own_rows_and_the_shards_add_up(tok, tmp_path):
    """Shard i of n renders and tokenizes only the rows of its sample indices; the shards
    are disjoint and complete, their skip counts by reason (and every other count) add
    up to the whole dataset's; the launcher's set cut into shards gives the same."""
    lines = [json.dumps(r) for r in read_rows(ds_cfg(SAMPLE))]
    lines[3:3] = list(BAD_ROWS.values())
    rows = read_rows(ds_cfg(write_lines(tmp_path / "rows.jsonl", lines)))
    order = seeded_order(len(rows), 5, True, None)

    class Counting(Renderer):
        calls = 0

        def tokenize_with_notes(self, *a, **k):
            Counting.calls += 1
            return super().tokenize_with_notes(*a, **k)

    whole = tokenize_rows(rows, order, Renderer(tok), 300, "truncate")
    n = 3
    shards = []
    for i in range(n):
        Counting.calls = 0
        part = tokenize_rows(rows, order, Counting(tok), 300, "truncate", shard=(i, n))
        assert Counting.calls <= len(range(i, len(order), n))  # its rows, none of the others'
        assert set(part.indices.tolist()) | set(part.skip_index.tolist()) == set(
            range(i, len(order), n))
        cut = whole.shard(i, n)  # the launcher's path: one tokenization, cut per replica
        for k in ("indices", "offsets", "ids", "mask", "truncated", "flags", "skip_index"):
            assert np.array_equal(getattr(part, k), getattr(cut, k)), k
        assert part.report == cut.report and part.report["shard"] == {"index": i, "count": n}
        shards.append(part.report)
    assert sorted(np.concatenate([whole.shard(i, n).indices for i in range(n)])) == sorted(
        whole.indices)
    for key in ("usable", "skipped_total", "truncated", "tokens", "loss_tokens",
                "special_token_text"):
        assert sum(r[key] for r in shards) == whole.report[key], key
    for reason, count in whole.report["skipped"].items():
        assert sum(r["skipped"][reason] for r in shards) == count, reason
    assert whole.report["skipped_total"] == len(BAD_ROWS)
    assert all(r["rows"] == len(rows) and r["selected"] == len(order) for r in shards)


def test_the_launchers_set_keeps_its_records_on_disk(tok, tmp_path):
    rows = list(read_rows(ds_cfg(SAMPLE))) + [{"messages": []}]
    order = seeded_order(len(rows), 0, False, None)
    whole = tokenize_rows(rows, order, Renderer(tok), 300, "truncate")
    whole.save(tmp_path / "set", {"ident": {}})
    from eagle3_extract.dataset.samples import Tokenized

    back, _ = Tokenized.load(tmp_path / "set")
    assert back.shard(1, 2).report == whole.shard(1, 2).report
    assert back.report["skipped"]["empty_conversation"] == 1


def test_a_shard_reads_the_headers_of_its_own_files_only(tmp_path, monkeypatch):
    from eagle3_extract import layout

    d = tmp_path / "data" / "00000"
    d.mkdir(parents=True)
    for i in range(6):
        (d / f"{i:09d}.safetensors").write_bytes(b"not whole")
    (d / "000000007.safetensors").symlink_to(d / "000000001.safetensors")
    read = []
    real = layout.file_problem
    monkeypatch.setattr(layout, "file_problem", lambda p, *a: read.append(p) or real(p, *a))
    good, bad = layout.verified_files(tmp_path, "safetensors", owned=lambda i: i % 2 == 1)
    assert sorted(bad) == [1, 3, 5, 7] and not good and "symbolic link" in bad[7]
    assert sorted(Path(p).name for p in read) == [f"{i:09d}.safetensors" for i in (1, 3, 5)]


KILL_A_WORKER = r"""
import json, os, signal, sys, threading, time, multiprocessing
from transformers import AutoTokenizer
from eagle3_extract.config import ASSETS
from eagle3_extract.dataset.rows import read_rows
from eagle3_extract.dataset.render import Renderer
from eagle3_extract.dataset.samples import seeded_order, tokenize_rows
from eagle3_extract.errors import JobError
from omegaconf import OmegaConf
path = sys.argv[1]
rows = read_rows(OmegaConf.create(dict(
    name="t", path=path, split="train", hub_config=None, data_files=None, format="auto",
    max_samples=None, seed=0, shuffle=True, max_length=None, overlong="truncate")))
order = seeded_order(len(rows), 5, True, None)
tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))
def kill_one():
    def later():
        time.sleep(1.0)  # mid-span: each worker is tokenizing its first span
        os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
    threading.Thread(target=later, daemon=True).start()
try:
    tokenize_rows(rows, order, Renderer(tok), 300, "truncate", num_proc=2, on_workers=kill_one)
except JobError as e:
    print("JobError:", e)
    sys.exit(3)
print("finished")
"""


def test_a_tokenizer_worker_killed_mid_span_ends_the_job_in_seconds(tmp_path):
    """A worker the OOM killer (or anyone) SIGKILLs: one line and an exit, not a hang."""
    import subprocess
    import sys
    import time

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    path = write_lines(tmp_path / "many.jsonl", [json.dumps(rows[i % len(rows)])
                                                 for i in range(40_000)])
    t0 = time.monotonic()
    try:
        r = subprocess.run([sys.executable, "-c", KILL_A_WORKER, str(path)],
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung on its killed tokenizer worker")
    out = r.stdout.strip().splitlines()
    assert r.returncode == 3 and out and "killed by SIGKILL" in out[-1], (r.stdout, r.stderr)
    assert "dataset.num_proc=1" in out[-1] and time.monotonic() - t0 < 120
