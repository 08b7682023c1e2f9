"""Kimi-K2.5's text backbone cut as one GPU of a TP x PP layout holds it.

    python3 bench/kimi_shapes.py rank OUT_DIR [--tp 8] [--layers 61]    # one TP rank, whole depth
    python3 bench/kimi_shapes.py stage OUT_DIR [--layers 8]             # one PP stage, full width
    python3 bench/kimi_shapes.py bytes                                   # per-card weights, each layout

Nobody here has the user's eight cards, so what one card of theirs runs is built on one
card here: a DeepseekV3 config (`load_format=dummy`: no checkpoint) whose every tensor has
the shape that card holds. A TP rank keeps MLA's replicated down-projections (q_a, kv_a)
whole and cuts what vLLM's tensor parallel linears shard (heads of q_b / kv_b / o, the
dense and shared MLPs' width, each routed expert's width, the vocabulary); a PP stage is
whole layers. The routed experts are compressed-tensors W4A16 as the INT4 checkpoint
ships them (bench/w4a16.py's quantization_config: int4, groups of 32, symmetric).
`card_bytes` is the same arithmetic as a weight count, for bench/predict_node.py's fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from w4a16 import quantization_config  # noqa: E402

LAYERS, GROUP = 61, 32
BASE = json.loads((ROOT / "bench/configs/kimi_k25_l4.json").read_text())
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rank")
    r.add_argument("out", type=Path)
    r.add_argument("--tp", type=int, default=8)
    r.add_argument("--layers", type=int, default=LAYERS)
    s = sub.add_parser("stage")
    s.add_argument("out", type=Path)
    s.add_argument("--layers", type=int, default=8)
    sub.add_parser("bytes")
    args = ap.parse_args(argv)
    if args.cmd == "bytes":
        full = sum(layer_bytes(dense=i == 0) for i in range(LAYERS)) + \
            2 * KIMI["vocab_size"] * KIMI["hidden_size"] * 2
        print(json.dumps({"model_gb": round(full / 1e9, 1), **{
            f"tp{tp}_pp{pp}_card_gb": round(card_bytes(tp, pp) / 1e9, 1)
            for tp, pp in layouts()}}))
        return 0
    cfg = rank_config(args.tp, args.layers) if args.cmd == "rank" else stage_config(args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    print(json.dumps({"config": str(args.out / "config.json"),
                      "weights_gb": round(weights_of(cfg) / 1e9, 2)}))
    return 0


def weights_of(cfg: dict) -> int:
    """The weights a config built by rank_config / stage_config holds on its card."""
    shape = cfg["eagle3_extract_shape"]
    tp = shape.get("tp", 1)
    dense = min(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
    return (dense * layer_bytes(tp, dense=True)
            + (cfg["num_hidden_layers"] - dense) * layer_bytes(tp)
            + 2 * cfg["vocab_size"] * cfg["hidden_size"] * 2)


if __name__ == "__main__":
    sys.exit(main())
