"""Kimi-K2.5's text backbone as the user's cards hold it, and its INT4 format: the shapes
kimi_shapes.py writes, the weights per card predict_node.py fits, and the compressed-tensors
W4A16 config w4a16.py and kimi_shapes.py put in a checkpoint (a library: no script here
imports another script).

A TP rank keeps MLA's replicated down-projections (q_a, kv_a) whole and cuts what vLLM's
tensor parallel linears shard (heads of q_b / kv_b / o, the dense and shared MLPs' width,
each routed expert's width, the vocabulary); a PP stage is whole layers. The routed
experts are compressed-tensors W4A16 as the INT4 checkpoint ships them (int4, groups of
32, symmetric).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BITS = 4


def quantization_config(group_size: int) -> dict:
    """What Kimi-K2's INT4 releases carry (routed experts only), for this group size."""
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {"num_bits": BITS, "type": "int", "symmetric": True,
                        "strategy": "group", "group_size": group_size, "dynamic": False,
                        "actorder": None, "observer": "minmax", "observer_kwargs": {},
                        "block_structure": None}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    }


LAYERS, GROUP = 61, 32
BASE = json.loads((ROOT / "bench/throughput/configs/kimi_k25_l4.json").read_text())
# users-ground.md; the context as Kimi-K2's 256k releases set it (yarn over 4k, factor 64)
KIMI = {**BASE, "num_hidden_layers": LAYERS, "n_routed_experts": 384,
        "max_position_embeddings": 262144,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0}}


def rank_config(tp: int = 8, layers: int = LAYERS) -> dict:
    """One TP rank of `tp`, `layers` deep (the first dense, as Kimi-K2.5's)."""
    def cut(n: int) -> int:
        if n % tp:
            raise ValueError(f"{n} does not split over tp={tp}")
        return n // tp
    return {**KIMI, "num_hidden_layers": layers,
            "num_attention_heads": cut(KIMI["num_attention_heads"]),
            "num_key_value_heads": cut(KIMI["num_key_value_heads"]),
            "intermediate_size": cut(KIMI["intermediate_size"]),
            "moe_intermediate_size": cut(KIMI["moe_intermediate_size"]),
            "vocab_size": cut(KIMI["vocab_size"]),
            "quantization_config": quantization_config(GROUP),
            "eagle3_extract_shape": {"kind": "tp_rank", "tp": tp, "layers": layers}}


def stage_config(layers: int = 8) -> dict:
    """One PP stage: `layers` full-width MoE layers (a middle stage's body), with the
    embedding and the head both (a real stage has one of them or none)."""
    return {**KIMI, "num_hidden_layers": layers, "first_k_dense_replace": 0,
            "quantization_config": quantization_config(GROUP),
            "eagle3_extract_shape": {"kind": "pp_stage", "layers": layers}}


def layer_bytes(tp: int = 1, dense: bool = False) -> int:
    """Weights of one decoder layer on one of `tp` ranks (bf16, experts int4 + bf16 scales)."""
    c, bf16 = KIMI, 2
    h, heads = c["hidden_size"], c["num_attention_heads"] // tp
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    replicated = h * c["q_lora_rank"] + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
    sharded = (c["q_lora_rank"] * heads * qk
               + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
               + heads * c["v_head_dim"] * h)
    attn = (replicated + sharded) * bf16
    if dense:
        return attn + 3 * h * c["intermediate_size"] // tp * bf16
    w = c["moe_intermediate_size"] // tp
    expert = 3 * h * w  # gate, up, down
    experts = c["n_routed_experts"] * (expert // 2 + expert // GROUP * bf16)
    shared = c["n_shared_experts"] * expert * bf16
    router = c["n_routed_experts"] * h * bf16
    return attn + experts + shared + router


def stage_layers(pp: int, layers: int = LAYERS) -> list[int]:
    """vLLM 0.16's split (vllm/distributed/utils.py, get_pp_indices): layers // pp each,
    one more for each of the `layers % pp` stages before the last."""
    counts = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        counts[-i] += 1
    return counts


def card_bytes(tp: int, pp: int) -> int:
    """The heaviest card's weights in a tp x pp layout: vLLM's stage split, the embedding
    on the first stage, the head on the last, each cut over tp."""
    counts = stage_layers(pp)
    vocab = KIMI["vocab_size"] // tp * KIMI["hidden_size"] * 2
    worst = 0
    for i, n in enumerate(counts):
        dense = 1 if i == 0 else 0  # the first layer is dense
        b = layer_bytes(tp, dense=True) * dense + layer_bytes(tp) * (n - dense)
        b += vocab * ((i == 0) + (i == pp - 1))
        worst = max(worst, b)
    return worst


def layouts(cards: int = 8) -> list[tuple[int, int]]:
    """Every tp x pp = cards with tp dividing the 64 heads."""
    return [(tp, cards // tp) for tp in (1, 2, 4, 8) if cards % tp == 0
            and KIMI["num_attention_heads"] % tp == 0 and tp <= cards]


def weights_of(cfg: dict) -> int:
    """The weights a config built by rank_config / stage_config holds on its card."""
    shape = cfg["eagle3_extract_shape"]
    tp = shape.get("tp", 1)
    dense = min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    return (dense * layer_bytes(tp, dense=True)
            + (cfg["num_hidden_layers"] - dense) * layer_bytes(tp)
            + 2 * cfg["vocab_size"] * cfg["hidden_size"] * 2)
