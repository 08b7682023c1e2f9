"""output.dtype=fp8 on the real components: the vLLM 0.16 CPU engine quantizes before the
device-to-host copy, the files are speculators 0.9.0's fp8 layout (its own hs_connectors
reads them, in its own environment), validate/verify/export read them, the trainer trains
on them. The acceptance parity on the real SmolLM2 is docs/QUALITY.md's (make e2e).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from test_job import compose_cfg, data_files, load_st, run_cli

from eagle3_extract.quant import FP8, SCALES_KEY, dequantize, quantize

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / ".venv-train" / "bin" / "python"
SAMPLES = 6


def _train_env_run(script: str, *args: str) -> str:
    assert TRAIN_PY.exists(), "make venv-train builds the trainer's environment"
    r = subprocess.run([str(TRAIN_PY), "-c", script, *args], capture_output=True, text=True,
                       timeout=600, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


HS_CONNECTORS_QUANTIZE = """
import sys, torch
from safetensors.torch import load_file
from hs_connectors.fp8_utils import quantize_tensor_to_fp8, dequantize_fp8_tensor
t = load_file(sys.argv[1])
q, s = quantize_tensor_to_fp8(t["x"])
assert torch.equal(q.view(torch.uint8), t["q"].view(torch.uint8)), "fp8 bytes differ"
assert torch.equal(s, t["s"]), "scales differ"
# their dequantize broadcasts a per-token-and-layer scale just the same
for q_, s_, name in ((t["q"], t["s"], "d"), (t["ql"], t["sl"], "dl")):
    assert torch.equal(dequantize_fp8_tensor(q_, s_), t[name]), name
print("same bytes as hs_connectors")
"""


@pytest.mark.trainer
def test_quantize_is_hs_connectors_bit_for_bit(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    # layer magnitudes four orders apart, an outlier channel, an all-zero row
    x = torch.randn(37, 4, 64) * torch.tensor([0.05, 1.0, 30.0, 500.0])[None, :, None]
    x[:, 2, 7] *= 80
    x[5] = 0
    x = x.to(torch.bfloat16)
    q, s = quantize(x)
    ql, sl = quantize(x, "token_layer")
    assert q.dtype == FP8 and s.shape == (37, 1, 1) and sl.shape == (37, 4, 1)
    assert torch.isfinite(dequantize(q, s)).all()
    rel = (dequantize(ql, sl) - x.float()).norm(dim=-1) / x.float().norm(dim=-1).clamp_min(1e-6)
    assert float(rel[x.float().norm(dim=-1) > 0].max()) < 0.08  # e4m3: 3 mantissa bits
    save_file({"x": x, "q": q, "s": s, "ql": ql, "sl": sl,
               "d": dequantize(q, s, torch.bfloat16), "dl": dequantize(ql, sl, torch.bfloat16)},
              str(tmp_path / "t.safetensors"))
    assert "same bytes" in _train_env_run(HS_CONNECTORS_QUANTIZE, str(tmp_path / "t.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same tiny-Llama job on vLLM 0.16 (CPU): bf16, fp8 per token, fp8 per layer."""
    from eagle3_extract.extract.job import run

    root = tmp_path_factory.mktemp("fp8")
    common = ("engine=vllm", "engine.distributed_executor_backend=uni",
              f"dataset.max_samples={SAMPLES}", "model.max_model_len=1024",
              "engine.token_budget=2048")
    out = {}
    for name, extra in (("bf16", ()), ("fp8", ("output=fp8",)),
                        ("fp8l", ("output=fp8", "output.fp8_scale=token_layer"))):
        m = run(compose_cfg(*common, *extra, f"output.dir={root / name}"))
        assert m["counts"]["written"] == SAMPLES
        out[name] = root / name
    return out


