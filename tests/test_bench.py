"""bench/throughput/run.py's CPU smoke run: every figure is there, sane, and backed by real files.

No timing assertions: this machine's speed says nothing; the harness's plumbing does.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.engine

# Per token: input_ids int64 + loss_mask uint8; per file: the safetensors JSON header.
TOKEN_OVERHEAD, FILE_OVERHEAD = 9, 4096


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/throughput/run.py"), "--smoke", "--out", str(out),
         "--out-dir", str(tmp / "files"), "--keep-files", "--more-writer-threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text()), tmp / "files" / "extract", proc.stdout


def test_json_has_every_field(smoke):
    r, _, _ = smoke
    for key in ("date", "command", "machine", "engine", "model", "layer_ids", "data",
                "bytes_per_token", "phases", "files", "disk", "ratios", "target", "flops"):
        assert key in r, key
    for key in ("cpu", "torch", "vllm", "transformers", "output_fs"):
        assert r["machine"][key], key
    assert "bench/throughput/run.py" in r["command"]
    assert r["model"]["hidden_size"] == 128 and r["model"]["num_layers"] == 8
    assert r["model"]["dtype"] == "bfloat16"
    assert r["layer_ids"] == [2, 4, 5, 8]
    assert set(r["phases"]) == {"prefill", "extract_host", "extract_disk", "extract_disk_w1"}
    assert r["phases"]["extract_disk_w1"]["bytes"] == r["phases"]["extract_disk"]["bytes"]
    assert r["data"]["source"] == "sample" and r["data"]["batches"] > 1
    assert set(r["flops"]["mfu"]) == set(r["phases"])


def test_figures_are_sane(smoke):
    r, _, stdout = smoke
    repeats = r["data"]["repeats"]
    for name, ph in r["phases"].items():
        assert len(ph["seconds"]) == repeats, name
        assert ph["tok_s"] > 0 and math.isfinite(ph["tok_s"]), name
    for value in (*r["ratios"].values(), r["target"]["extract_disk_vs_bound"]):
        assert math.isfinite(value) and value > 0
    assert r["disk"]["bytes_per_s"] > 0 and r["disk"]["bytes"] == r["phases"]["extract_disk"][
        "bytes"]
    assert isinstance(r["target"]["met"], bool)
    assert r["flops"]["per_token"] > 2 * r["flops"]["decoder_params"] > 0
    assert "(3)/(1)" in stdout and "target" in stdout and "(3) with 1 writers" in stdout


def test_bytes_written_match_the_states(smoke):
    r, _, _ = smoke
    tokens, files = r["data"]["tokens"], r["data"]["samples"]
    states = tokens * len(r["layer_ids"]) * r["model"]["hidden_size"] * 2  # bf16
    written = r["phases"]["extract_disk"]["bytes"]
    assert r["bytes_per_token"]["states"] * tokens == states
    assert states < written <= states + tokens * TOKEN_OVERHEAD + files * FILE_OVERHEAD
    assert r["phases"]["extract_disk"]["files"] == files == r["files"]["count"]


def test_files_are_really_written(smoke):
    r, root, _ = smoke
    paths = sorted(root.rglob("*.safetensors"))
    assert len(paths) == r["data"]["samples"]
    assert sum(p.stat().st_size for p in paths) == r["phases"]["extract_disk"]["bytes"]
    tensors = load_file(str(paths[0]))
    hs = tensors["hidden_states"]
    assert hs.dtype == torch.bfloat16
    assert hs.shape == (tensors["input_ids"].numel(), len(r["layer_ids"]), 128)
    assert torch.isfinite(hs.float()).all() and hs.float().abs().sum() > 0


def test_dp_preflight_harness_reports_both_runs(tmp_path):
    """bench/throughput/dp_preflight.py end to end on a small dataset (no timing assertion)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench/throughput/dp_preflight.py"), "--rows", "300",
                           "--dp", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fig["rows"] == 300 and fig["dp1_s"] > 0 and fig["dp2_s"] > 0
    assert math.isclose(fig["ratio"], fig["dp2_s"] / fig["dp1_s"], rel_tol=0.01)
    replicas = list((tmp_path / "dp2" / "logs").glob("*/replica-*/extract.log"))
    assert len(replicas) == 2
    assert all("launcher's tokenized set" in p.read_text() for p in replicas)
