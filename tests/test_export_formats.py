"""eagle3-export's trainer layouts on the tiny model (HF engine): what each file holds, the
final norm applied from the checkpoint, and a killed export that resumes.

The trainers' own loaders read these layouts in tests/test_exports.py (engine lane, the
real SmolLM2 and each trainer's environment)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_job import compose_cfg

from eagle3_extract.check.run_dir import load_sample
from eagle3_extract.drafter import export as export_mod
from eagle3_extract.drafter import export_formats
from eagle3_extract.layout import sample_files


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from eagle3_extract.extract.job import run

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = tmp_path_factory.mktemp("formats") / "run"
    m = run(compose_cfg("engine=hf", "dataset.max_samples=6", f"output.dir={out}"))
    assert len(m["layer_ids"]) == 4  # three aux layers and id N, what SpecForge takes
    return out, m


def _rows(out, suffix):
    return sorted(out.rglob(f"*{suffix}"))


@pytest.mark.parametrize("fmt", ["specforge", "modelopt"])
def test_post_norm_layouts_hold_our_rows_and_the_models_final_norm(run_dir, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    src, m = run_dir
    rec = export_mod.export(src, tmp_path / fmt, fmt)
    assert rec["rows"] == 6 and rec["trainer_aux_layer_ids"] == [k - 1 for k in m["layer_ids"][:-1]]
    files = _rows(tmp_path / fmt, export_formats.SUFFIX[fmt])
    assert len(files) == 6 and set(rec["files"]) == {
        str(f.relative_to(tmp_path / fmt)) for f in files}
    model = AutoModelForCausalLM.from_pretrained(rec["model"]["path"], dtype=torch.float32)
    for (index, e), f in zip(sorted(sample_files(src, "safetensors").items()), files):
        ours, _ = load_sample(e.path, "safetensors")
        got = torch.load(f, weights_only=True)
        hs = ours["hidden_states"]
        aux = got["aux_hidden_state"][0] if fmt == "specforge" else got["aux_hidden_states"]
        final = got["hidden_state"][0] if fmt == "specforge" else got["hidden_states"]
        assert torch.equal(got["input_ids"], ours["input_ids"].long())
        assert torch.equal(got["loss_mask"], ours["loss_mask"].long())
        assert torch.equal(aux, hs[:, :-1].reshape(len(hs), -1))  # aux layers side by side
        with torch.no_grad():
            want = model.model.norm(hs[:, -1].float())  # transformers' own final norm
        assert final.dtype == hs.dtype
        assert ((final.float() - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.01
        assert f.name == f"{index:09d}{export_formats.SUFFIX[fmt]}"


def test_a_killed_export_resumes_and_redoes_what_it_cannot_trust(run_dir, tmp_path,
                                                                 monkeypatch):
    src, _ = run_dir
    out = tmp_path / "sf"
    real, calls = export_formats.save_torch, []

    def dies_on_the_fourth(obj, path):
        calls.append(path)
        if len(calls) == 4:
            raise KeyboardInterrupt  # the kill, mid-export
        return real(obj, path)

    monkeypatch.setattr(export_formats, "save_torch", dies_on_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        export_mod.export(src, out, "specforge")
    monkeypatch.setattr(export_formats, "save_torch", real)
    part = export_mod.partial_dir(out)
    assert not out.exists() and part.is_dir()  # nothing that looks like a finished export
    kept = _rows(part, ".ckpt")
    assert len(kept) == 3 and not list(part.rglob(".*tmp*"))
    kept[1].write_bytes(kept[1].read_bytes()[:-7] + b"garbage")  # damage one kept row
    with pytest.raises(export_mod.ExportError, match="another source, format"):
        export_mod.export(src, out, "modelopt")  # the partial export is another format's
    rec = export_mod.export(src, out, "specforge")
    assert rec["rows"] == 6 and rec["resumed_rows"] == 2  # the damaged one was redone
    assert not part.exists() and not (out / export_mod.JOURNAL).exists()
    from eagle3_extract.manifest import file_sha256

    for rel, sha in rec["files"].items():
        assert file_sha256(out / rel) == sha
        torch.load(out / rel, weights_only=True)
    assert json.loads((out / "export.json").read_text())["rows"] == 6


def test_refusals_are_one_line(run_dir, tmp_path, capsys):
    src, _ = run_dir
    assert export_mod.main([str(src), str(tmp_path / "x"), "--format", "modelopt",
                            "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0], err
    with pytest.raises(SystemExit):
        export_mod.main([str(src), str(tmp_path / "y"), "--format", "sglang"])


def _killed_export(src, out, fmt, monkeypatch, after=3):
    """An export killed as it writes row `after + 1`; returns its partial dir."""
    name = "save_torch" if fmt != "speculators" else "_write_speculators_row"
    owner = export_formats if fmt != "speculators" else export_mod
    real, calls = getattr(owner, name), []

    def dies(*a, **kw):
        calls.append(1)
        if len(calls) == after + 1:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(owner, name, dies)
    with pytest.raises(KeyboardInterrupt):
        export_mod.export(src, out, fmt)
    monkeypatch.setattr(owner, name, real)
    return export_mod.partial_dir(out)


@pytest.mark.parametrize("fmt", ["speculators", "modelopt"])
def test_a_journal_line_cut_by_a_kill_costs_its_row_not_the_rest(run_dir, tmp_path,
                                                                  monkeypatch, fmt):
    """A kill mid-line, then the same command: every row, and no temp in OUT."""
    src, _ = run_dir
    out = tmp_path / "out"
    part = _killed_export(src, out, fmt, monkeypatch)
    journal = part / export_mod.JOURNAL
    text = journal.read_text()
    last = text.rstrip("\n").rsplit("\n", 1)[1]
    journal.write_text(text[: len(text) - 1 - len(last) // 2])  # the last line, torn
    rows_dir = part / ("hidden_states" if fmt == "speculators" else "rows")
    stray = next(p for p in rows_dir.rglob("*") if p.is_file())
    (stray.parent / f".{stray.name}.tmp-4242").write_bytes(b"half a row")  # a killed write
    rec = export_mod.export(src, out, fmt)
    assert rec["rows"] == 6 and rec["resumed_rows"] == 2
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    files = [p for p in out.rglob("*") if p.is_file()
             and p.relative_to(out).parts[0] in ("hidden_states", "rows")]
    assert len(files) == 6
    if fmt == "speculators":
        import datasets

        ds = datasets.load_from_disk(str(out))
        assert len(ds) == 6 and sorted(int(i) for i in ds["sample_index"]) == sorted(
            sample_files(src, "safetensors"))


def test_model_must_be_the_one_the_extraction_ran_on(run_dir, tmp_path):
    """A checkpoint of the same shape but another config is refused before any row."""
    import shutil

    src, _ = run_dir
    ran_on = json.loads((src / "manifest.json").read_text())["model"]["resolved_path"]
    other = tmp_path / "other-model"
    shutil.copytree(ran_on, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-6) * 10  # another model's final norm
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(export_mod.ExportError, match="not the one the extraction ran on"):
        export_mod.export(src, tmp_path / "x", "modelopt", model=str(other))
    assert not (tmp_path / "x").exists() and not export_mod.partial_dir(tmp_path / "x").exists()
    assert export_mod.export(src, tmp_path / "y", "modelopt", model=ran_on)["rows"] == 6


def test_two_exports_into_one_out_leave_one_whole_export(run_dir, tmp_path):
    import threading

    src, _ = run_dir
    out, results = tmp_path / "out", []

    def one():
        try:
            results.append(export_mod.export(src, out, "modelopt")["rows"])
        except export_mod.ExportError as e:
            results.append(str(e))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(map(str, results))[0] == "6", results  # one export, whole
    assert ("another eagle3-export is writing" in str(results) or
            "exists and is not empty" in str(results)), results
    assert len([p for p in out.rglob("*.pt")]) == 6
    assert not export_mod.partial_dir(out).exists()


def test_a_folder_the_export_did_not_make_is_left_alone(run_dir, tmp_path, capsys):
    src, _ = run_dir
    out = tmp_path / "out"
    part = export_mod.partial_dir(out)
    part.mkdir()
    (part / "mine.txt").write_text("the user's")
    assert export_mod.main([str(src), str(out), "--format", "modelopt"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not write" in err[0], err
    assert (part / "mine.txt").read_text() == "the user's" and not out.exists()


def test_a_full_disk_is_one_line_and_the_rerun_finishes(run_dir, tmp_path, capsys):
    import subprocess

    src, _ = run_dir
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        out = mnt / "out"
        assert export_mod.main([str(src), str(out), "--format", "modelopt"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "No space left on device" in err[0], err
        assert not out.exists()  # nothing that looks whole
        subprocess.run(["mount", "-o", "remount,size=16m", str(mnt)], check=True)
        assert export_mod.main([str(src), str(out), "--format", "modelopt"]) == 0
        assert len(list(out.rglob("*.pt"))) == 6
        assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_train_checks_a_kept_export_like_a_fresh_one(run_dir, tmp_path, caplog):
    """eagle3-train's rerun reuses its export only when every file re-hashes to its record:
    a lost row or a changed Arrow file is exported again, not trained on."""
    from eagle3_extract.check.run_dir import run_state
    from eagle3_extract.drafter import train

    src, m = run_dir
    man = run_state(src).manifests[0]
    plan = train.Plan(None, False, src, tmp_path, man, list(man.layer_ids), [], tmp_path, "cpu", {}, {})
    dst = train._export(plan)
    assert export_mod.export_problem(dst) is None
    stamp = (dst / "export.json").stat().st_mtime_ns
    assert train._export(plan) == dst and (dst / "export.json").stat().st_mtime_ns == stamp
    lost = sorted(dst.glob("hidden_states/*.safetensors"))[2]
    lost.unlink()
    assert "is missing" in export_mod.export_problem(dst)
    train._export(plan)
    assert lost.is_file() and export_mod.export_problem(dst) is None
    arrow = next(dst.glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[-20] ^= 1
    arrow.write_bytes(bytes(data))
    assert "changed after it was exported" in export_mod.export_problem(dst)
    train._export(plan)
    assert export_mod.export_problem(dst) is None
    assert "not whole" in caplog.text
