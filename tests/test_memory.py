"""The capture's device memory beside vLLM's share (engine/memory.py): the plan's
arithmetic, the headline job on 96 GB cards, and the preflight refusal. The cards are
fixtures (this machine has no NVIDIA driver); the engine tests check on the real engine
that the worker allocates exactly what the plan says (engine/vllm.py, _setup_capture)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from eagle3_extract.cli import conf_dir
from eagle3_extract.engine import memory
from eagle3_extract.engine.memory import Card, capture_plan, check_capture_memory, check_fits
from eagle3_extract.errors import PreflightError

GB = 10**9
KIMI = SimpleNamespace(hidden_size=7168, dtype=torch.bfloat16)  # Kimi-K2.5's text backbone


def compose_cfg(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def capture(cfg, *args, **kw):
    """check_capture_memory on a composed job config's own groups."""
    return check_capture_memory(cfg.engine, cfg.model, *args, **kw)


def cards(n: int, total: int = 96 * GB, used: int = 0) -> list[Card]:
    return [Card(i, total, total - used) for i in range(n)]


def test_the_plan_is_what_the_worker_allocates():
    p = capture_plan(32768, 4, 7168, 2)
    rows = 32768 + memory.CAPTURE_SLACK_ROWS
    assert p.rows == rows
    assert p.states_bytes == 2 * rows * 4 * 7168 * 2  # two buffers: copy overlaps prefill
    assert p.held_bytes == p.states_bytes + rows * (8 + 1) + 8 and p.transient_bytes == 0
    fp8 = capture_plan(32768, 4, 7168, 2, scale_cols=1)
    assert fp8.fp8_bytes == rows * 4 * 7168 + rows * 4
    assert fp8.transient_bytes == memory.FP8_CHUNK_ROWS * 4 * 7168 * 4  # float32 chunk
    assert round(p.peak_bytes / memory.GIB, 2) == 3.61
    assert round(fp8.peak_bytes / memory.GIB, 2) == 4.95


def test_the_headline_job_fits_on_96_gb_cards_and_the_limit_is_named():
    # the preset's default layout is pp8 (every card is its stage's capturing rank); the
    # tightest case is tp8's, where rank 0 captures all four layers beside 1/8 of the model
    ids = [2, 30, 58, 61]
    pp8 = compose_cfg("experiment=kimi_k25_chat")
    assert (pp8.model.tensor_parallel_size, pp8.model.pipeline_parallel_size) == (1, 8)
    assert capture(pp8, KIMI, ids, 0, cards=cards(8)).rows == 33792
    cfg = compose_cfg("experiment=kimi_k25_chat", "layout=tp8")
    assert cfg.engine.token_budget == 32768 and cfg.model.tensor_parallel_size == 8
    plan = capture(cfg, KIMI, ids, 0, cards=cards(8))
    assert plan is not None and plan.rows == 33792
    fp8 = capture(cfg, KIMI, ids, 1, cards=cards(8))
    assert fp8.peak_bytes > plan.peak_bytes
    # vLLM asked for 95% of the card: 4.8 GB left, 1 GiB of it CUDA context
    tight = compose_cfg("experiment=kimi_k25_chat", "layout=tp8",
                        "model.gpu_memory_utilization=0.95")
    with pytest.raises(ValueError) as e:
        capture(tight, KIMI, ids, 0, cards=cards(8))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("GPU 0:")
    assert "the capture needs 3.61 GiB more on this rank" in msg
    # each suggested fix fits
    util = float(msg.split("lower model.gpu_memory_utilization to ")[1].split()[0])
    budget = int(msg.split("lower engine.token_budget to ")[1])
    assert capture(compose_cfg("experiment=kimi_k25_chat", "layout=tp8",
                                            f"model.gpu_memory_utilization={util}"),
                                KIMI, ids, 0, cards=cards(8))
    assert budget % 1024 == 0 and capture(
        compose_cfg("experiment=kimi_k25_chat", "layout=tp8",
                    "model.gpu_memory_utilization=0.95", f"engine.token_budget={budget}"), KIMI, ids, 0, cards=cards(8))


def test_only_rank_0_of_each_stage_captures():
    plan = capture_plan(32768, 4, 7168, 2)
    # 40 GB used by another process on card 1 (not a capturing rank at TP=8): vLLM's own
    # share no longer fits there
    busy = cards(8)
    busy[1] = Card(1, 96 * GB, 56 * GB)
    why = check_fits(plan, busy, 0.85, tp=8, pp=1)
    assert why.startswith("GPU 1:") and "free the GPU" in why
    # TP=4 x PP=2: cards 0 and 4 capture; a card that fits vLLM only is fine elsewhere
    tight = [Card(i, 96 * GB, 96 * GB - (4 * GB if i % 4 else 0)) for i in range(8)]
    assert check_fits(plan, tight, 0.85, tp=4, pp=2) is None
    tight[4] = Card(4, 96 * GB, 86 * GB)
    assert check_fits(plan, tight, 0.85, tp=4, pp=2).startswith("GPU 4:")
    assert "8 GPUs, 4 visible" in check_fits(plan, cards(4), 0.85, tp=8, pp=1)


def test_cpu_runs_and_hosts_without_a_driver_are_not_checked():
    cfg = compose_cfg("engine.device=cpu")
    assert capture(cfg, KIMI, [1, 2], 0, cards=cards(1, total=GB)) is None
    assert capture(compose_cfg("engine=hf"), KIMI, [1, 2], 0,
                                cards=cards(1, total=GB)) is None
    assert memory.visible_cards() is None  # no NVIDIA driver here: NVML does not start


def test_preflight_refuses_a_plan_that_cannot_fit_before_the_engine_starts(tmp_path,
                                                                          monkeypatch):
    from eagle3_extract.extract import job

    monkeypatch.setattr(memory, "visible_cards", lambda: cards(1, total=int(1.5 * memory.GIB)))
    cfg = compose_cfg(f"output.dir={tmp_path / 'out'}", "model.gpu_memory_utilization=0.5")
    with pytest.raises(PreflightError, match=r"^GPU 0: .* lower model\.gpu_memory_util"):
        job.preflight(cfg)
    assert not (tmp_path / "out" / "run.json").exists()  # refused before anything was written
