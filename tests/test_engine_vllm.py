"""The vLLM engine (our driver and worker extension on vLLM 0.16's CPU build) against
the HF reference, and the invariants that guard against silent truncation."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import make_engine, rel_err
from eagle3_extract.types import Batch, Sample

pytestmark = pytest.mark.engine

# (mean, max) per-token relative error allowed vs the HF reference, per layer id.
# float32 proves the semantics exactly (observed <= 1.1e-6 for all three). bf16
# over 8 random layers: dense observed mean <= 0.023; MoE routing flips on bf16
# near-ties and the error compounds with depth (observed mean up to 0.21 at id 8,
# 0.009 at id 1), hence looser and no max bound. Off-by-one errors are >= 0.37.
TOL = {
    ("llama", "float32"): (1e-4, 1e-3),
    ("qwen3", "float32"): (1e-4, 1e-3),
    ("deepseek_v3", "float32"): (1e-4, 1e-3),
    ("llama", "bfloat16"): (0.04, 0.16),
    ("deepseek_v3", "bfloat16"): (0.30, float("inf")),
}
ALL_IDS = list(range(1, 9))  # every boundary of the 8-layer tiny models, N included


def random_samples(lengths, seed=0, start_index=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(start_index + i, torch.randint(6, 1000, (n,), generator=g).tolist(), [0] * n)
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module", params=list(TOL), ids=lambda p: "-".join(p))
def arch_engines(request):
    arch, dtype = request.param
    vllm = make_engine("vllm", ALL_IDS, arch=arch, dtype=dtype)
    hf = make_engine("hf", ALL_IDS, arch=arch, dtype=dtype)
    yield request.param, vllm, hf
    vllm.close()
    hf.close()


def test_matches_hf_reference_at_every_layer_id(arch_engines):
    arch, vllm, hf = arch_engines
    samples = random_samples([40, 77, 130])
    got = vllm.extract(Batch(samples))
    ref = hf.extract(Batch(samples))
    try:
        for s, a, r in zip(samples, got.states, ref.states):
            assert a.shape == r.shape == (len(s), len(ALL_IDS), vllm.hidden_size)
            err = rel_err(a, r)
            print(arch, s.index, "mean", err.mean(0).tolist(), "max", err.max(0).values.tolist())
            mean_tol, max_tol = TOL[arch]
            assert (err.mean(0) < mean_tol).all(), (arch, err.mean(0))
            assert (err.max(0).values < max_tol).all(), (arch, err.max(0).values)
    finally:
        got.release()
        ref.release()


def test_after_the_layer_convention_fails_the_same_check(arch_engines):
    """speculators 0.3.0 captured after layer k (vLLM's k+1): that data is off by one."""
    arch, vllm, hf = arch_engines
    samples = random_samples([64], seed=1)
    got = vllm.extract(Batch(samples))
    ref = hf.extract(Batch(samples))
    try:
        shifted = rel_err(got.states[0][:, 1:], ref.states[0][:, :-1]).mean(0)
        assert (shifted > TOL[arch][0]).all(), shifted
        assert (shifted > 0.3).all(), shifted
    finally:
        got.release()
        ref.release()


@pytest.fixture(scope="module")
def fp32_engine():
    # float32 makes batch composition numerically irrelevant: any difference is a bug.
    cores = os.sched_getaffinity(0)
    engine = make_engine("vllm", [1, 4, 5, 8], dtype="float32", max_num_seqs=4,
                         token_budget=2048, host_buffers=2)
    yield engine
    engine.close()
    # The in-process CPU worker pins this process to its cores; close() undoes it.
    assert os.sched_getaffinity(0) == cores


def extract_alone(engine, samples):
    out = {}
    for s in samples:
        eb = engine.extract(Batch([s]))
        out[s.index] = eb.states[0].clone()
        eb.release()
    return out


def shared_prefix_samples():
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(6, 1000, (300,), generator=g).tolist()  # > 2 KV blocks of 128
    tails = [torch.randint(6, 1000, (n,), generator=g).tolist() for n in (5, 40, 1, 90, 17)]
    samples = [Sample(i, prefix + t, [0] * (300 + len(t))) for i, t in enumerate(tails)]
    samples.append(Sample(5, prefix[:200], [0] * 200))  # a pure prefix of the others
    return samples


def check_rows_and_equal(batch_states, samples, alone):
    for s, st in zip(samples, batch_states):
        assert st.shape[0] == len(s), f"sample {s.index}: {st.shape[0]} rows for {len(s)} tokens"
        err = rel_err(st, alone[s.index]).max()
        assert err < 1e-4, f"sample {s.index} differs from its extraction alone: {err}"


def test_shared_prefix_in_one_batch_and_across_batches(fp32_engine):
    samples = shared_prefix_samples()
    alone = extract_alone(fp32_engine, samples)  # across batches: each shares with the last
    eb = fp32_engine.extract(Batch(samples))  # one call: 6 samples, max_num_seqs=4 -> 2 steps
    try:
        check_rows_and_equal(eb.states, samples, alone)
    finally:
        eb.release()
    rev = list(reversed(samples))
    eb = fp32_engine.extract(Batch(rev))
    try:
        check_rows_and_equal(eb.states, rev, alone)
    finally:
        eb.release()


def test_many_samples_take_several_steps(fp32_engine):
    samples = random_samples([3, 50, 9, 120, 64, 1, 33, 70, 12, 200], seed=3)
    alone = extract_alone(fp32_engine, samples)
    eb = fp32_engine.extract(Batch(samples))
    try:
        check_rows_and_equal(eb.states, samples, alone)
    finally:
        eb.release()


def test_batch_over_the_token_budget_is_refused_not_truncated(fp32_engine):
    samples = random_samples([1000, 1000, 100], seed=4)  # 2100 tokens > 2048 per call
    with pytest.raises(ValueError, match="tokens in one call"):
        fp32_engine.extract(Batch(samples))
    # The engine is still usable, and both samples extract whole on their own.
    for s in samples:
        eb = fp32_engine.extract(Batch([s]))
        assert eb.states[0].shape[0] == len(s)
        eb.release()


def test_overlong_sample_raises(fp32_engine):
    (s,) = random_samples([1024], seed=5)  # max_model_len 1024 leaves 1023 for the prompt
    with pytest.raises(ValueError, match="longer than max_model_len"):
        fp32_engine.extract(Batch([s]))


def test_held_buffers_are_not_overwritten(fp32_engine):
    a, b = random_samples([80, 80], seed=6)
    first = fp32_engine.extract(Batch([a]))
    snapshot = first.states[0].clone()
    second = fp32_engine.extract(Batch([b]))  # second slot; first still held
    assert torch.equal(first.states[0], snapshot)
    first.release()
    first.release()  # idempotent
    second.release()


def _poison_layer(worker, layer: int, row: int):
    """In the worker: layer `layer`'s output gets NaN at token row `row` (or no hook)."""
    from eagle3_extract.engine.layers import find_decoder_layers

    _, layers = find_decoder_layers(worker.model_runner.model)
    for h in getattr(worker, "_poison", []):
        h.remove()
    worker._poison = []
    if layer:
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if out.shape[0] > row:
                out[row] = float("nan")
        worker._poison.append(layers[layer - 1].register_forward_hook(hook))


@pytest.mark.parametrize("storage", ["model", "fp8"])
def test_nan_rows_are_refused_by_the_devices_finite_flags(storage):
    """The per-row flags computed on the device (a sum for the model dtype, the scales for
    fp8) reach the driver through the host buffer: a NaN row fails the batch, whether the
    caller waits in extract or later in ExtractedBatch.wait(), and nothing else breaks."""
    from types import SimpleNamespace

    from eagle3_extract.engine import inspect_model
    from eagle3_extract.engine.start import build_engine
    from conftest import engine_cfg, model_cfg

    from eagle3_extract.layout import Storage

    m = model_cfg("llama", "bfloat16")
    out = SimpleNamespace(dtype=storage, fp8_scale="token")
    engine = build_engine(engine_cfg("vllm"), m, inspect_model(m), [2, 4, 8],
                          Storage.from_output(out))
    try:
        a, b = random_samples([40, 30], seed=9)
        engine.executor.collective_rpc(_poison_layer, args=(3, 45))  # row 45: sample b
        with pytest.raises(RuntimeError, match=r"NaN or Inf in the hidden states of samples \[1\]"):
            engine.extract(Batch([a, b]))
        eb = engine.extract(Batch([a, b]), wait=False)
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            eb.wait()
        with pytest.raises(RuntimeError, match="NaN or Inf"):
            eb.wait()  # idempotent: the same verdict
        eb.release()
        engine.executor.collective_rpc(_poison_layer, args=(0, 0))
        eb = engine.extract(Batch([a, b]))
        assert [s.shape[0] for s in eb.states] == [40, 30]
        eb.release()
    finally:
        engine.close()


def test_bf16_linears_take_float32_products_exactly_where_the_build_lacks_onednn():
    """vLLM 0.16's AVX2 build has no oneDNN and leaves bf16 linears on torch's scalar
    fallback (engine/cpu_gemm.py); there every linear, lm_head included, is upcast, and
    the capture still matches HF (test_matches_hf_reference_at_every_layer_id)."""
    from vllm import _custom_ops as ops

    engine = make_engine("vllm", [2, 4], arch="llama", dtype="bfloat16")
    try:
        (count,) = engine.executor.collective_rpc("cpu_gemm_upcast")
        # tiny llama: 8 layers x (qkv, o, gate_up, down), and lm_head and embed_tokens
        # (vocab-parallel: vLLM dispatches a cpu_linear for both; only lm_head calls it)
        assert count == (0 if ops._supports_onednn else 8 * 4 + 2)
        out = engine.extract(Batch(random_samples([40, 17])))
        assert [tuple(t.shape[:2]) for t in out.states] == [(40, 2), (17, 2)]
        assert all(torch.isfinite(t.float()).all() for t in out.states)
        out.release()
    finally:
        engine.close()
