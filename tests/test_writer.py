"""writer.py: file layout and contents, invariants, release discipline, errors, temps."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from safetensors import safe_open

from eagle3_extract.types import ExtractedBatch, Sample
from eagle3_extract.layout import clean_stale_temps, finished_indices, sample_path
from eagle3_extract.extract.writer import Writer, WriterError

L, H = 3, 16
LAYERS = [2, 4, 7]


def batch(indices, lengths, dtype=torch.bfloat16, seed=0, shared=True):
    """Samples and states like an engine returns them: views into one host buffer."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    buf = torch.randn(total, L, H, generator=g).to(dtype)
    samples, states, off = [], [], 0
    for i, n in zip(indices, lengths):
        ids = torch.randint(0, 1000, (n,), generator=g).tolist()
        mask = [int(k >= n // 2) for k in range(n)]
        samples.append(Sample(i, ids, mask, truncated=(i % 2 == 1)))
        states.append(buf[off:off + n] if shared else buf[off:off + n].clone())
        off += n
    return samples, states


class Releases:
    def __init__(self):
        self.calls = []
        self.lock = threading.Lock()

    def make(self, tag, root=None, files=()):
        def release():
            with self.lock:
                # at release time every file of the batch must already exist
                present = [p.exists() for p in files]
                self.calls.append((tag, all(present)))
        return release


def make_writer(root, fmt="safetensors", **kw):
    base = dict(files_per_dir=4, layer_ids=LAYERS, hidden_size=H, dtype=torch.bfloat16,
                run_id="abc123", threads=2, max_pending=2)
    base.update(kw)
    return Writer(root, fmt, **base)


def test_safetensors_layout_contents_and_release_once(tmp_path):
    rel = Releases()
    w = make_writer(tmp_path)
    expected = {}
    for b, (idx, lens) in enumerate([([0, 5, 9], [7, 3, 11]), ([4, 1], [2, 8])]):
        samples, states = batch(idx, lens, seed=b)
        paths = [sample_path(tmp_path, i, 4, "safetensors") for i in idx]
        w.submit(ExtractedBatch(samples, states, release=rel.make(b, files=paths)))
        expected.update({s.index: (s, st.clone()) for s, st in zip(samples, states)})
    w.close()
    assert sorted(rel.calls) == [(0, True), (1, True)]  # once per batch, after its files
    assert finished_indices(tmp_path, "safetensors") == set(expected)
    assert (tmp_path / "data" / "00002" / "000000009.safetensors").is_file()  # 9 // 4 = 2
    for i, (s, st) in expected.items():
        with safe_open(sample_path(tmp_path, i, 4, "safetensors"), "pt") as f:
            meta = f.metadata()
            assert meta["sample_index"] == str(i) and meta["run_id"] == "abc123"
            assert json.loads(meta["layer_ids"]) == LAYERS
            assert json.loads(meta["truncated"]) == s.truncated
            ids, mask, hs = (f.get_tensor(k) for k in ("input_ids", "loss_mask", "hidden_states"))
        assert ids.dtype == torch.int64 and ids.tolist() == s.input_ids
        assert mask.dtype == torch.uint8 and mask.tolist() == s.loss_mask
        assert hs.dtype == torch.bfloat16 and torch.equal(hs, st)
    assert w.written == 5 and w.tokens == 31
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".")]


def test_speculators_pt_loads_with_speculators_dataset(tmp_path):
    from speculators.train.data import Eagle3SampleFileDataset

    w = make_writer(tmp_path, fmt="speculators_pt")
    samples, states = batch([3, 8, 2], [6, 9, 4])
    w.submit(ExtractedBatch(samples, states))
    w.close()
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert [p.name for p in files] == ["000000002.pt", "000000003.pt", "000000008.pt"]
    raw = torch.load(files[2], weights_only=True)
    assert set(raw) == {"input_ids", "loss_mask", "hidden_states"}
    assert len(raw["hidden_states"]) == L
    for j in range(L):  # a clone per layer, not a view of the whole shared buffer
        assert torch.equal(raw["hidden_states"][j], states[1][:, j, :])
        assert raw["hidden_states"][j].untyped_storage().nbytes() == 9 * H * 2
    ds = Eagle3SampleFileDataset(max_len=64, datapath=str(tmp_path))
    assert len(ds) == 3
    by_len = {len(s): (s, st) for s, st in zip(samples, states)}
    for k in range(3):
        item = ds[k]
        n = int(item["lengths"][0]) + 1  # the dataset shifts by one token
        s, st = by_len[n]
        assert item["input_ids"].tolist() == s.input_ids[1:]
        assert item["loss_mask"].tolist() == s.loss_mask[1:]
        # aux layers concatenated, the last layer is the verifier's
        want = torch.cat([st[:, j, :] for j in range(L - 1)], dim=-1)[:-1].float()
        assert torch.equal(item["hidden_states"], want)
        assert torch.equal(item["verifier_last_hidden_states"], st[1:, L - 1, :].float())