@pytest.mark.engine
def test_fp8_files_are_the_bf16_states_quantized_on_the_device(runs):
    ref = data_files(runs["bf16"])
    sizes = {"bf16": 0, "fp8": 0, "fp8l": 0}
    for name, scale, shape1 in (("fp8", "token", 1), ("fp8l", "token_layer", 4)):
        files = data_files(runs[name])
        assert sorted(files) == sorted(ref)
        for i, path in files.items():
            t, meta = load_st(path)
            b, _ = load_st(ref[i])
            assert t["hidden_states"].dtype == FP8
            assert t[SCALES_KEY].dtype == torch.float32
            assert tuple(t[SCALES_KEY].shape) == (len(t["input_ids"]), shape1, 1)
            assert torch.equal(t["input_ids"], b["input_ids"])
            assert torch.equal(t["loss_mask"], b["loss_mask"])
            q, s = quantize(b["hidden_states"], scale)  # the same arithmetic on the host
            assert torch.equal(t["hidden_states"].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(t[SCALES_KEY], s)
            sizes[name] += path.stat().st_size
    sizes["bf16"] = sum(p.stat().st_size for p in ref.values())
    print("bytes", sizes, "fp8/bf16", sizes["fp8"] / sizes["bf16"])
    assert sizes["fp8"] <= 0.52 * sizes["bf16"]


@pytest.mark.engine
def test_validate_and_verify_read_fp8_and_catch_bad_scales(runs, tmp_path):
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from eagle3_extract.check import verify
    from eagle3_extract.check.validate import validate

    for name in ("fp8", "fp8l"):
        report = validate(runs[name])
        assert report["ok"], report["problems"][:5]
        assert report["dtype"] == "float8_e4m3fn"
    report = verify.verify(runs["fp8"], references=["hf"], samples=3)
    assert report["ok"], report["failures"]
    assert report["tolerance"]["median"] > verify.TOLERANCES["bfloat16"].median
    assert report["logits"]["required"] == verify.FP8_ARGMAX
    out = tmp_path / "bad"
    shutil.copytree(runs["fp8"], out)
    paths = sorted((out / "data").rglob("*.safetensors"))
    for path, how in zip(paths, ("negative", "missing")):
        t = load_file(path)
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
        if how == "negative":
            t[SCALES_KEY][3] = -1.0
        else:
            del t[SCALES_KEY]
        save_file(t, str(path), metadata=meta)
    report = validate(out)
    assert not report["ok"]
    codes = {(Path(p["where"]).name, p["code"]) for p in report["problems"]}
    assert {(paths[0].name, "scales"), (paths[1].name, "scales")} <= codes, codes


def _data_offset(path: Path, key: str) -> tuple[int, int]:
    """(file offset of tensor `key`'s bytes, their length) in a safetensors file."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    a, b = json.loads(raw[8:8 + n])[key]["data_offsets"]
    return 8 + n + a, b - a


def _poke(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.engine
def test_changed_fp8_scales_and_bytes_fail_validate(runs, tmp_path):
    """Scales changed to other finite, positive values: one token's x16 and flipped bytes
    in the fp8 payload fail the checksum written with the file; a file whose scales were
    all doubled when it was written (checksum consistent) fails the run's scale profile."""
    import shutil
    import struct

    from safetensors import safe_open
    from safetensors.torch import load_file

    from eagle3_extract.layout import CHECKSUM_KEY
    from eagle3_extract.check.validate import validate
    from eagle3_extract.extract.writer import save_safetensors

    out = tmp_path / "bad"
    shutil.copytree(runs["fp8"], out)
    paths = sorted((out / "data").rglob("*.safetensors"))
    at, _ = _data_offset(paths[0], SCALES_KEY)  # token 2's scale x16
    (scale,) = struct.unpack("<f", paths[0].read_bytes()[at + 8:at + 12])
    _poke(paths[0], at + 8, struct.pack("<f", scale * 16))
    at, size = _data_offset(paths[1], "hidden_states")  # a few flipped bytes
    raw = bytearray(paths[1].read_bytes()[at + size // 2:at + size // 2 + 3])
    _poke(paths[1], at + size // 2, bytes(x ^ 0x21 for x in raw))
    t = {k: v.clone() for k, v in load_file(paths[2]).items()}  # every scale doubled, by
    # a writer that then hashed the file (clone: not the mapped file it overwrites)
    with safe_open(str(paths[2]), "pt") as f:
        meta = {k: v for k, v in f.metadata().items() if k != CHECKSUM_KEY}
    t[SCALES_KEY] *= 2
    save_safetensors(t, paths[2], meta)

    report = validate(out)
    assert not report["ok"]
    codes = {(Path(p["where"]).name, p["code"]) for p in report["problems"]}
    assert {(paths[0].name, "checksum"), (paths[1].name, "checksum"),
            (paths[2].name, "scales")} <= codes, codes
    assert not any(c == "checksum" for n, c in codes if n == paths[2].name)
    assert report["checksums"]["files"] == SAMPLES
    assert report["checksums"]["without_checksum"] == 0
    assert report["checksums"]["bytes"] == sum(p.stat().st_size for p in paths)
    clean = validate(runs["fp8"])
    assert clean["ok"] and clean["checksums"]["seconds"] > 0


READ_FP8_WITH_SPECULATORS_09 = """
import sys, torch
from pathlib import Path
from safetensors.torch import load_file
from hs_connectors.transfer import FP8Transfer
from speculators.train.data import ArrowDataset
out, src = sys.argv[1], sys.argv[2:]
ds = ArrowDataset(max_len=4096, datapath=out, on_missing="raise",
                  transfer=FP8Transfer(Path(out) / "hidden_states"))
assert len(ds) == len(src)
for i, path in enumerate(src):
    item = ds._get_raw_data(i)
    ours = load_file(path)
    hs = ours["hidden_states"].to(torch.bfloat16) * ours["hidden_states_scales"].to(torch.bfloat16)
    assert torch.equal(item["input_ids"], ours["input_ids"])
    assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))
    assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])
print("read", len(ds), "fp8 rows")
"""


@pytest.mark.engine
@pytest.mark.trainer
def test_the_fp8_export_is_what_speculators_09_reads(runs, tmp_path):
    import json

    from eagle3_extract.drafter.export import main as export_main

    assert export_main([str(runs["fp8"]), str(tmp_path / "s09")]) == 0
    rec = json.loads((tmp_path / "s09" / "export.json").read_text())
    assert rec["hidden_states"] == "fp8"
    hs0 = load_st(tmp_path / "s09" / "hidden_states" / "hs_0.safetensors")[0]
    assert hs0["hidden_states"].dtype == FP8 and SCALES_KEY in hs0
    src = [str(p) for _, p in sorted(data_files(runs["fp8"]).items())]
    assert f"read {SAMPLES} fp8 rows" in _train_env_run(READ_FP8_WITH_SPECULATORS_09,
                                                        str(tmp_path / "s09"), *src)


@pytest.mark.engine
@pytest.mark.trainer
def test_the_trainer_trains_on_fp8(runs, tmp_path):
    r = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-m", "eagle3_extract.drafter.train",
         f"data.dir={runs['fp8']}", "train=small", "train.epochs=1", "train.max_steps=2",
         "train.total_seq_len=512", "train.draft_vocab_size=256", f"output.dir={tmp_path}/d"],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "d" / "drafter" / "model.safetensors").exists()
    log = (tmp_path / "d" / "train.log").read_text()
    # without it speculators' default (file) backend would hand the raw e4m3 values over
    assert "--hidden-states-backend fp8" in log


def test_fp8_config_errors_are_one_line_exit_2(tmp_path):
    for args, words in (
        (("output=fp8", "output.format=speculators_pt"), "output.format=safetensors"),
        (("output=fp8", "model.pipeline_parallel_size=2"), "fp8_scale=token_layer"),
        (("output.dtype=fp16",), "output.dtype"),
    ):
        r = run_cli("engine=hf", *args, f"output.dir={tmp_path / 'o'}")
        assert r.returncode == 2, r.stderr[-2000:]
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and words in lines[0], r.stderr


def test_preflight_prints_the_disk_the_run_needs(tmp_path):
    """Before the engine starts: bytes a token (fp8: L x H + 4) and the total."""
    for args, per_token, what in ((("output=fp8",), 4 * 128 + 4, "fp8 + scales"),
                                  ((), 4 * 128 * 2, "bfloat16")):
        r = run_cli("engine=hf", "dry_run=true", *args, f"output.dir={tmp_path / what[:4]}")
        assert r.returncode == 0, r.stderr[-2000:]
        out = r.stdout + r.stderr
        assert f"({per_token} bytes a token, states {what})" in out, out[-2000:]


def test_the_time_estimate_comes_from_the_calibrated_rate(monkeypatch, caplog):
    """One line after CALIBRATE_S of landed files, from the rate since the first file (the
    engine start and the first batch excluded), then nothing more."""
    import logging

    from eagle3_extract.extract import progress
    from eagle3_extract.types import Sample

    clock = iter([100.0, 101.0, 103.0, 125.0, 126.0, 127.0])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    p = progress.Progress(total_samples=5, total_tokens=500, enabled=False)  # t0 = 100
    with caplog.at_level(logging.INFO, logger="eagle3_extract.extract.job"):
        for _ in range(5):
            p.on_sample(Sample(0, [1] * 100, [1] * 100), 1000)
    # first file at 101 (100 tokens), the third at 125: 200 tokens in 24 s
    assert p.estimate == {"tokens_per_s": 8.3, "seconds_left": 24.0, "after_tokens": 300}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time:")]
    assert len(lines) == 1 and "about 0:00:24 for the 200 left" in lines[0], lines
