"""The user's node predicted from one card: Kimi-K2.5 extraction tok/s per TP x PP layout.

    python3 bench/prediction/predict_node.py [--rank docs/bench/...-kimi-rank.json]
                                  [--stage docs/bench/...-kimi-stage.json] [--json OUT]

Nobody here has 8 RTX PRO 6000s, so the node's figure is a model fed by what one GPU
measured (bench/device/steps/kimi.sh: bench/throughput/run.py on a TP=8 rank, layers at 1/8 width, and
on a PP=8 stage of full-width layers; per layer, so a card too small for 61 or 8 runs fewer, the job's extraction to disk on the same engine as
plain prefill) and by the node's published numbers (`NODE`, every value in one table in
docs/BENCHMARKS.md). The model, per token:

  * a layer's time on a card holding 1/t of its width is a + b/t: a part that does not
    shrink with width (launches, routing, norms, MLA's replicated down-projections) and one
    that does; the stage (t=1) and the rank (t=8) fix a and b;
  * the measuring card's seconds become the node's card's by the ratio of dense bf16 tensor throughput
    (prefill at 32k-token batches is compute-bound); the memory-bandwidth ratio gives the
    pessimistic figure;
  * tensor parallelism adds two all-reduces of hidden x 2 bytes per layer, a ring moving
    2 (t-1)/t of them over each card's link, not overlapped with compute (vLLM 0.16
    runs them in line); pipeline parallelism adds one send of the hidden state and the
    residual per stage boundary, and keeps pp batches in flight, at `PP_EFFICIENCY`;
  * a layout's tok/s = PP_EFFICIENCY^(pp>1) / (its slowest stage's compute + comms),
    times the job-vs-prefill ratio measured on the card;
  * it fits when the heaviest card's weights (bench/prediction/kimi_shapes.py) plus the measured
    activation peak, the capture's buffers, the CUDA context and a batch's KV cache stay
    under `gpu_memory_utilization` x 96 GB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kimi as ks

ROOT = Path(__file__).resolve().parents[2]

GB = 1e9
# The node and the card measured on (public specifications; docs/BENCHMARKS.md says where)
NODE = {
    "cards": 8,
    "card_memory_gb": 96.0,  # RTX PRO 6000 Blackwell, GDDR7
    "card_bf16_tflops": 503.8,  # dense bf16 tensor, fp32 accumulate (4,000 FP4 TOPS sparse / 8)
    "card_mem_bw_gbs": 1792.0,
    "link_gbs": 40.0,  # NCCL ring bus bandwidth per card over PCIe Gen5 x16, no NVLink (of 64)
    "p2p_gbs": 25.0,  # one stage-to-stage send through the host (no P2P assumed)
    "allreduce_latency_us": 30.0,  # per NCCL all-reduce over PCIe
    "disk_gbs": 2.0,  # the node's output filesystem, sustained writes
}
# the card the figures come from: the device tool lent an H100 SXM (80 GB) on 2026-12-06
MEASURED_CARD = {"name": "H100 SXM", "bf16_tflops": 989.0, "mem_bw_gbs": 3350.0}
GPU_MEMORY_UTILIZATION = 0.95  # vLLM's share; the capture and the context live in the rest
PP_EFFICIENCY = 0.9  # pp batches in flight: stage imbalance beyond layer counts, bubbles
TOKEN_BUDGET = 32768  # the preset's engine.token_budget: tokens per forward step
CAPTURE_LAYERS = 4  # [2, 30, 58, 61]
CONTEXT_GB = 1.0  # engine/memory.py's CONTEXT_BYTES
KV_BYTES_PER_TOKEN_LAYER = (512 + 64) * 2  # MLA's latent cache, bf16, replicated over TP
DEFAULT_RANK = ROOT / "docs/bench/2026-12-06-h100-kimi-k25-tp8-rank.json"
DEFAULT_STAGE = ROOT / "docs/bench/2026-12-06-h100-kimi-k25-pp8-stage.json"


def measured(path: Path) -> dict:
    """What a bench/throughput/run.py figure says per token: seconds per layer, the job ratio."""
    r = json.loads(path.read_text())
    layers = r["model"]["num_layers"]
    prefill = r["phases"]["prefill"]["tok_s"]
    job = r["phases"]["extract_disk"].get("steady_tok_s") or r["phases"]["extract_disk"]["tok_s"]
    return {"file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "layers": layers, "prefill_tok_s": prefill, "job_tok_s": job,
            "job_vs_prefill": job / prefill, "layer_s": 1.0 / prefill / layers,
            "tokens": r["data"]["tokens"], "repeats": r["data"]["repeats"],
            "activation_gb": (r.get("memory") or {}).get("activation_peak_gb")}


def layer_model(stage: dict, rank: dict, rank_tp: int = 8) -> tuple[float, float]:
    """(a, b) of layer_s(t) = a + b / t from the stage (t=1) and the rank (t=rank_tp)."""
    t1, tn = stage["layer_s"], rank["layer_s"]
    b = (t1 - tn) * rank_tp / (rank_tp - 1)
    a = t1 - b
    if a < 0:  # the rank scaled better than linear: no fixed part
        a, b = 0.0, t1
    return a, b


def predict(tp: int, pp: int, a: float, b: float, job_ratio: float, activation_gb: float,
            node: dict = NODE) -> dict:
    hidden = ks.KIMI["hidden_size"]
    compute_scale = MEASURED_CARD["bf16_tflops"] / node["card_bf16_tflops"]
    bw_scale = MEASURED_CARD["mem_bw_gbs"] / node["card_mem_bw_gbs"]
    layers = max(ks.stage_layers(pp))
    layer_s = a + b / tp
    compute = layers * layer_s
    ar_bytes = 2 * layers * 2 * (tp - 1) / tp * hidden * 2 if tp > 1 else 0.0
    ar_s = ar_bytes / (node["link_gbs"] * GB) + (
        2 * layers * node["allreduce_latency_us"] * 1e-6 / TOKEN_BUDGET if tp > 1 else 0.0)
    send_bytes = 2 * hidden * 2 if pp > 1 else 0.0  # hidden state + residual, bf16
    send_s = send_bytes / (node["p2p_gbs"] * GB)
    eff = PP_EFFICIENCY if pp > 1 else 1.0

    def rate(scale: float) -> float:
        return eff / (compute * scale + ar_s + send_s) * job_ratio

    weights = ks.card_bytes(tp, pp) / GB
    capture_layers = 2 if pp > 1 else CAPTURE_LAYERS  # the last stage holds 58 and 61
    capture = (TOKEN_BUDGET + 1024) * capture_layers * hidden * 2 * 2 / GB
    kv = TOKEN_BUDGET * layers * KV_BYTES_PER_TOKEN_LAYER / GB
    inside = weights + activation_gb + kv  # vLLM's gpu_memory_utilization share
    outside = capture + CONTEXT_GB  # engine/memory.py: beside it
    room = GPU_MEMORY_UTILIZATION * node["card_memory_gb"]
    rest = node["card_memory_gb"] - room
    tok_s = rate(compute_scale)
    return {"layout": f"tp{tp}_pp{pp}", "tp": tp, "pp": pp, "stage_layers": layers,
            "tok_s": tok_s, "tok_s_low": min(tok_s, rate(bw_scale)),
            "compute_us_per_token": compute * compute_scale * 1e6,
            "comm_bytes_per_token": {"allreduce_per_card": ar_bytes, "stage_send": send_bytes},
            "comm_us_per_token": (ar_s + send_s) * 1e6,
            "card_gb": {"weights": weights, "activations": activation_gb, "kv_one_batch": kv,
                        "capture": capture, "context": CONTEXT_GB, "need": inside + outside,
                        "vllm_share": inside, "vllm_room": room, "beside": outside,
                        "beside_room": rest},
            "fits": inside <= room and outside <= rest,
            "disk_gbs_needed": tok_s * CAPTURE_LAYERS * hidden * 2 / GB}


def report(rank: dict, stage: dict, node: dict = NODE) -> dict:
    a, b = layer_model(stage, rank)
    ratio = min(rank["job_vs_prefill"], stage["job_vs_prefill"])
    act = max(x["activation_gb"] or 0.0 for x in (rank, stage)) or 6.0
    rows = [predict(tp, pp, a, b, ratio, act, node) for tp, pp in ks.layouts(node["cards"])]
    fitting = [r for r in rows if r["fits"]]
    best = max(fitting, key=lambda r: r["tok_s"]) if fitting else None
    return {"measured": {"rank": rank, "stage": stage}, "layer_s": {"a": a, "b": b},
            "job_vs_prefill": ratio, "activation_gb": act, "node": node, "measured_card": MEASURED_CARD,
            "pp_efficiency": PP_EFFICIENCY, "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "layouts": rows, "best": best and best["layout"], "user_tp8_tok_s": 2280,
            "goal_tok_s": 22800}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=Path, default=DEFAULT_RANK)
    ap.add_argument("--stage", type=Path, default=DEFAULT_STAGE)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    for p in (args.rank, args.stage):
        if not p.is_file():
            raise SystemExit(f"predict_node: {p} is missing: bring it back from the kimi "
                             "step (docs/gpu.md) or pass --rank / --stage")
    r = report(measured(args.rank), measured(args.stage))
    m = r["measured"]
    print(f"measured on the {MEASURED_CARD['name']}: rank {m['rank']['prefill_tok_s']:,.0f} tok/s prefill "
          f"({m['rank']['layers']} layers at 1/8), stage {m['stage']['prefill_tok_s']:,.0f} "
          f"({m['stage']['layers']} full layers); job/prefill {r['job_vs_prefill']:.3f}")
    print(f"{'layout':10s} {'tok/s':>8s} {'low':>8s} {'comm B/tok':>11s} {'comm us':>8s} "
          f"{'card GB':>8s} {'fits':>5s}")
    for x in r["layouts"]:
        comm = sum(x["comm_bytes_per_token"].values())
        print(f"{x['layout']:10s} {x['tok_s']:8,.0f} {x['tok_s_low']:8,.0f} {comm:11,.0f} "
              f"{x['comm_us_per_token']:8.2f} {x['card_gb']['need']:8.1f} "
              f"{'yes' if x['fits'] else 'no':>5s}")
    print(f"fastest that fits: {r['best']}  (user's TP=8: 2,280 tok/s; goal 22,800)")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
