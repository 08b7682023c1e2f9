"""eagle3-verify on a real extraction (tiny Llama, vLLM 0.16 CPU build): the HF
reference and vLLM's own EAGLE-3 aux path agree with clean data and reject
copies corrupted the ways that silently ruin a drafter.

The two references are built once per module and reused for every copy (the
same objects `eagle3-verify` builds, passed as `built=`); the CLI itself runs
once with the HF reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_engine
from eagle3_extract.check import reference, verify
from eagle3_extract.manifest import Manifest
from eagle3_extract.types import Batch, Sample
from test_validate import extract_tiny, load_st, rewrite, sample_file

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("verify") / "out"
    extract_tiny(root)
    return root


@pytest.fixture(scope="module")
def refs(clean):
    from eagle3_extract.engine import inspect_model

    manifest = Manifest.read(clean / "manifest.json")
    cfg = verify.build_config(manifest, [])
    info = inspect_model(cfg.model)
    built = [reference.HFReference(cfg.engine, cfg.model, info, manifest.layer_ids),
             reference.VllmAuxReference(cfg.engine, cfg.model, info, manifest.layer_ids)]
    yield built
    for r in built:
        r.close()


@pytest.fixture
def copy(clean, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(clean, dst, ignore=shutil.ignore_patterns("*_report.json"))
    return dst


def check(root: Path, refs) -> dict:
    return verify.verify(root, built=refs)


def failing(report: dict, needle: str) -> list[str]:
    return [f for f in report["failures"] if needle in f]


def test_cli_hf_reference_passes_clean_data(clean, capsys):
    assert verify.main([str(clean), "--reference", "hf", "-k", "3", "--seed", "1"]) == 0
    assert ": OK" in capsys.readouterr().out
    report = json.loads((clean / verify.REPORT_NAME).read_text())
    assert report["ok"] and len(report["samples"]) == 3 and report["dataset"]["checked"] == 3
    hf = report["references"]["hf"]
    assert list(hf["per_layer"]) == ["2", "4", "5", "8"]
    assert all(0 < v["mean"] < 0.04 and v["max"] < 0.16 for v in hf["per_layer"].values())


def test_both_references_pass_clean_data(clean, refs):
    report = check(clean, refs)
    assert report["ok"], report["failures"]
    assert report["samples"] == list(range(6))  # K=8 > 6 files: all of them
    aux = report["references"]["vllm-aux"]
    assert aux["layer_ids"] == [2, 4, 5]  # id N = 8 is not an aux layer
    assert all(v["mean"] < 0.04 for v in aux["per_layer"].values())


def test_layer_shifted_by_one(copy, refs):
    path = sample_file(copy, 2)
    t, _ = load_st(path)
    hf = make_engine("hf", [5])
    try:
        id5 = hf.extract(Batch([Sample(2, t["input_ids"].tolist(), [])])).states[0][:, 0]
    finally:
        hf.close()
    rewrite(path, lambda t: t["hidden_states"][:, 1].copy_(id5))  # column of id 4
    report = check(copy, refs)
    assert not report["ok"]
    assert failing(report, "sample 2: layer 4: hf rel err")
    assert failing(report, "sample 2: layer 4: vllm-aux rel err")
    assert not failing(report, "layer 5") and not failing(report, "sample 1")


def test_swapped_pair_of_layers(copy, refs):
    rewrite(sample_file(copy, 0), lambda t: t.update(
        hidden_states=t["hidden_states"][:, [1, 0, 2, 3]]))
    report = check(copy, refs)
    for ref in ("hf", "vllm-aux"):
        for k in (2, 4):
            assert failing(report, f"sample 0: layer {k}: {ref} rel err"), report["failures"]


def test_truncated_rows(copy, refs):
    rewrite(sample_file(copy, 4), lambda t: t.update(hidden_states=t["hidden_states"][:-2]))
    report = check(copy, refs)
    assert failing(report, "000000004.safetensors: rows:")
    assert failing(report, "sample 4: data/00000/000000004.safetensors: not compared")


def test_nan(copy, refs):
    rewrite(sample_file(copy, 1), lambda t: t["hidden_states"][3, 3].fill_(float("nan")))
    report = check(copy, refs)
    assert failing(report, "nonfinite")
    nan_fails = failing(report, "sample 1: layer 8: hf rel err")
    assert nan_fails and "mean inf" in nan_fails[0]


def test_missing_file(copy, refs):
    sample_file(copy, 5).unlink()
    report = check(copy, refs)
    assert failing(report, "missing: 1 sample files missing: indices [5]")
    assert report["samples"] == [0, 1, 2, 3, 4]


def test_file_of_another_run(copy, refs):
    rewrite(sample_file(copy, 3), run_id="0123456789abcdef")
    report = check(copy, refs)
    assert failing(report, "000000003.safetensors: run_id:")


def test_file_holding_another_sample(copy, refs):
    """Self-consistent states of the wrong sample: only the dataset check sees it."""
    t, meta = load_st(sample_file(copy, 4))
    save_file(t, str(sample_file(copy, 1)), metadata={**meta, "sample_index": "1"})
    report = check(copy, refs)
    assert failing(report, "sample 1: input_ids differ from dataset row")
    assert not failing(report, "rel err")


def test_model_override_and_errors(clean, tmp_path):
    with pytest.raises(verify.VerifyError, match="model.path='/nowhere'"):
        verify.verify(clean, ["model.path=/nowhere"], references=["hf"])
    with pytest.raises(verify.VerifyError, match="key=value"):
        verify.verify(clean, ["model.path"], references=["hf"])
    assert verify.main([str(tmp_path)]) == 2  # no manifest


def test_tolerances_per_dtype_and_override(clean, refs):
    assert verify.tolerance("float32", False) == verify.Tol(1e-4, 1e-4, 1e-3)
    assert verify.tolerance("bfloat16", False) == verify.Tol(0.04, 0.04, 0.16)
    moe = verify.tolerance("bfloat16", True)
    assert moe.median == 0.05 and moe.mean == 0.30 and moe.max == float("inf")
    with pytest.raises(verify.VerifyError):
        verify.tolerance("int8", False)
    nan = torch.tensor([[[float("nan"), 1.0]]])
    assert verify.rel_err(nan, torch.ones(1, 1, 2)).item() == float("inf")
    # bf16 data is not bit-identical to the HF reference: a float32-grade bound fails it.
    report = verify.verify(clean, built=refs[:1], samples=2, tol={"median": 1e-4})
    assert not report["ok"] and report["tolerance"]["median"] == 1e-4
    assert failing(report, "hf rel err median")


def test_the_final_state_reproduces_the_models_logits(clean, refs):
    lg = check(clean, refs)["logits"]
    assert lg["tokens"] > 0 and lg["argmax_agreement"] >= lg["required"], lg


def test_a_wrong_final_state_fails_the_logits_check(copy, refs):
    """id N-1's state stored as id N. (A post-norm state stored as id N passes on a random
    tiny model, whose norm weight is all ones and RMS norm scale-free: test_exports.py
    shows that case on the real SmolLM2.)"""
    hf = make_engine("hf", [7])
    try:
        for i in range(6):
            path = sample_file(copy, i)
            t, _ = load_st(path)
            bad = hf.extract(Batch([Sample(i, t["input_ids"].tolist(), [])])).states[0][:, 0]
            rewrite(path, lambda t, bad=bad: t["hidden_states"][:, -1].copy_(bad))
    finally:
        hf.close()
    report = check(copy, refs)
    assert not report["ok"]
    assert failing(report, "logits: lm_head(final_norm(layer 8))"), report["failures"]
    print("layer 7 stored as 8:", report["logits"])
