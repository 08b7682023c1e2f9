"""The GPU chain's step rehearsed on the CPU build before GPU time is spent: bench/gpu.py
runs bench/gpu_steps/e2e.sh as it does on the H200 (its run_step: the environment, the
PYTHONPATH from bench/gpu_sites.py's declaration, the trainer's interpreter behind its own
path, the results archive), here with the CPU build's engine settings and a few samples.
What differs from the device is only what the step takes as settings (ENGINE, the
acceptance engine: the CPU build has no speculative decoding) and the interpreters."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpu  # noqa: E402

TRAIN_PYTHON = ROOT / ".venv-train" / "bin" / "python"


@pytest.mark.engine
@pytest.mark.trainer
def test_the_e2e_step_runs_here_through_the_driver(tmp_path, monkeypatch):
    from eagle3_extract.models.smollm2 import gguf_path

    assert TRAIN_PYTHON.exists(), "make venv-train first (the engine lane builds it)"
    device = tmp_path / "device"
    (device / "stage").mkdir(parents=True)
    shutil.copy(gguf_path(), device / "stage" / "smollm2.gguf")
    monkeypatch.setattr(gpu, "DEVICE", device)
    monkeypatch.setenv("GPU_TRAINER_PYTHON", str(TRAIN_PYTHON))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for key, value in {"ENGINE": "", "REGEN_VLLM_ARGS": "", "ACCEPTANCE_ENGINE": "hf",
                       "SAMPLES": "12", "CURVE": "", "HELDOUT": "2", "REGEN_SAMPLES": "4",
                       "TRAIN_ARGS": "train.epochs=1"}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    out.mkdir()
    assert gpu.run_step("e2e", 1500, out, ["smollm2"]) == 0
    back = tmp_path / "back"
    with tarfile.open(out / "e2e-results.tar.gz") as t:
        t.extractall(back, filter="data")
    regen = json.loads((back / "regen.json").read_text())
    assert regen["same_tokens"] and regen["samples_differing"] == 0 and regen["ratio"] > 0
    e2e = json.loads((back / "smollm2" / "e2e.json").read_text())
    assert len(e2e["real"]["acceptance_per_position"]) == 3 and e2e["samples"] == 12
    assert [s["step"] for s in e2e["steps"]] == ["regenerate", "cli", "train", "acceptance"]
    record = json.loads((back / "smollm2" / "drafter-real" / "eagle3-train.json").read_text())
    assert record["versions"]["speculators"] == "0.9.0"  # the trainer's own environment
    assert (back / "times.txt").read_text().splitlines()[0].startswith("model(smollm2) ")
