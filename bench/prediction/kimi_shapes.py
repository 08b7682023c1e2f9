"""Kimi-K2.5's text backbone cut as one GPU of a TP x PP layout holds it.

    python3 bench/prediction/kimi_shapes.py rank OUT_DIR [--tp 8] [--layers 61]    # one TP rank, whole depth
    python3 bench/prediction/kimi_shapes.py stage OUT_DIR [--layers 8]             # one PP stage, full width
    python3 bench/prediction/kimi_shapes.py bytes                                   # per-card weights, each layout

Nobody here has the user's eight cards, so what one card of theirs runs is built on one
card here: a DeepseekV3 config (`load_format=dummy`: no checkpoint) whose every tensor has
the shape that card holds. A TP rank keeps MLA's replicated down-projections (q_a, kv_a)
whole and cuts what vLLM's tensor parallel linears shard (heads of q_b / kv_b / o, the
dense and shared MLPs' width, each routed expert's width, the vocabulary); a PP stage is
whole layers. The routed experts are compressed-tensors W4A16 as the INT4 checkpoint
ships them (bench/prediction/w4a16.py's quantization_config: int4, groups of 32, symmetric).
`card_bytes` is the same arithmetic as a weight count, for bench/prediction/predict_node.py's fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kimi import (KIMI, LAYERS, card_bytes, layer_bytes, layouts, rank_config, stage_config,
                  weights_of)


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


if __name__ == "__main__":
    sys.exit(main())
