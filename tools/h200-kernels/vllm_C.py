"""vllm/_C on the H200 kit with the kernel kit loaded (installed by `kit.py install`).

The vLLM kit's stub (../shared/tools/h200-vllm016/vllm_C_stub.py, kept beside this file
as `vllm/_C_probe.py`) replaces the op namespaces `torch.ops._C`, `_C_cache_ops`,
`_moe_C`, ... with probes: capability checks answer False, every op is absent or raises.
Here the ops the kit built (build.json) are vLLM 0.16.0's own CUDA kernels again, under
the names `vllm/_custom_ops.py` calls; every other op stays the probe's, so vLLM still
takes its Triton / native path for those or fails loudly. Every process that imports
vLLM (the spawned workers too) loads the library from `EAGLE3_KERNEL_KIT` (the kit
directory); without it this module is the plain probe stub.
"""

import os

import torch
import torch._ops

from vllm import _C_probe  # noqa: F401 - sets torch.ops.<ns> to the probes

KIT_ENV = "EAGLE3_KERNEL_KIT"


class _KitFirst:
    """One op namespace: the kit's op where it built one, else the probe's answer."""

    def __init__(self, ns: str, built: list[str], probe):
        self._real = torch._ops._OpNamespace(ns)  # resolves through the dispatcher
        self._built = frozenset(built)
        self._probe = probe

    def __getattr__(self, op):
        if op in self._built:
            return getattr(self._real, op)
        return getattr(self._probe, op)


def _install(kit_dir: str) -> dict:
    import kit  # tools/h200-kernels, on PYTHONPATH (kit.py install says so)

    record = kit.load(kit_dir)
    for ns, ops in kit.built_ops(record).items():
        setattr(torch.ops, ns, _KitFirst(ns, ops, getattr(torch.ops, ns)))
    return record


KIT = _install(os.environ[KIT_ENV]) if os.environ.get(KIT_ENV) else None
