"""eagle3-validate on a real extraction (tiny Llama; the HF engine: validate reads files,
which engine wrote them is not what it checks, and the vLLM-written case is
test_verify.py's) and on copies corrupted the ways that silently ruin a drafter: each
must fail, naming the file and the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_engine
from eagle3_extract.check import validate
from eagle3_extract.layout import CHECKSUM_KEY
from eagle3_extract.types import Batch, Sample
from eagle3_extract.extract.writer import save_safetensors

OVERRIDES = ["dataset.max_samples=6", "model.max_model_len=1024", "engine.token_budget=2048",
             "engine.distributed_executor_backend=uni"]


def extract_tiny(root: Path, *overrides: str) -> dict:
    """A real `eagle3-extract` run (default engine: vLLM), in this process."""
    from eagle3_extract.extract.job import run as extract
    from eagle3_extract.config import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[*OVERRIDES, f"output.dir={root}", *overrides])
    return extract(cfg)


def load_st(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def rewrite(path: Path, edit=None, **meta: str) -> None:
    """The file as a faulty writer would have written it: its checksum matches."""
    t, m = load_st(path)
    if edit is not None:
        edit(t)
    m.pop(CHECKSUM_KEY)
    save_safetensors({k: v.clone() for k, v in t.items()}, path, metadata={**m, **meta})


def sample_file(root: Path, index: int, ext: str = ".safetensors") -> Path:
    return root / "data" / "00000" / f"{index:09d}{ext}"


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("validate") / "out"
    m = extract_tiny(root, "engine=hf")
    assert m["status"] == "complete" and m["layer_ids"] == [2, 4, 5, 8]
    return root


@pytest.fixture
def copy(clean, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(clean, dst, ignore=shutil.ignore_patterns("*_report.json"))
    return dst


def run(root: Path) -> dict:
    report = validate.validate(root)
    assert report["ok"] == (validate.main([str(root), "--no-report"]) == 0)
    return report


def codes(report: dict, where: str | None = None) -> set[str]:
    return {p["code"] for p in report["problems"] if where is None or p["where"] == where}


def rel(index: int, ext: str = ".safetensors") -> str:
    return f"data/00000/{index:09d}{ext}"


def test_clean_extraction_passes_with_norm_report(clean, capsys):
    assert validate.main([str(clean)]) == 0
    out = capsys.readouterr().out
    assert ": OK" in out and "per-token L2 norm" in out
    report = json.loads((clean / validate.REPORT_NAME).read_text())
    assert report["ok"] and report["files"] == 6 and not report["problems"]
    per_layer = report["norms"]["per_layer"]
    assert list(per_layer) == ["2", "4", "5", "8"]
    means = [v["mean_norm"] for v in per_layer.values()]
    assert means == sorted(means) and all(v["std_norm"] > 0 for v in per_layer.values())
    assert report["norms"]["increasing_files"] == 6
    assert not list(clean.rglob(".*tmp*"))  # the report was written atomically
    assert validate.main([str(clean)]) == 0  # its own report is not a stray file


def test_layer_shifted_by_one_is_flagged(copy):
    """Column of id 2 replaced by the state at id 3 (the after-layer convention)."""
    path = sample_file(copy, 0)
    t, _ = load_st(path)
    hf = make_engine("hf", [3])
    try:
        s = Sample(0, t["input_ids"].tolist(), t["loss_mask"].tolist())
        id3 = hf.extract(Batch([s])).states[0][:, 0].clone()
    finally:
        hf.close()
    rewrite(path, lambda t: t["hidden_states"][:, 0].copy_(id3))
    report = run(copy)
    assert codes(report) == {"norm_profile"}, report["problems"]
    assert list(report["bad_files"]) == [rel(0)]
    assert "layer 2 x1.2" in report["bad_files"][rel(0)][0]


def test_truncated_rows(copy):
    rewrite(sample_file(copy, 1), lambda t: t.update(hidden_states=t["hidden_states"][:-3]))
    report = run(copy)
    assert codes(report) == {"rows"} and list(report["bad_files"]) == [rel(1)]


def test_sample_truncated_consistently_breaks_the_token_counts(copy):
    def cut(t):
        for k in t:
            t[k] = t[k][:-10]

    rewrite(sample_file(copy, 2), cut)
    report = run(copy)
    assert codes(report) == {"tokens", "token_freq"}, report["problems"]


def test_nan(copy):
    rewrite(sample_file(copy, 3), lambda t: t["hidden_states"][5, 1, 7].fill_(float("nan")))
    report = run(copy)
    assert codes(report) == {"nonfinite"} and list(report["bad_files"]) == [rel(3)]


def test_swapped_pair_of_layers_in_one_file(copy):
    rewrite(sample_file(copy, 4), lambda t: t.update(hidden_states=t["hidden_states"][:,
                                                                                    [0, 2, 1, 3]]))
    report = run(copy)
    assert codes(report) == {"norm_order"} and list(report["bad_files"]) == [rel(4)]
    assert "from layer 4 to 5" in report["bad_files"][rel(4)][0]


def test_swapped_pair_of_layers_in_every_file(copy):
    for i in range(6):
        rewrite(sample_file(copy, i), lambda t: t.update(hidden_states=t["hidden_states"][
            :, [0, 1, 3, 2]]))
    report = run(copy)
    assert codes(report) == {"norm_order"}
    assert [p["where"] for p in report["problems"]] == ["dataset"]
    assert "from layer 5 to 8" in report["problems"][0]["message"]


def test_duplicated_layer(copy):
    rewrite(sample_file(copy, 5), lambda t: t["hidden_states"][:, 2].copy_(
        t["hidden_states"][:, 1]))
    report = run(copy)
    assert "layers" in codes(report, rel(5))


def test_missing_file(copy):
    sample_file(copy, 2).unlink()
    report = run(copy)
    assert codes(report) == {"count", "missing"}
    missing = [p for p in report["problems"] if p["code"] == "missing"][0]
    assert "indices [2]" in missing["message"]


def test_file_of_another_run(copy):
    rewrite(sample_file(copy, 3), run_id="0123456789abcdef")
    report = run(copy)
    assert codes(report) == {"run_id"} and list(report["bad_files"]) == [rel(3)]


def test_metadata_names_another_sample(copy):
    rewrite(sample_file(copy, 1), sample_index="4")
    assert codes(run(copy)) == {"metadata"}


def test_stray_temp_file_and_misplaced_file(copy):
    (copy / "data" / "00000" / ".000000003.safetensors.tmp-4242").write_bytes(b"partial")
    (copy / "data" / "00001").mkdir()
    sample_file(copy, 5).rename(copy / "data" / "00001" / "000000005.safetensors")
    report = run(copy)
    assert codes(report, "data/00000/.000000003.safetensors.tmp-4242") == {"stray"}
    assert codes(report, "data/00001/000000005.safetensors") == {"index"}


def test_bad_loss_mask(copy):
    rewrite(sample_file(copy, 0), lambda t: t["loss_mask"][3].fill_(2))
    rewrite(sample_file(copy, 1), lambda t: t["loss_mask"].zero_())
    report = run(copy)
    assert codes(report, rel(0)) == {"loss_mask"} and codes(report, rel(1)) == {"loss_mask"}


def test_unfinished_run_and_unreadable_file(copy):
    m = json.loads((copy / "manifest.json").read_text())
    m["status"] = "running"
    (copy / "manifest.json").write_text(json.dumps(m))
    sample_file(copy, 2).write_bytes(b"\x00" * 64)
    report = run(copy)
    assert "incomplete" in codes(report, "dataset")
    assert codes(report, rel(2)) == {"unreadable"}


def split_into_shards(root: Path, count: int = 2) -> None:
    """Rewrite a one-job run as `count` shard manifests, as data parallelism writes them."""
    from eagle3_extract.dataset.token_freq import of_tokenized as token_frequencies
    from eagle3_extract.dataset.samples import Tokenized

    m = json.loads((root / "manifest.json").read_text())
    for k in range(count):
        files = [load_st(sample_file(root, i))[0] for i in range(6) if i % count == k]
        ids = torch.cat([t["input_ids"] for t in files]).numpy()
        mask = torch.cat([t["loss_mask"] for t in files]).numpy()
        data = Tokenized(indices=np.arange(len(files)), offsets=np.zeros(len(files) + 1),
                         ids=ids, mask=mask, truncated=np.zeros(len(files), dtype=bool))
        name = f"shard-{k:05d}-of-{count:05d}"
        (root / f"token_freq.{name}.json").write_text(json.dumps(token_frequencies(data)))
        shard = {**m, "shard": {"index": k, "count": count}, "token_freq":
                 f"token_freq.{name}.json", "counts": {**m["counts"], "written": len(files)},
                 "tokens": {"total": len(ids), "loss": int(mask.sum())}}
        (root / f"manifest.{name}.json").write_text(json.dumps(shard))
    (root / "manifest.json").rename(root / "old-manifest.json.bak")
    from eagle3_extract.dataset.token_freq import merge

    shards = [json.loads((root / f"token_freq.shard-{k:05d}-of-{count:05d}.json").read_text())
              for k in range(count)]
    (root / "token_freq.json").write_text(json.dumps(merge(shards)))  # the last shard's merge


def test_sharded_run_and_a_missing_shard_manifest(copy):
    split_into_shards(copy)
    assert run(copy)["ok"]
    (copy / "manifest.shard-00001-of-00002.json").unlink()
    report = run(copy)
    assert "incomplete" in codes(report, "dataset") and "count" in codes(report, "dataset")
    assert codes(report, rel(1)) == {"index"}  # shard 1's files: no manifest owns them


def test_stale_manifest_of_an_earlier_shard_layout_is_a_warning(copy):
    m = json.loads((copy / "manifest.json").read_text())
    old = {**m, "shard": {"index": 0, "count": 4}, "updated": "2000-01-01T00:00:00+0000"}
    (copy / "manifest.shard-00000-of-00004.json").write_text(json.dumps(old))
    report = run(copy)
    assert report["ok"] and [w["code"] for w in report["warnings"]] == ["stale_manifest"]


def as_speculators_pt(root: Path) -> None:
    """Rewrite the run's files as output.format=speculators_pt (the manifest too)."""
    from eagle3_extract.extract.writer import write_sample

    m = json.loads((root / "manifest.json").read_text())
    for i in range(6):
        t, _ = load_st(sample_file(root, i))
        s = Sample(i, t["input_ids"].tolist(), t["loss_mask"].tolist())
        write_sample(sample_file(root, i, ".pt"), s, t["hidden_states"], "speculators_pt",
                     m["layer_ids"], m["run_id"])
        sample_file(root, i).unlink()
    m["config"]["output"]["format"] = m["output"]["format"] = "speculators_pt"
    (root / "manifest.json").write_text(json.dumps(m))


