"""The production engine: patched speculators 0.3.0 on vLLM 0.16.

Everything this project assumes about vLLM 0.16 lives in patches/ (applied to
the installed speculators) and here. The generator captures on the workers'
devices and hands states over in a shared host buffer; this adapter turns one
buffer slot into per-sample views and releases the slot when the writer is
done with it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from ..types import Batch, ExtractedBatch
from . import ModelInfo


def _require_patches() -> dict:
    from .. import patching

    try:
        target = patching.default_target()
        patching.check(target, patching.REPO_PATCHES)
    except patching.PatchError as e:
        raise RuntimeError(
            f"speculators is not patched for vLLM 0.16 ({e}). Run `eagle3-patches apply` "
            "(make venv does) or use the container image."
        ) from e
    return patching.load_manifest(target) or {}


class VllmEngine:
    def __init__(self, cfg: Any, info: ModelInfo, layer_ids: list[int]):
        self.patches = _require_patches()
        from speculators.data_generation.vllm_hidden_states_generator import (
            VllmHiddenStatesGenerator,
        )

        m, e = cfg.model, cfg.engine
        self.layer_ids = list(layer_ids)
        self.num_layers = info.num_layers
        self.hidden_size = info.hidden_size
        self.dtype = info.dtype
        engine_kwargs: dict[str, Any] = {
            "tokenizer": info.tokenizer_path,
            "trust_remote_code": bool(m.trust_remote_code),
            "dtype": str(info.dtype).removeprefix("torch."),
            "pipeline_parallel_size": int(m.pipeline_parallel_size),
            "max_num_seqs": int(e.max_num_seqs),
            "enforce_eager": bool(e.enforce_eager),
            "seed": 0,
        }
        if getattr(m, "quantization", None):
            engine_kwargs["quantization"] = m.quantization
        if getattr(m, "load_format", None):
            engine_kwargs["load_format"] = m.load_format
        backend = getattr(e, "distributed_executor_backend", None)
        if backend not in (None, "", "auto"):
            engine_kwargs["distributed_executor_backend"] = backend
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            # vLLM 0.16's CPU rotary kernel disagrees with the reference for
            # GPT-J-style (non-neox) rope, which DeepseekV2/V3 use: observed 38%
            # relative error at layer 1 vs HF, 4e-7 with the native torch ops.
            engine_kwargs["compilation_config"] = {"custom_ops": ["none"]}
        engine_kwargs.update(dict(getattr(e, "vllm_args", None) or {}))
        self.max_model_len = int(m.max_model_len)
        # The CPU worker of the in-process (uni) executor pins this process to its
        # cores; undone in close() so later jobs, writers and children get them all.
        self._affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.generator = VllmHiddenStatesGenerator(
            info.path,
            layer_ids=self.layer_ids,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=float(m.gpu_memory_utilization),
            tensor_parallel_size=int(m.tensor_parallel_size),
            max_num_batched_tokens=int(e.token_budget),
            host_buffers=int(e.host_buffers),
            engine_kwargs=engine_kwargs,
        )
        if self.generator.layer_ids != self.layer_ids:
            raise RuntimeError(
                f"generator resolved layer ids {self.generator.layer_ids}, asked {self.layer_ids}"
            )
        # Block size etc. as the workers see them, for the manifest.
        vc = self.generator.vllm_config
        self.describe = {
            "block_size": vc.cache_config.block_size,
            "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "async_scheduling": vc.scheduler_config.async_scheduling,
            "executor": vc.parallel_config.distributed_executor_backend,
            "patches": [p["name"] for p in self.patches.get("series", [])],
        }

    @property
    def max_batch_tokens(self) -> int:
        return self.generator.max_tokens_per_call

    def prefill(self, batch: Batch) -> None:
        """The same scheduler steps with capture off (benchmark baseline)."""
        self.generator.prefill([s.input_ids for s in batch.samples])

    def extract(self, batch: Batch) -> ExtractedBatch:
        t0 = time.perf_counter()
        host = self.generator.generate_to_host([s.input_ids for s in batch.samples])
        states = [host.sample(i) for i in range(len(batch.samples))]
        expect_tail = (len(self.layer_ids), self.hidden_size)
        for sample, st in zip(batch.samples, states):
            if st.shape != (len(sample), *expect_tail) or st.dtype != self.dtype:
                host.release()
                raise RuntimeError(
                    f"sample {sample.index}: states {tuple(st.shape)} {st.dtype}, expected "
                    f"({len(sample)}, {expect_tail[0]}, {expect_tail[1]}) {self.dtype}"
                )
        return ExtractedBatch(
            batch.samples, states, release=_once(host.release),
            seconds=time.perf_counter() - t0,
            # The generator refuses NaN/Inf rows, checked on the workers' devices.
            finite_checked=True,
        )

    def close(self) -> None:
        gen = self.__dict__.pop("generator", None)
        if gen is None:
            return
        gen.shutdown()
        # The uni-process executor initialises torch.distributed in this
        # process; tear it down so the next engine (Hydra multirun) starts clean.
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        if self._affinity:
            os.sched_setaffinity(0, self._affinity)


def _once(fn):
    lock = threading.Lock()
    done = False

    def release() -> None:
        nonlocal done
        with lock:
            if done:
                return
            done = True
        fn()

    return release
