"""bench/prediction/w4a16.py (issue 25 (c)): its W4A16 arithmetic is compressed-tensors' bit for
bit, and the checkpoint it writes is one that compressed-tensors decodes to exactly the
reference it writes beside it, and that vLLM's compressed-tensors config reads as the
WNA16 MoE scheme for the routed experts only."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "prediction"))  # its library, kimi.py
spec = importlib.util.spec_from_file_location("w4a16", ROOT / "bench" / "prediction" / "w4a16.py")
w4a16 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w4a16)

ct = pytest.importorskip("compressed_tensors")


def ct_args(group_size: int = 32):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=group_size)


def ct_compress(w: torch.Tensor, args) -> tuple[dict, torch.Tensor]:
    """compressed-tensors' own: min-max scales per group, then its pack compressor."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    g = w.view(w.shape[0], -1, args.group_size)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
    comp = PackedQuantizationCompressor.__new__(PackedQuantizationCompressor)
    return comp.compress_weight(w, scale, args, zero_point=zp), scale


def ct_decompress(packed: dict, args) -> torch.Tensor:
    from compressed_tensors.compressors import PackedQuantizationCompressor

    comp = PackedQuantizationCompressor.__new__(PackedQuantizationCompressor)
    return comp.decompress_weight(packed, args)


def test_quantize_pack_and_dequantize_are_compressed_tensors_bit_for_bit():
    torch.manual_seed(0)
    w = (torch.randn(96, 256) * 0.05).to(torch.bfloat16)
    w[3, 64:96] = 0  # an all-zero group: compressed-tensors' eps scale
    w[5, :32] = torch.linspace(-1, 1, 32).to(torch.bfloat16)  # halves, clamp edges
    q, scale = w4a16.quantize(w, 32)
    want, want_scale = ct_compress(w, ct_args())
    assert torch.equal(scale, want_scale.to(scale.dtype))
    assert q.min() >= -8 and q.max() <= 7 and q.dtype == torch.int8
    assert torch.equal(w4a16.pack(q), want["weight_packed"])
    assert want["weight_packed"].shape == (96, 256 // 8)
    deq = w4a16.dequantize(q, scale)
    got = ct_decompress({"weight_packed": w4a16.pack(q), "weight_scale": scale,
                         "weight_shape": torch.tensor(w.shape)}, ct_args())
    assert torch.equal(deq, got.to(deq.dtype))
    # and it is a 4-bit approximation of w, not something else
    assert (deq.float() - w.float()).abs().max() <= scale.float().max() / 2 + 1e-6
    assert torch.equal(deq[3, 64:96], torch.zeros(32, dtype=deq.dtype))


def test_a_group_size_that_does_not_divide_the_input_is_refused():
    with pytest.raises(ValueError, match="multiple of the group size"):
        w4a16.quantize(torch.zeros(4, 48, dtype=torch.bfloat16), 32)


def test_the_checkpoint_decodes_to_the_reference_and_vllm_reads_its_scheme(tmp_path):
    from safetensors.torch import load_file

    from eagle3_extract.models.tiny import build_tiny_model

    src = build_tiny_model("deepseek_v3")
    packed, ref = tmp_path / "w4a16", tmp_path / "ref"
    got = w4a16.convert(src, packed, ref, 32, device="cpu")
    n_moe = 8 - 1  # layers; the first is dense
    assert got["expert_matrices"] == n_moe * 8 * 3
    orig = {}
    for f in src.glob("*.safetensors"):
        orig.update(load_file(f))
    p = {k: v for f in packed.glob("*.safetensors") for k, v in load_file(f).items()}
    r = {k: v for f in ref.glob("*.safetensors") for k, v in load_file(f).items()}
    assert set(r) == set(orig)
    experts = [k for k in orig if w4a16.EXPERT.match(k)]
    assert len(experts) == got["expert_matrices"]
    for k in orig:
        if k in experts:
            base = k.removesuffix(".weight")
            dec = ct_decompress({s: p[f"{base}.{s}"] for s in
                                 ("weight_packed", "weight_scale", "weight_shape")}, ct_args())
            assert torch.equal(dec.to(r[k].dtype), r[k]), k
            assert not torch.equal(r[k], orig[k])  # really quantized
            assert k not in p
        else:  # attention, shared experts, the dense layer, router, norms, embeddings
            assert torch.equal(p[k], orig[k]) and torch.equal(r[k], orig[k]), k
    assert any(".shared_experts." in k for k in p) and any(".mlp.gate.weight" in k for k in p)

    cfg = json.loads((packed / "config.json").read_text())
    assert "quantization_config" not in json.loads((ref / "config.json").read_text())
    assert (packed / "tokenizer.json").exists() or (packed / "tokenizer_config.json").exists()

    from compressed_tensors.quantization import QuantizationConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E501
        CompressedTensorsConfig,
    )

    QuantizationConfig.model_validate(cfg["quantization_config"])
    vcfg = CompressedTensorsConfig.from_config(cfg["quantization_config"])
    scheme = vcfg.target_scheme_map["Linear"]
    assert vcfg._is_wNa16_group_channel(scheme["weights"], scheme["input_activations"])
    assert scheme["weights"].group_size == 32
    assert (scheme["format"] or vcfg.quant_format) == "pack-quantized"  # get_scheme_dict's
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
        should_ignore_layer,
    )

    ignore = vcfg.ignore
    for name, want in (("model.layers.1.self_attn.fused_qkv_a_proj", True),
                       ("model.layers.1.self_attn.o_proj", True),
                       ("model.layers.1.mlp.shared_experts.gate_up_proj", True),
                       ("model.layers.0.mlp.gate_up_proj", True),
                       ("model.layers.0.mlp.down_proj", True),
                       ("lm_head", True),
                       ("model.layers.1.mlp.experts", False)):
        mapping = {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
                   "gate_up_proj": ["gate_proj", "up_proj"]}
        assert should_ignore_layer(name, ignore=ignore, fused_mapping=mapping) is want, name