def test_speculators_pt_layout(copy):
    """The same data as speculators_pt: loads with weights_only; pickles and stray .pt fail."""
    as_speculators_pt(copy)
    report = run(copy)
    assert report["ok"], report["problems"]

    torch.save({"input_ids": Path("/")}, sample_file(copy, 3, ".pt"))  # needs unpickling
    torch.save({"mean": torch.zeros(3)}, copy / "stats.pt")
    report = run(copy)
    assert codes(report, rel(3, ".pt")) == {"unreadable"}
    assert "weights_only=True" in report["bad_files"][rel(3, ".pt")][0]
    assert codes(report, "stats.pt") == {"stray"}


def test_changed_bytes_fail_the_checksum_and_its_cost_is_printed(copy, capsys):
    """A byte changed after the write fails the checksum the writer recorded; a file
    without one (an older run) is a warning; the cost is in the report and printed."""
    path = sample_file(copy, 4)
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x10  # inside the last tensor: still loads, same shapes
    path.write_bytes(bytes(raw))
    report = run(copy)
    assert codes(report, rel(4)) == {"checksum"}
    assert report["checksums"]["files"] == 6 and report["checksums"]["bytes"] > 0
    assert validate.validate(copy, checksums=False)["ok"]  # only the checksum saw it
    t, meta = load_st(sample_file(copy, 1))
    meta.pop(CHECKSUM_KEY)
    save_file(t, str(sample_file(copy, 1)), metadata=meta)
    path.write_bytes(bytes(raw[:-7] + bytes([raw[-7] ^ 0x10]) + raw[-6:]))
    report = run(copy)
    assert report["ok"] and report["checksums"]["without_checksum"] == 1
    assert codes({"problems": report["warnings"]}) == {"checksum"}
    validate.main([str(copy), "--no-report"])
    assert "content checksums: 6 files" in capsys.readouterr().out


