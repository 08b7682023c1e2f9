"""The HF reference engine: its convention checked against transformers' own
output_hidden_states, and its reusable host buffers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_engine
from eagle3_extract.types import Batch, Sample


def test_ids_follow_the_vllm_convention(tiny_paths):
    engine = make_engine("hf", list(range(1, 9)), dtype="float32")
    ids = list(range(10, 70))
    eb = engine.extract(Batch([Sample(0, ids, [0] * len(ids))]))
    model = AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], dtype=torch.float32)
    with torch.inference_mode():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    got = eb.states[0]
    for k in range(1, 8):  # HF hidden_states[k] is the input of layer k for k < N
        torch.testing.assert_close(got[:, k - 1], hs[k][0], rtol=1e-5, atol=1e-5)
    # id N is the state before the final norm; HF's hidden_states[N] is after it.
    torch.testing.assert_close(model.model.norm(got[:, 7]), hs[8][0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, 7], hs[8][0])
    eb.release()
    engine.close()


def test_held_states_are_never_overwritten_and_slots_are_reused():
    engine = make_engine("hf", [2, 5], host_buffers=2, token_budget=256)
    a, b, c = (Sample(i, list(range(10 + i, 60 + i)), [0] * 50) for i in range(3))
    ea = engine.extract(Batch([a]))
    snap = ea.states[0].clone()
    eb = engine.extract(Batch([b]))
    ec = engine.extract(Batch([c]))  # both slots held: a fresh buffer, not a wait
    for e in (eb, ec):
        assert not torch.equal(e.states[0], snap)
    assert torch.equal(ea.states[0], snap)
    ptr = ea.states[0].data_ptr()
    ea.release()
    ea.release()  # idempotent
    ed = engine.extract(Batch([a]))
    assert ed.states[0].data_ptr() == ptr  # the released slot is reused
    assert torch.equal(ed.states[0], snap)
    engine.close()


def test_the_engine_stores_as_the_storage_it_is_handed(monkeypatch):
    """One Storage per job (job.preflight builds it from output.*) handed to the engine:
    the engine does not rebuild its own from the config, so the two cannot disagree."""
    import eagle3_extract.engine.start as start
    from eagle3_extract.layout import Storage

    built = []
    monkeypatch.setattr(Storage, "from_output", classmethod(
        lambda cls, out: built.append(out) or cls()))
    fp8 = Storage(dtype="fp8")
    from types import SimpleNamespace

    from conftest import engine_cfg, model_cfg
    from eagle3_extract.engine import inspect_model

    m = model_cfg()
    cfg = SimpleNamespace(model=m, engine=engine_cfg("hf"), output={"dtype": "model"})
    engine = start.build_engine(cfg.engine, cfg.model, inspect_model(m), [2, 4], fp8)
    try:
        assert engine.storage is fp8 and built == []  # handed on, not rebuilt
        eb = engine.extract(Batch([Sample(0, list(range(1, 40)), [1] * 39)]))
        assert eb.states[0].dtype == torch.float8_e4m3fn  # stored as it was told
    finally:
        engine.close()
    with pytest.raises(TypeError):  # no plan, no engine: a Storage is required, not rebuilt
        start.build_engine(cfg.engine, cfg.model, inspect_model(m), [2, 4])
    assert built == []
