"""tools/h200-kernels inside vLLM: `vllm_C.py` gives the kit's ops back under vLLM's op
names and leaves every other op to the vLLM kit's probe (which answers capability
probes False and has no ops). Checked on the CPU build's real compiled `_C` ops, which
stand in for the kit's library here; `kit.py install` swaps the files once."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

KIT = Path(__file__).resolve().parents[1] / "tools" / "h200-kernels"
pytestmark = pytest.mark.skipif(not KIT.is_dir(), reason="tools/ is not in the image")


class Probe:
    """The vLLM kit's stub contract (../shared/tools/h200-vllm016/vllm_C_stub.py)."""

    def __getattr__(self, op):
        if "support" in op:
            return lambda *a, **k: False
        raise AttributeError(f"_C.{op} (no compiled kernels in this probe)")


def load_vllm_c(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm._C_probe", types.ModuleType("vllm._C_probe"))
    monkeypatch.syspath_prepend(str(KIT))
    monkeypatch.delenv("EAGLE3_KERNEL_KIT", raising=False)
    spec = importlib.util.spec_from_file_location("kit_vllm_C", KIT / "vllm_C.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_built_ops_fall_through_to_the_real_kernels_the_rest_to_the_probe(monkeypatch):
    import vllm._C  # noqa: F401 - the CPU build's compiled ops, registered under _C

    if not torch._C._dispatch_has_kernel_for_dispatch_key("_C::rms_norm", "CPU"):
        pytest.skip("this vLLM build's _C has no CPU kernels (the CUDA image)")
    mod = load_vllm_c(monkeypatch)
    assert mod.KIT is None  # no EAGLE3_KERNEL_KIT: the plain probe stub
    ns = mod._KitFirst("_C", ["rms_norm"], Probe())
    x, w = torch.randn(4, 64), torch.rand(64) + 0.5
    out = torch.empty_like(x)
    ns.rms_norm(out, x, w, 1e-6)  # vLLM's kernel, reached through the wrapper
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(out, ref, atol=1e-5)
    assert ns.rms_norm.default.name() == torch.ops._C.rms_norm.default.name() == "_C::rms_norm"
    assert ns.cutlass_scaled_mm_supports_fp8(90) is False  # the probe answers
    with pytest.raises(AttributeError, match="no compiled kernels"):
        ns.silu_and_mul  # built by vLLM's CPU build, but not listed as the kit's: absent


def test_install_moves_the_probe_aside_once(tmp_path):
    sys.path.insert(0, str(KIT))
    try:
        import kit
    finally:
        sys.path.remove(str(KIT))
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "_C.py").write_text("# the vLLM kit's probe stub\n")
    for _ in range(2):  # idempotent: the probe is not overwritten by ours
        kit.install(tmp_path)
        assert (tmp_path / "vllm" / "_C_probe.py").read_text() == "# the vLLM kit's probe stub\n"
        assert (tmp_path / "vllm" / "_C.py").read_text() == (KIT / "vllm_C.py").read_text()