def test_speculators_pt_crc_catches_a_changed_byte(copy):
    as_speculators_pt(copy)
    assert run(copy)["ok"]
    path = sample_file(copy, 2, ".pt")
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    raw = bytearray(path.read_bytes())
    raw[info.header_offset + 30 + len(info.filename.encode()) + 64 + 8] ^= 0x01
    path.write_bytes(bytes(raw))
    report = run(copy)
    assert "checksum" in codes(report, rel(2, ".pt")), report["problems"]


def test_symlinks_in_the_output_dir_are_damage_and_resume_replaces_them(copy, tmp_path):
    """A data subdirectory and a sample file replaced by links to whole copies elsewhere:
    validate, status and export name them and read nothing through them; the resumed
    job writes nothing outside the dir and leaves real files in their place."""
    from eagle3_extract.drafter import export
    from eagle3_extract.check import status

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy2(sample_file(copy, 3), outside / "000000003.safetensors")
    sample_file(copy, 3).unlink()
    sample_file(copy, 3).symlink_to(outside / "000000003.safetensors")
    sub = copy / "data" / "00001"  # files_per_dir is larger: a second dir, as a link
    shutil.copytree(copy / "data" / "00000", outside / "dir")
    sub.symlink_to(outside / "dir", target_is_directory=True)
    before = {p.name: p.stat().st_mtime_ns for p in outside.rglob("*")}

    report = run(copy)
    assert codes(report, rel(3)) == {"symlink"} and codes(report, "data/00001") == {"symlink"}
    assert "elsewhere" in report["bad_files"][rel(3)][0]
    s = status.collect(copy)
    assert not s["complete"] and s["totals"]["links"] == [rel(3), "data/00001"]
    with pytest.raises(export.ExportError, match="symbolic links"):
        export.export(copy, tmp_path / "export")

    m = extract_tiny(copy, "engine=hf")
    assert m["status"] == "complete" and m["counts"]["redone_damaged"] == 1
    assert not sample_file(copy, 3).is_symlink() and sample_file(copy, 3).is_file()
    assert not sub.exists() and not sub.is_symlink()
    assert {p.name: p.stat().st_mtime_ns for p in outside.rglob("*")} == before
    assert run(copy)["ok"]


