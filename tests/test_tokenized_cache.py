"""The tokenized dataset is an artifact later jobs reuse, verified, never trusted: a second
job and a 4-job sweep over layers tokenize once; another chat template or tokenizer is
another key; a damaged artifact is rebuilt (engine=hf, dry runs: no engine starts)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from test_job import BIN, COMMON, compose_cfg, env

from eagle3_extract.config import ASSETS

HF = ["engine=hf", "dry_run=true", *COMMON]


@pytest.fixture
def cache(tmp_path, monkeypatch, offline):
    d = tmp_path / "tokenized"
    monkeypatch.setenv("EAGLE3_TOKENIZED_CACHE", str(d))
    return d


def _preflight(out: Path, *overrides: str):
    from eagle3_extract.extract.job import preflight

    plan = preflight(compose_cfg(*HF, f"output.dir={out}", *overrides))
    plan.close()
    return plan


def _reused(caplog) -> int:
    return sum("tokenized set reused" in r.getMessage() for r in caplog.records)


def test_a_second_job_reuses_it_and_gets_the_same_samples(cache, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="eagle3_extract")
    first = _preflight(tmp_path / "a")
    assert _reused(caplog) == 0 and len(list(cache.iterdir())) == 1
    second = _preflight(tmp_path / "b", "layers.ids=[1,3]")  # another job, same data
    assert _reused(caplog) == 1 and len(list(cache.iterdir())) == 1
    for k in ("indices", "offsets", "ids", "mask", "truncated"):
        assert np.array_equal(getattr(first.mine, k), getattr(second.mine, k)), k
    assert first.mine.report == second.mine.report
    _preflight(tmp_path / "c", "shard.count=2", "shard.index=1")  # another shard: its own
    _preflight(tmp_path / "d", "dataset.max_samples=5")  # another selection
    assert len(list(cache.iterdir())) == 3 and _reused(caplog) == 1


def test_another_chat_template_or_tokenizer_is_another_artifact(cache, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="eagle3_extract")
    _preflight(tmp_path / "a")
    tok = tmp_path / "tok"
    shutil.copytree(ASSETS / "tokenizer", tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg["chat_template"] = cfg["chat_template"].replace("<|eot_id|>", "<|eot_id|>\n")
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    _preflight(tmp_path / "b", f"model.tokenizer={tok}")
    assert _reused(caplog) == 0 and len(list(cache.iterdir())) == 2
    cfg = json.loads((tok / "tokenizer_config.json").read_text())  # the template as before,
    cfg["model_max_length"] = 12345  # another tokenizer file
    cfg["chat_template"] = json.loads(
        (ASSETS / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    _preflight(tmp_path / "c", f"model.tokenizer={tok}")
    assert _reused(caplog) == 0 and len(list(cache.iterdir())) == 3


def test_a_damaged_artifact_is_rebuilt_not_trusted(cache, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="eagle3_extract")
    want = _preflight(tmp_path / "a").mine
    (key,) = list(cache.iterdir())
    ids = key / "ids.npy"
    raw = bytearray(ids.read_bytes())
    raw[-3] ^= 0x01  # one token id changed; still a valid .npy
    ids.write_bytes(bytes(raw))
    got = _preflight(tmp_path / "b").mine
    assert any("is damaged" in r.getMessage() for r in caplog.records)
    assert _reused(caplog) == 0 and np.array_equal(got.ids, want.ids)
    assert _preflight(tmp_path / "c").mine.report == want.report and _reused(caplog) == 1
    (key / "meta.json").write_text("{")
    _preflight(tmp_path / "d")
    assert sum("is damaged" in r.getMessage() for r in caplog.records) == 2


def test_a_sweep_of_four_jobs_over_layers_tokenizes_once(tmp_path):
    cache = tmp_path / "tokenized"
    r = subprocess.run([str(BIN), "-m", *HF, "layers.ids=[1,2,3],[2,3,4],[3,4,5],[4,5,6]"],
                       env=env(EAGLE3_TOKENIZED_CACHE=str(cache),
                               EAGLE3_OUTPUT_ROOT=str(tmp_path / "out")),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list(cache.iterdir())) == 1
    logs = list((tmp_path / "out").rglob("extract.log"))
    assert len(logs) == 4
    assert sum("tokenized set reused" in p.read_text() for p in logs) == 3


def test_hub_datasets_are_known_by_revision_and_local_folders_by_content(tmp_path, monkeypatch):
    """A dataset updated upstream is another dataset (its tokenized set and run are new):
    a hub id by the commit the hub cache resolved, a local dataset folder by its files."""
    from omegaconf import OmegaConf

    from eagle3_extract.manifest import dataset_identity

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))

    def ident(path: str) -> dict:
        ds = OmegaConf.create({"path": path, "format": "hub", "hub_config": None,
                               "data_files": None, "split": "train", "max_samples": None,
                               "seed": 0, "shuffle": True, "overlong": "truncate"})
        return dataset_identity(ds, 2047)["source"]

    assert ident("org/chats")["revision"] is None  # nothing resolved yet
    refs = tmp_path / "hub" / "datasets--org--chats" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    first = ident("org/chats")
    assert first["revision"] == "a" * 40
    (refs / "main").write_text("b" * 40 + "\n")
    assert ident("org/chats")["revision"] == "b" * 40
    assert ident("org/other")["revision"] is None

    folder = tmp_path / "repo"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train-0.parquet").write_bytes(b"rows v1")
    v1 = ident(str(folder))
    (folder / ".git").mkdir()
    (folder / ".git" / "index").write_bytes(b"not data")
    assert ident(str(folder)) == v1  # what is not data does not count
    (folder / "data" / "train-0.parquet").write_bytes(b"rows v2")
    assert ident(str(folder))["tree_sha256"] != v1["tree_sha256"]
