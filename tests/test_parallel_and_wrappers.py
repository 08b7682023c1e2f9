"""Tensor and pipeline parallel 2 on the CPU build, and the Kimi-K2.5 wrapper."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_engine, rel_err
from eagle3_extract.types import Batch, Sample

pytestmark = pytest.mark.engine
ALL_IDS = list(range(1, 9))


def samples():
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(6, 1000, (150,), generator=g).tolist()
    out = [Sample(i, torch.randint(6, 1000, (n,), generator=g).tolist(), [])
           for i, n in enumerate([40, 77, 130])]
    out += [Sample(3 + i, prefix + [7 + i] * (i + 1), []) for i in range(2)]
    return out


@pytest.fixture(scope="module")
def reference():
    hf = make_engine("hf", ALL_IDS, dtype="float32")
    eb = hf.extract(Batch(samples()))
    states = [s.clone() for s in eb.states]
    eb.release()
    hf.close()
    return states


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_capture_returns_every_layer_once(tp, pp, reference):
    """TP: states come once, from TP rank 0. PP: each stage returns the layers it owns
    (speculators 0.3.0 silently dropped those of every stage but the last)."""
    engine = make_engine("vllm", ALL_IDS, dtype="float32",
                         model_kw=dict(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    try:
        assert engine.describe["executor"] == "mp"
        eb = engine.extract(Batch(samples()))
        for s, got, ref in zip(samples(), eb.states, reference):
            assert got.shape == (len(s), len(ALL_IDS), engine.hidden_size)
            err = rel_err(got, ref).max(0).values
            assert (err < 1e-4).all(), (s.index, err)
        eb.release()
    finally:
        engine.close()


def test_kimi_k25_wrapper_decoder_layers_are_found():
    """vLLM 0.16 serves Kimi-K2.5 as KimiK25ForConditionalGeneration, whose
    language_model wraps DeepseekV3. A tiny one cannot run a forward offline (its
    processor and tokenizer are remote code), so this builds the real class and
    checks what the capture hooks attach to."""
    script = Path(__file__).parent / "scripts" / "kimi_k25_layers.py"
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    language_model = info.pop("language_model")
    assert info == {"path": "language_model.model.layers", "num_layers": 8,
                    "layer_class": "DeepseekV2DecoderLayer", "llama_4_scaling_arg": True}
    assert language_model.startswith("DeepseekV"), language_model
