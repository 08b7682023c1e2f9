"""A second real family through the capture and the exports: Qwen2.5-Coder-0.5B-Instruct
(Qwen2: q/k/v biases, an untied lm_head, a 151,936-token vocabulary, ChatML with tool
calls), assembled from its PyPI parts (models/pypi_gguf.py), on the real vLLM 0.16 CPU
build. SmolLM2 (a Llama) is checked the same way in test_exports.py; what a family can
get wrong is what is checked here again: the layer ids vLLM's Qwen2 feeds a drafter, the
states against HF per layer, the final state against the model's own logits, the loss
mask under its template, and both speculators exports' targets.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import drafter
from test_exports import TARGETS_WITH_SPECULATORS_09
from test_job import compose_cfg
from test_rows import GOOD, LEADING_ASSISTANT, REASONING, TOOLS, masked_text

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[1]
SYSTEM_MULTI = {"messages": [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven is a prime number."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two is the only even prime."}]}
ROWS = [TOOLS, LEADING_ASSISTANT, REASONING, GOOD, SYSTEM_MULTI]
# what the loss mask must cover, row by row: each assistant turn as ChatML renders it,
# its <|im_end|> included, nothing of the system, user or tool turns
MASKED = [
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
    "</tool_call><|im_end|>It is 18 C and sunny in Paris.<|im_end|>",
    "Hello! How can I help?<|im_end|>Hi.<|im_end|>",
    "42<|im_end|>",  # the template drops reasoning_content (counted: not_rendered)
    "hello<|im_end|>",
    "Seven is a prime number.<|im_end|>Two is the only even prime.<|im_end|>",
]


@pytest.fixture(scope="module")
def qwen():
    from eagle3_extract.models.pypi_gguf import build_parted

    return build_parted("qwen25_coder_0_5b")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen-rows") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def extract(rows: Path, out: Path, *overrides: str) -> dict:
    """The job as a user runs it, in its own process: an in-process run left ~3 GiB of the
    engine in pytest for each extraction (CI's 16 GiB: tests/conftest.py's memory report)."""
    args = ["model=qwen25_coder_0_5b", "model.max_model_len=1024", "engine=vllm",
            "engine.distributed_executor_backend=uni", "engine.token_budget=2048",
            "dataset=local", f"dataset.path={rows}", "dataset.shuffle=false",
            f"output.dir={out}", *overrides]
    compose_cfg(*args)  # a typo fails here, not in the child
    r = subprocess.run([sys.executable, "-m", "eagle3_extract.cli", *args],
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def st_run(qwen, rows, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen") / "st"
    manifest = extract(rows, out)
    return out, manifest


def test_the_model_is_the_pinned_qwen2(qwen):
    config = json.loads((qwen / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
        (24, 896, 151936)
    assert config["tie_word_embeddings"] is False
    from safetensors import safe_open

    with safe_open(str(qwen / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and "model.layers.0.self_attn.q_proj.bias" in names


def test_default_layer_ids_are_the_ones_vllms_qwen2_feeds_a_drafter(st_run):
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    _, manifest = st_run
    stand_in = SimpleNamespace(model=SimpleNamespace(layers=[None] * 24))
    served = list(Qwen2ForCausalLM.get_eagle3_aux_hidden_state_layers(stand_in))
    assert manifest["layer_ids"] == [*served, 24] == [2, 12, 21, 24]


def test_loss_masks_follow_its_chatml_on_every_row_kind(qwen, st_run):
    from transformers import AutoTokenizer

    from eagle3_extract.dataset.messages import to_messages
    from eagle3_extract.dataset.render import Renderer
    from test_validate import load_st

    tok = AutoTokenizer.from_pretrained(str(qwen))
    renderer = Renderer(tok)
    for row, want in zip(ROWS, MASKED):
        ids, mask, _ = renderer.tokenize_with_notes(to_messages(row))
        assert masked_text(tok, ids, mask) == want
    out, manifest = st_run
    assert manifest["counts"]["written"] == len(ROWS)
    stored = []
    for path in sorted((out / "data").rglob("*.safetensors")):
        t, _ = load_st(path)
        stored.append(masked_text(tok, t["input_ids"].tolist(), t["loss_mask"].tolist()))
    assert sorted(stored) == sorted(MASKED)  # the files hold what the renderer masks


def test_states_equal_hf_per_layer_and_vllms_aux_path(st_run):
    """eagle3-verify in its own process, as a user runs it (its two references, HF in
    float32 and vLLM's aux path in-process, left ~3 GiB in pytest)."""
    from eagle3_extract.check.verify import REPORT_NAME

    out, _ = st_run
    r = subprocess.run([sys.executable, "-m", "eagle3_extract.check.verify", str(out),
                        "--samples", str(len(ROWS))], capture_output=True, text=True)
    report = json.loads((out / REPORT_NAME).read_text())
    assert r.returncode == 0 and report["ok"], (report["failures"], r.stderr[-2000:])
    hf = report["references"]["hf"]["per_layer"]
    assert list(hf) == ["2", "12", "21", "24"]
    print({k: round(v["mean"], 4) for k, v in hf.items()})
    assert report["references"]["vllm-aux"]["layer_ids"] == [2, 12, 21]


def _agreement(qwen: Path, pairs) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen), dtype=torch.float32).eval()
    agree = total = 0
    with torch.no_grad():
        for ids, last, head in pairs:
            want = model(ids[None]).logits[0]
            got = head(model, last.float())
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            total += len(want)
    return agree / total


def test_the_final_state_and_the_pt_exports_targets_are_its_logits(qwen, rows, tmp_path):
    out = tmp_path / "pt"
    extract(rows, out, "output=speculators_pt")
    m = drafter(qwen)
    pairs = []
    for path in sorted((out / "data").rglob("*.pt")):
        s = torch.load(path, weights_only=True)
        pairs.append((s["input_ids"], s["hidden_states"][-1],
                      lambda model, last: m.verifier_lm_head(m.verifier_norm(last))))
    share = _agreement(qwen, pairs)
    print("speculators 0.3.0 (patched) targets, argmax agreement", share)
    assert share >= 0.99


@pytest.mark.trainer
def test_speculators_09_targets_from_the_export_are_its_logits(qwen, st_run, tmp_path):
    from eagle3_extract.drafter.export import main as export_main

    out, _ = st_run
    assert export_main([str(out), str(tmp_path / "s09")]) == 0
    r = subprocess.run([str(ROOT / ".venv-train" / "bin" / "python"), "-c",
                        TARGETS_WITH_SPECULATORS_09, str(tmp_path / "s09"), str(qwen)],
                       capture_output=True, text=True, timeout=900,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    share = float(r.stdout.split("AGREE ")[1].split()[0])
    print("speculators 0.9.0 targets, argmax agreement", share)
    assert share >= 0.99