@pytest.mark.parametrize("bad", ["shape", "nan", "inf", "dtype"])
def test_invariant_violations_stop_the_job(tmp_path, bad):
    rel = Releases()
    w = make_writer(tmp_path)
    samples, states = batch([0, 1], [5, 6], shared=False)
    if bad == "shape":
        states[1] = states[1][:-1]
    elif bad == "nan":
        states[1][2, 1, 3] = float("nan")
    elif bad == "inf":
        states[1][0, 0, 0] = float("inf")
    else:
        states[1] = states[1].float()
    w.submit(ExtractedBatch(samples, states, release=rel.make(0)))
    with pytest.raises(WriterError, match="sample 1"):
        w.close()
    assert len(rel.calls) == 1  # released even when a write failed (the engine must not hang)
    assert 1 not in finished_indices(tmp_path, "safetensors")


def test_writer_error_surfaces_in_submit(tmp_path):
    w = make_writer(tmp_path, max_pending=1, threads=1)
    samples, states = batch([0], [5], shared=False)
    states[0][0, 0, 0] = float("nan")
    w.submit(ExtractedBatch(samples, states))
    deadline = time.time() + 10
    with pytest.raises(WriterError, match="NaN or Inf"):
        while time.time() < deadline:  # the next submit raises once the thread has failed
            s2, st2 = batch([1], [5])
            w.submit(ExtractedBatch(s2, st2))
            time.sleep(0.05)
    with pytest.raises(WriterError):
        w.close()


def test_submit_blocks_while_max_pending_batches_are_unwritten(tmp_path):
    gate = threading.Event()
    w = make_writer(tmp_path, max_pending=2, threads=1,
                    on_sample=lambda s, n: gate.wait(timeout=30))
    for b in range(2):
        s, st = batch([b], [4])
        w.submit(ExtractedBatch(s, st))
    s, st = batch([2], [4])
    t = threading.Thread(target=w.submit, args=(ExtractedBatch(s, st),))
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive()  # third batch waits for a free slot
    gate.set()
    t.join(timeout=10)
    assert not t.is_alive()
    w.close()
    assert finished_indices(tmp_path, "safetensors") == {0, 1, 2}


def test_clean_stale_temps_only_for_owned_indices(tmp_path):
    d = tmp_path / "data" / "00000"
    d.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file({"input_ids": torch.zeros(3, dtype=torch.int64)}, str(d / "000000001.safetensors"))
    for i in (2, 3):
        (d / f".00000000{i}.safetensors.tmp-{os.getpid() + i}").write_bytes(b"partial")
    (d / ".000000005.pt.tmp-77").write_bytes(b"partial")
    removed = clean_stale_temps(tmp_path, owned=lambda i: i % 2 == 1)
    assert removed == 2
    assert sorted(p.name for p in d.iterdir()) == [".000000002.safetensors.tmp-%d"
                                                   % (os.getpid() + 2), "000000001.safetensors"]
    assert finished_indices(tmp_path, "safetensors") == {1}


def test_one_temp_rule_unique_per_writer_and_recognized_by_the_scans(tmp_path):
    """Every atomic write takes its temp from layout.temp_path: two writers with the same
    pid (pods of a Kubernetes Job all run as pid 1) never share one, and the scans that
    clean or report temps recognize the names (old pid-only ones too)."""
    from eagle3_extract.layout import (SAMPLE_TEMP, atomic_write, remove_temps, sample_temp,
                                       temp_path)

    final = sample_path(tmp_path, 7, 10000, "safetensors")
    names = {sample_temp(final).name for _ in range(100)}
    assert len(names) == 100 and all(SAMPLE_TEMP.match(n) for n in names)
    assert SAMPLE_TEMP.match(".000000007.safetensors.tmp-4242")  # written by older versions
    final.parent.mkdir(parents=True)
    sample_temp(final).write_bytes(b"partial")
    assert clean_stale_temps(tmp_path) == 1 and not list(final.parent.iterdir())

    target = tmp_path / "d2t.npy"
    with pytest.raises(RuntimeError):
        with atomic_write(target) as f:
            f.write(b"half")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == [tmp_path / "data"]  # neither the file nor a temp
    with atomic_write(target) as f:
        f.write(b"whole")
    assert target.read_bytes() == b"whole"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    (temp_path(tmp_path / "export") / "hs").mkdir(parents=True)  # a killed export's dir
    temp_path(tmp_path / "export").write_bytes(b"x")
    assert remove_temps(tmp_path / "export") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d2t.npy", "data"]