def test_not_a_directory_or_no_manifest(tmp_path):
    assert validate.main([str(tmp_path / "nope"), "--no-report"]) == 1
    report = validate.validate(tmp_path)
    assert not report["ok"] and codes(report) == {"manifest"}


def test_validate_and_status_name_the_same_run_after_a_rerun_with_another_layout(copy):
    """An earlier complete 1-shard run, then a rerun with shard.count=2 that finished only
    shard 0: both commands take the layout written last (manifest.RunManifests), so the
    dir is not complete for either, and validate names the shard that would finish it."""
    from eagle3_extract.check.status import collect

    m = json.loads((copy / "manifest.json").read_text())
    assert collect(copy)["complete"]
    newer = {**m, "shard": {"index": 0, "count": 2}, "updated": "2099-01-01T00:00:00+0000"}
    (copy / "manifest.shard-00000-of-00002.json").write_text(json.dumps(newer))
    status = collect(copy)
    assert not status["complete"]
    assert [(p["count"], p["current"], p["complete"]) for p in status["partitions"]] == [
        (1, False, True), (2, True, False)]
    assert status["totals"]["shards"] == 2 and status["totals"]["missing"] == 1
    report = run(copy)
    assert not report["ok"] and "mixed_layouts" in codes(report, "dataset")
    assert "shard.count=2 shard.index=<each of [1]>" in str(report["problems"])
