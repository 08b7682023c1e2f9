"""tools/h200-kernels inside vLLM: `vllm_C.py` gives the kit's ops back under vLLM's op
names and leaves every other op to the vLLM kit's probe (which answers capability
probes False and has no ops). Checked on the CPU build's real compiled `_C` ops, which
stand in for the kit's library here; `kit.py install` swaps the files once."""

from __future__ import annotations

import importlib.util
import os
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


def load_fa2():
    spec = importlib.util.spec_from_file_location("kit_vllm_fa2_C", KIT / "vllm_fa2_C.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def naive(q, k, v, scale, causal):
    """One sequence, one head at a time, in float64: the definition."""
    lq, h, _ = q.shape
    lk, hk = k.shape[:2]
    out = torch.zeros(lq, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((h, lq), float("-inf"), dtype=torch.float64)
    for head in range(h):
        kh = head // (h // hk)
        s = q[:, head].double() @ k[:, kh].double().T * scale
        if causal:
            s = s.masked_fill(torch.arange(lk)[None] > torch.arange(lq)[:, None] + lk - lq,
                              float("-inf"))
        for i in range(lq):
            if torch.isinf(s[i]).all():
                continue
            lse[head, i] = torch.logsumexp(s[i], 0)
            out[i, head] = torch.softmax(s[i], 0) @ v[:, kh].double()
    return out, lse


def test_the_flash_attention_varlen_stand_in_is_attention(monkeypatch):
    """MLA prefill's `torch.ops._vllm_fa2_C.varlen_fwd`, called as vllm-flash-attn's
    interface calls it: packed sequences, causal aligned bottom right, grouped heads,
    a value head narrower than the query's (MLA: 192 / 128), `out` written in place, the
    log-sum-exp per head and token; what it cannot do is refused."""
    fa = load_fa2()
    fa.register()  # a second registration is a no-op
    torch.manual_seed(0)
    lens_q, lens_k = [5, 1, 9], [5, 3, 9]  # the middle sequence: 1 query over 3 keys
    cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    h, hk, d, dv = 8, 2, 24, 16
    q = torch.randn(int(cq[-1]), h, d, dtype=torch.bfloat16)
    k = torch.randn(int(ck[-1]), hk, d, dtype=torch.bfloat16)
    v = torch.randn(int(ck[-1]), hk, dv, dtype=torch.bfloat16)
    out = torch.zeros(int(cq[-1]), h, dv, dtype=torch.bfloat16)
    scale = d ** -0.5
    got, lse = torch.ops._vllm_fa2_C.varlen_fwd(
        q, k, v, out, cq, ck, None, None, None, None, max(lens_q), max(lens_k), 0.0, scale,
        False, True, -1, -1, 0.0, False, 0, None)
    assert got.data_ptr() == out.data_ptr() and lse.shape == (h, int(cq[-1]))
    # on CPU (and with EAGLE3_VARLEN_KERNEL=torch) the float32 path computes it: torch's
    # FlashAttention-2 kernel is CUDA only and takes q, k, v of one head size
    assert not fa.flash_takes(q, k, v)
    for s in range(3):
        want, want_lse = naive(q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]],
                               scale, causal=True)
        part = got[cq[s]:cq[s + 1]].double()
        assert ((part - want).norm() / want.norm()).item() < 8e-3, s  # bf16 output
        assert torch.allclose(lse[:, cq[s]:cq[s + 1]].double(), want_lse, atol=1e-4), s
    full, _ = torch.ops._vllm_fa2_C.varlen_fwd(
        q, k, v, None, cq, ck, None, None, None, None, 9, 9, 0.0, scale, False, False, -1, -1,
        0.0, False, 0, None)
    want, _ = naive(q[:5], k[:5], v[:5], scale, causal=False)
    assert ((full[:5].double() - want).norm() / want.norm()).item() < 8e-3
    with pytest.raises(NotImplementedError, match="block_table"):
        torch.ops._vllm_fa2_C.varlen_fwd(
            q, k, v, None, cq, ck, None, None, torch.zeros(3, 1, dtype=torch.int32), None,
            9, 9, 0.0, scale, False, True, -1, -1, 0.0, False, 0, None)


def test_install_puts_the_stand_in_where_vllm_flash_attn_imports_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(KIT))
    import kit

    site = tmp_path / "site"
    (site / "vllm" / "vllm_flash_attn").mkdir(parents=True)
    (site / "vllm" / "_C.py").write_text("# the vLLM kit's probe stub\n")
    kit.install(site)
    kit.install(site)  # idempotent: the probe is moved once
    assert (site / "vllm" / "_C_probe.py").read_text() == "# the vLLM kit's probe stub\n"
    assert (site / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.py").read_bytes() == (
        KIT / "vllm_fa2_C.py").read_bytes()


