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
