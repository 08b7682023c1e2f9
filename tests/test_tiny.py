"""tiny.build_once: a model directory is built once and reused, whether save_pretrained
wrote one weights file or shards with an index (it shards above its size limit: the
10.8 GB Kimi-shaped test model came out as three)."""

from __future__ import annotations

import json

from eagle3_extract.models.tiny import build_once


def test_a_sharded_model_is_built_once_and_then_reused(tmp_path):
    calls = []

    def make(d):
        calls.append(d)
        (d / "config.json").write_text("{}")
        for i in (1, 2):
            (d / f"model-0000{i}-of-00002.safetensors").write_bytes(b"x")
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))

    out = tmp_path / "m"
    assert build_once(out, make) == out and len(calls) == 1
    assert build_once(out, make) == out and len(calls) == 1  # reused, not rebuilt
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".m.")]  # no temp left


def test_a_build_that_fails_leaves_nothing_that_looks_complete(tmp_path):
    def make(d):
        (d / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("killed mid-save")

    out = tmp_path / "m"
    try:
        build_once(out, make)
    except RuntimeError:
        pass
    assert not out.exists() and list(tmp_path.iterdir()) == []