def index_file_url(project: str, filename: str) -> str:
    """Where pip's configured index (PIP_INDEX_URL, pip config, else pip's own default)
    lists `filename`: found as pip finds it, no registry host written here."""
    import re
    import subprocess
    import urllib.parse
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL") or subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.index-url"],
        capture_output=True, text=True).stdout.strip()
    if not index:
        from pip._internal.models.index import PyPI

        index = PyPI.simple_url
    page_url = f"{index.rstrip('/')}/{project}/"
    with urllib.request.urlopen(page_url, timeout=60) as r:
        page = r.read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        if urllib.parse.urlsplit(href).path.endswith("/" + filename):
            return urllib.parse.urljoin(page_url, href)
    raise FileNotFoundError(f"{filename} is not listed by {page_url}")


@pytest.fixture(scope="module")
def build_mod():
    sys.path.insert(0, str(KIT))
    try:
        import bindings
        import build
    finally:
        sys.path.remove(str(KIT))
    return build, bindings


@pytest.fixture(scope="module")
def sdist(build_mod):
    """vLLM 0.16.0's sdist: the checkout's .kernels/ copy, else fetched from PyPI once."""
    import hashlib
    import urllib.request

    from eagle3_extract.models.tiny import cache_root

    build, _ = build_mod
    local = KIT.parents[1] / ".kernels" / build.SDIST_NAME
    if local.is_file():
        return local
    path = cache_root() / build.SDIST_NAME
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        url = index_file_url("vllm", build.SDIST_NAME)
        with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
            f.write(r.read())
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != build.SDIST_SHA256:
            tmp.unlink()
            pytest.fail(f"{url}: not the sha256 build.py pins")
        tmp.replace(path)
    return path


def test_the_csrc_pack_is_the_sdists_and_a_changed_file_is_refused(build_mod, sdist, tmp_path):
    import io
    import tarfile

    build, _ = build_mod
    pack = tmp_path / "csrc.tar.gz"
    rec = build.pack(sdist, pack)
    assert rec["sdist_sha256"] == build.SDIST_SHA256 and rec["bytes"] < 2_000_000
    csrc, sha = build.extract_csrc(pack, tmp_path / "a")
    assert sha == build.SDIST_SHA256 and (csrc / "moe" / "marlin_moe_wna16" / "ops.cu").is_file()
    # one byte changed inside the pack: the build refuses it
    bad = tmp_path / "bad.tar.gz"
    with tarfile.open(pack) as src, tarfile.open(bad, "w:gz") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if m.name.endswith("csrc/layernorm_kernels.cu"):
                data = data.replace(b"rsqrtf", b"sqrtf", 1)
                m.size = len(data)
            dst.addfile(m, None if data is None else io.BytesIO(data))
    with pytest.raises(SystemExit, match="differs from what pack recorded"):
        build.extract_csrc(bad, tmp_path / "b")


def test_marlin_moe_is_generated_for_kimis_w4a16_only_and_bound_where_vllm_calls_it(
        build_mod, sdist, tmp_path):
    import re

    build, bindings = build_mod
    csrc, _ = build.extract_csrc(sdist, tmp_path)
    parts = build.generate_marlin_moe(csrc)
    insts = [line for p in parts for line in p.read_text().splitlines()
             if line.startswith("template __global__ void Marlin<")]
    # 5 row-block sizes x 3 thread shapes of one type and group case, each built once
    assert len(insts) == len(set(insts)) == 15 and len(parts) == build.MARLIN_PARTS
    assert all("vllm::kBFloat16.id(), vllm::kU4B8.id(), vllm::kBFloat16.id()" in i
               and re.search(r", 2, false>", i) for i in insts)
    gen_dir = csrc / build.MARLIN_DIR
    assert sorted(p.name for p in gen_dir.glob("sm*_kernel_*.cu")) == []  # split, not doubled
    selector = (gen_dir / "kernel_selector.h").read_text()
    chosen = re.findall(r"kernel = (Marlin<.*?>);", selector)
    assert len(chosen) == 15
    built = {re.search(r"void (Marlin<.*?>)\(", i).group(1) for i in insts}
    assert set(chosen) == built  # the selector offers only what was compiled
    text = bindings.render(csrc)
    for op in sorted(bindings.IMPL_IN_SOURCE):
        assert f'"{op}(' in text and f'impl("{op}"' not in text
    assert 'ops.impl("rms_norm"' in text
    wrappers = {p.name: p.read_text() for p in build.registering_wrappers(csrc, tmp_path)}
    assert any("#define TORCH_EXTENSION_NAME _moe_C" in t and "marlin_moe_wna16/ops.cu" in t
               for t in wrappers.values())
    assert any("#define TORCH_EXTENSION_NAME _C\n" in t and "gptq_marlin_repack.cu" in t
               for t in wrappers.values())
