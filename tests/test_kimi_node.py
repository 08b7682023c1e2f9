"""Kimi-K2.5 at the user's scale: the shapes one card holds, the length mix, the node model
(bench/prediction/kimi_shapes.py, bench/throughput/mix.py, bench/prediction/predict_node.py; issue 37)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench" / "prediction"), str(ROOT / "bench" / "throughput")]

import kimi as ks  # noqa: E402
import length_mix as mix  # noqa: E402
import predict_node as pn  # noqa: E402


def test_the_whole_model_is_kimi_k25_int4s_595_gb():
    full = sum(ks.layer_bytes(dense=i == 0) for i in range(ks.LAYERS)) + \
        2 * ks.KIMI["vocab_size"] * ks.KIMI["hidden_size"] * 2
    assert 590e9 < full < 600e9  # users-ground.md: about 595 GB
    # eight ranks of one layer hold one layer's weights, less MLA's replicated projections
    h = ks.KIMI["hidden_size"]
    replicated = (h * ks.KIMI["q_lora_rank"] + h * (ks.KIMI["kv_lora_rank"] + 64)) * 2
    router = ks.KIMI["n_routed_experts"] * h * 2
    assert 8 * ks.layer_bytes(tp=8) - ks.layer_bytes() == 7 * (replicated + router)


def test_a_tp_rank_cuts_what_vllm_shards_and_keeps_what_it_replicates():
    r = ks.rank_config(8)
    assert (r["num_attention_heads"], r["intermediate_size"], r["moe_intermediate_size"],
            r["vocab_size"]) == (8, 2304, 256, 20480)
    assert (r["q_lora_rank"], r["kv_lora_rank"], r["hidden_size"], r["n_routed_experts"],
            r["num_hidden_layers"]) == (1536, 512, 7168, 384, 61)
    assert r["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert r["rope_scaling"]["type"] == "yarn" and r["max_position_embeddings"] >= 8192
    s = ks.stage_config(8)
    assert s["num_attention_heads"] == 64 and s["first_k_dense_replace"] == 0
    assert 75e9 < ks.weights_of(r) < 78e9 and 80e9 < ks.weights_of(s) < 85e9
    with pytest.raises(ValueError, match="tp=3"):
        ks.rank_config(3)


def test_every_layout_is_near_an_eighth_of_the_model():
    assert ks.layouts() == [(1, 8), (2, 4), (4, 2), (8, 1)]
    for tp, pp in ks.layouts():
        assert 74e9 < ks.card_bytes(tp, pp) < 82e9, (tp, pp)
    assert ks.stage_layers(8) == [7, 7, 8, 8, 8, 8, 8, 7] and ks.stage_layers(4) == [15, 15, 16, 15]


def test_the_mix_adds_up_and_is_seeded():
    a, b = mix.lengths(200_000, 0), mix.lengths(200_000, 0)
    assert a == b and sum(a) >= 200_000 and sum(a[:-1]) < 200_000
    assert min(a) >= mix.MIN_TOKENS and max(a) <= mix.MAX_TOKENS
    d = mix.describe(mix.lengths(1_000_000, 0))
    assert 1500 < d["mean"] < 3500 and d["p90"] > 2 * d["p50"]  # a long tail of reasoning


def figures(tmp_path: Path, name: str, layers: int, prefill: float, job: float) -> Path:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps({
        "model": {"num_layers": layers}, "data": {"tokens": 1_000_000, "repeats": 4},
        "phases": {"prefill": {"tok_s": prefill}, "extract_disk": {"tok_s": job}},
        "memory": {"activation_peak_gb": 5.0}}))
    return p


def test_the_node_model_from_a_rank_and_a_stage(tmp_path):
    # a rank of 61 layers at 1/8 and a stage of 8 full layers, per-layer times 1 us and 6 us
    rank = pn.measured(figures(tmp_path, "rank", 61, 1 / (61e-6), 0.99 / (61e-6)))
    stage = pn.measured(figures(tmp_path, "stage", 8, 1 / (48e-6), 0.985 / (48e-6)))
    a, b = pn.layer_model(stage, rank)
    assert a + b == pytest.approx(6e-6) and a + b / 8 == pytest.approx(1e-6)
    r = pn.report(rank, stage)
    rows = {x["layout"]: x for x in r["layouts"]}
    assert r["job_vs_prefill"] == pytest.approx(0.985)
    # TP=8: two all-reduces per layer, 7/4 of 14,336 B each over every card's link
    tp8 = rows["tp8_pp1"]
    assert tp8["comm_bytes_per_token"]["allreduce_per_card"] == pytest.approx(
        61 * 2 * 2 * 7 / 8 * 7168 * 2)
    assert rows["tp1_pp8"]["comm_bytes_per_token"] == {"allreduce_per_card": 0.0,
                                                        "stage_send": 2 * 7168 * 2}
    scale = pn.MEASURED_CARD["bf16_tflops"] / pn.NODE["card_bf16_tflops"]
    pp8 = rows["tp1_pp8"]
    assert pp8["tok_s"] == pytest.approx(
        pn.PP_EFFICIENCY * 0.985 / (8 * 6e-6 * scale + 2 * 7168 * 2 / 25e9))
    assert all(x["tok_s_low"] <= x["tok_s"] for x in rows.values())
    assert r["best"] in rows and rows[r["best"]]["fits"]
    # slower links only hurt the layouts that all-reduce
    slow = pn.report(rank, stage, {**pn.NODE, "link_gbs": 10.0})
    slow_rows = {x["layout"]: x for x in slow["layouts"]}
    assert slow_rows["tp8_pp1"]["tok_s"] < tp8["tok_s"]
    assert slow_rows["tp1_pp8"]["tok_s"] == pytest.approx(pp8["tok_s"])


def test_predict_node_says_which_figure_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit, match="rank.json is missing"):
        pn.main(["--rank", str(tmp_path / "rank.json"), "--stage", str(tmp_path / "s.json")])
