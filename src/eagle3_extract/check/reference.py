"""The independent computations eagle3-verify compares an extraction with: HF
transformers (engine/hf.py, every layer id) and vLLM 0.16's own EAGLE-3 aux-hidden-state
path (the state a drafter receives when vLLM serves it; ids below N only)."""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any, Protocol

import torch

from eagle3_extract.config import EngineConfig, ModelConfig
from eagle3_extract.errors import PreflightError
from eagle3_extract.layout import Storage
from eagle3_extract.models import config as model_config
from eagle3_extract.models.config import read_config
from eagle3_extract.types import Batch, Sample


# vLLM 0.16 models whose forward appends `hidden_states + residual` before layer
# idx (read from vllm/model_executor/models/{llama,qwen2,qwen3}.py).
VLLM_AUX_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class VerifyError(PreflightError):
    """Verification could not run (bad directory, model or override); exit 2."""


class Reference(Protocol):
    """An independent way to compute the states at `layer_ids` for some samples."""

    name: str
    layer_ids: list[int]

    def states(self, samples: list[Sample]) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


def is_moe(model_path: str) -> bool:
    try:
        hf_config, _ = read_config(model_path)
    except (OSError, ValueError):
        return False
    return model_config.is_moe(hf_config)


class HFReference:
    """engine/hf.py in the model dtype: one sample per forward, no vLLM code."""

    name = "hf"

    def __init__(self, engine: EngineConfig, model: ModelConfig, info: Any, layer_ids: list[int]):
        from omegaconf import OmegaConf

        from eagle3_extract.engine.hf import HFEngine

        # the reference in full model precision, whatever the data is stored in
        engine = OmegaConf.merge(engine, {"name": "hf"})
        self.layer_ids = list(layer_ids)
        self.engine = HFEngine(engine, model, info, self.layer_ids, Storage())  # model dtype

    def states(self, samples: list[Sample]) -> list[torch.Tensor]:
        eb = self.engine.extract(Batch(samples))
        try:  # the states may be views into a host buffer the engine reuses
            return [s.clone() for s in eb.states]
        finally:
            eb.release()

    def close(self) -> None:
        self.engine.close()


def _install_aux_capture(model: torch.nn.Module, ids: tuple[int, ...]) -> bool:
    """Runs in the vLLM worker: turn on the EAGLE-3 aux states and keep them.

    With aux layers set, the base model returns `(hidden_states, aux)`, which
    the runner only unpacks when an EAGLE-3 drafter is configured; so the base
    model's forward is wrapped (an instance attribute: the compile decorator
    calls `self.forward` directly, bypassing module hooks) to store the aux
    states and return the plain hidden states.
    """
    if not hasattr(model, "set_aux_hidden_state_layers"):
        return False
    inner = model.model
    model.set_aux_hidden_state_layers(tuple(ids))
    store: list[list[torch.Tensor]] = []
    forward = inner.forward

    def capture(*args, **kwargs):
        out = forward(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
            store.append([t.detach().to("cpu", copy=True) for t in out[1]])
            return out[0]
        return out

    inner.forward = capture
    inner._eagle3_verify_store = store
    return True


def _take_aux(model: torch.nn.Module) -> list[torch.Tensor]:
    """Runs in the vLLM worker: the captured forwards as [t, L, H] chunks; clears them."""
    store = model.model._eagle3_verify_store
    out = [torch.stack(chunk, dim=1) for chunk in store]
    store.clear()
    return out


@contextmanager
def _env(**values: str):
    """Set environment variables the caller has not set, for one block."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


class VllmAuxReference:
    """vLLM 0.16's `LLM` with the model's EAGLE-3 aux-hidden-state capture on.

    One sample per `generate(max_tokens=1)`, prefix caching off (a cached prefix
    would skip rows); chunked prefill, if it splits a sample, gives the chunks in
    order. The engine core runs in this process for a single-GPU model (faster
    start; no function shipping), else in vLLM's worker processes. On the CPU
    build the KV cache defaults to 1 GiB here (VLLM_CPU_KVCACHE_SPACE to change).
    """

    name = "vllm-aux"

    def __init__(self, engine: EngineConfig, model: ModelConfig, info: Any, layer_ids: list[int]):
        m = model
        if info.architecture not in VLLM_AUX_ARCHS:
            raise VerifyError(f"vLLM 0.16's aux-hidden-state path covers {VLLM_AUX_ARCHS}, "
                              f"not {info.architecture}")
        if int(m.pipeline_parallel_size) > 1:
            raise VerifyError("the vLLM aux path counts layers from the pipeline stage's start: "
                              "verify with model.pipeline_parallel_size=1")
        self.layer_ids = [k for k in layer_ids if k < info.num_layers]
        if not self.layer_ids:
            raise VerifyError(f"the vLLM aux path cannot give layer id {info.num_layers} (the "
                              "final pre-norm state), the only id of this run")
        from omegaconf import OmegaConf
        from vllm import LLM
        from vllm.platforms import current_platform

        kw: dict[str, Any] = dict(
            model=info.path, skip_tokenizer_init=True,
            dtype=str(info.dtype).removeprefix("torch."),
            trust_remote_code=bool(m.trust_remote_code), max_model_len=int(m.max_model_len),
            tensor_parallel_size=int(m.tensor_parallel_size),
            gpu_memory_utilization=float(m.gpu_memory_utilization),
            enforce_eager=True, enable_prefix_caching=False, seed=0,
            async_scheduling=False,  # no step scheduled past the one-token request
        )
        if m.quantization:
            kw["quantization"] = m.quantization
        # the run's own EngineArgs pass-through (an attention backend, custom ops), under ours
        user = engine.get("vllm_args")
        kw = {**(OmegaConf.to_container(user, resolve=True) if user else {}), **kw}
        if current_platform.is_cpu():
            kw["compilation_config"] = {"custom_ops": ["none"]}  # as engine/vllm.py
        single = int(m.tensor_parallel_size) == 1
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if single else {
            # apply_model ships our capture function to the worker processes.
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
        # For the reference's lifetime: vLLM reads them at each call, not only at start.
        self._env = ExitStack()
        self._env.enter_context(_env(VLLM_CPU_KVCACHE_SPACE="1", **env))
        try:
            self.llm = LLM(**kw)
            ok = self.llm.apply_model(partial(_install_aux_capture,
                                              ids=tuple(self.layer_ids)))
        except BaseException:
            self.close()
            raise
        if not all(ok):
            self.close()
            raise VerifyError(f"{info.architecture}: the loaded vLLM model has no "
                              "set_aux_hidden_state_layers")

    def states(self, samples: list[Sample]) -> list[torch.Tensor]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, detokenize=False)
        out = []
        self.llm.apply_model(_take_aux)  # drop anything captured before
        for s in samples:
            self.llm.generate([TokensPrompt(prompt_token_ids=list(s.input_ids))], params,
                              use_tqdm=False)
            chunks = self.llm.apply_model(_take_aux)[0]  # every TP rank holds the full state
            st = torch.cat(chunks, dim=0) if chunks else torch.empty(0)
            if st.shape[0] != len(s):
                raise RuntimeError(f"vLLM aux path gave {st.shape[0]} rows for {len(s)} tokens "
                                   f"of sample {s.index}")
            out.append(st)
        return out

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()  # also drops vLLM's env cache and gc.freeze
        self._env.close()


REFERENCES = {"hf": HFReference, "vllm-aux": VllmAuxReference}
