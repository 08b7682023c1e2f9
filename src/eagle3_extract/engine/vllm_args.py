"""vLLM 0.16's EngineArgs as our config spells them: one definition for extraction
(engine/vllm.py), regeneration and acceptance (same model, TP/PP, limits), the user's
`engine.vllm_args` checked against EngineArgs' own fields, and the settings extraction
fixes (FIXED_ARGS) refused there.

Settings that would silently truncate captures are fixed here and refused in
`engine.vllm_args`: prefix caching (skips shared KV blocks: 46 tokens gave 14 rows),
chunked prefill (a partly scheduled prompt keeps its first chunk), and async scheduling
(our driver steps the scheduler itself).
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
from typing import TYPE_CHECKING, Any

from eagle3_extract.engine import ModelInfo
from eagle3_extract.engine.worker import QUALNAME

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import EngineConfig, ModelConfig


# Set by the driver; a user's engine.vllm_args may not change them.
FIXED_ARGS = {
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
    "async_scheduling": False,
    "skip_tokenizer_init": True,  # token ids come in; the workers need no tokenizer
    "worker_extension_cls": QUALNAME,
}


# EngineArgs fields that a config key of ours sets.
OWN_KEYS = {
    "model": "model.path", "tokenizer": "model.tokenizer",
    "trust_remote_code": "model.trust_remote_code", "dtype": "model.dtype",
    "max_model_len": "model.max_model_len", "quantization": "model.quantization",
    "load_format": "model.load_format",
    "gpu_memory_utilization": "model.gpu_memory_utilization",
    "tensor_parallel_size": "model.tensor_parallel_size",
    "pipeline_parallel_size": "model.pipeline_parallel_size",
    "max_num_seqs": "engine.max_num_seqs", "max_num_batched_tokens": "engine.token_budget",
    "enforce_eager": "engine.enforce_eager",
    "distributed_executor_backend": "engine.distributed_executor_backend",
}


def model_args(engine: EngineConfig, model: ModelConfig, info: ModelInfo,
               verbose: bool = False) -> dict[str, Any]:
    """The EngineArgs fields our model and engine keys set, as vLLM spells them: one
    definition for extraction, regeneration and acceptance (same model, TP/PP, limits).
    `verbose`: the job's, for vLLM's weight-loading progress bar."""
    m, e = model, engine
    args: dict[str, Any] = {
        "model": info.path,
        "tokenizer": info.tokenizer_path,
        "trust_remote_code": bool(m.trust_remote_code),
        "dtype": str(info.dtype).removeprefix("torch."),
        "max_model_len": int(m.max_model_len),
        "gpu_memory_utilization": float(m.gpu_memory_utilization),
        "tensor_parallel_size": int(m.tensor_parallel_size),
        "pipeline_parallel_size": int(m.pipeline_parallel_size),
        "max_num_seqs": None if e.max_num_seqs is None else int(e.max_num_seqs),
        "max_num_batched_tokens": None if e.token_budget is None else int(e.token_budget),
        "enforce_eager": enforce_eager(e.enforce_eager),
        "seed": 0,
        "use_tqdm_on_load": bool(verbose),
    }
    if getattr(m, "quantization", None):
        args["quantization"] = m.quantization
    if getattr(m, "load_format", None):
        args["load_format"] = m.load_format
    backend = getattr(e, "distributed_executor_backend", None)
    if backend not in (None, "", "auto"):
        args["distributed_executor_backend"] = backend
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # vLLM 0.16's CPU rotary kernel disagrees with the reference for GPT-J-style
        # (non-neox) rope, which DeepseekV2/V3 use: 38% relative error at layer 1 vs
        # HF, 4e-7 with the native torch ops.
        args["compilation_config"] = {"custom_ops": ["none"]}
    return args


def enforce_eager(value: bool | None) -> bool:
    """engine.enforce_eager, null resolved: vLLM's own default (CUDA graphs and
    torch.compile) where the platform has CUDA graphs; eager on the CPU build, which has
    none and would spend its start compiling with inductor. A build that cannot take
    CUDA graphs (the H200 kit) sets it true in its own settings (bench/h200*.sh)."""
    if value is not None:
        return bool(value)
    from vllm.platforms import current_platform

    return not current_platform.is_cuda_alike()


def engine_args(engine: EngineConfig, model: ModelConfig, info: ModelInfo,
                verbose: bool = False) -> dict[str, Any]:
    """The EngineArgs of an extraction job: the model's, the user's, then FIXED_ARGS."""
    args = model_args(engine, model, info, verbose)
    # Without chunked prefill a step must fit a whole prompt.
    args["max_num_batched_tokens"] = max(args["max_num_batched_tokens"], args["max_model_len"])
    args.update(check_vllm_args(engine))
    args.update(FIXED_ARGS)
    return args


def check_cpu_build() -> None:
    """Refuse a vLLM CPU build this host cannot run (a .venv made on another machine, a
    forced CPU_BUILD): it would die at the first forward pass, after the model loaded."""
    from eagle3_extract.cpu_build import check_installed
    from eagle3_extract.errors import PreflightError

    problem = check_installed()
    if problem:
        raise PreflightError(problem)


def check_vllm_args(engine: EngineConfig, fixed: dict[str, Any] = FIXED_ARGS) -> dict[str, Any]:
    """`engine.vllm_args` as plain values, keys checked against vLLM's EngineArgs.

    Raises ConfigError naming the key: a typo must fail in preflight, not after
    the model config is resolved; a key our config owns must be set there.
    """
    from omegaconf import OmegaConf

    from eagle3_extract.config import ConfigError

    check_cpu_build()  # a build for another CPU may not even load
    raw = engine.vllm_args
    args = OmegaConf.to_container(raw, resolve=True) if OmegaConf.is_config(raw) else raw
    args = dict(args or {})
    fields = engine_arg_fields()
    for key, value in args.items():
        if key in OWN_KEYS:
            raise ConfigError(f"engine.vllm_args.{key}: set {OWN_KEYS[key]} instead")
        if key in fixed and value != fixed[key]:
            raise ConfigError(f"engine.vllm_args.{key}={value!r} is not supported: the "
                              f"driver needs {fixed[key]!r} (docs/engine.md)")
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"engine.vllm_args.{key} is not a vLLM 0.16 EngineArgs "
                              f"field{hint}; see `vllm serve --help` for their names")
    return args


@functools.cache
def engine_arg_fields() -> frozenset[str]:
    """The field names of the installed vLLM's EngineArgs dataclass, read from its source
    (vllm/engine/arg_utils.py), not imported: the import (torch, vLLM's configs) takes
    10 s of a preflight that should be seconds, and the engine start, which imports it
    anyway, runs beside tokenization. A class this parse cannot read raises (tests check
    the set against dataclasses.fields of the imported class); so does a missing vLLM,
    as one line (PreflightError), not a traceback."""
    import ast
    import importlib.util
    from pathlib import Path

    from eagle3_extract.errors import PreflightError

    spec = importlib.util.find_spec("vllm")  # a top-level find: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        raise PreflightError("engine=vllm: vLLM is not installed in this environment; "
                             "`make venv` (or use the image), or run with engine=hf")
    source = Path(list(spec.submodule_search_locations)[0]) / "engine" / "arg_utils.py"
    tree = ast.parse(source.read_text(encoding="utf-8"), str(source))
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EngineArgs"]
    if len(found) != 1 or found[0].bases:
        raise PreflightError(f"{source}: no plain EngineArgs dataclass: not vLLM 0.16's; "
                             "reinstall vllm==0.16.0 (`make venv`)")
    names = frozenset(
        s.target.id for s in found[0].body
        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        and "ClassVar" not in ast.unparse(s.annotation))
    if not names:
        raise PreflightError(f"{source}: EngineArgs has no fields: not vLLM 0.16's; "
                             "reinstall vllm==0.16.0 (`make venv`)")
    return names


# vLLM warnings about what this driver does on purpose (and checks: every row of every
# request is verified), which would only alarm a user.
KNOWN_WARNINGS = (
    "does not officially support disabling chunked prefill",
    "Enforce eager set, overriding optimization level",
    "does not have 'empty_cache' attribute",
)


class _KnownWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(k in record.getMessage() for k in KNOWN_WARNINGS)


def quiet_known_warnings() -> None:
    import vllm.logger  # noqa: F401 - configures the "vllm" logger and its handlers

    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, _KnownWarnings) for f in handler.filters):
            handler.addFilter(_KnownWarnings())


def size_cpu_kv_cache(info: ModelInfo, tokens: int) -> None:
    """On the CPU platform, a KV cache for `tokens` tokens (twice over), not vLLM's
    default of half the machine's memory: the tiny default run peaked at 13.5 GB RSS
    without it. An explicit VLLM_CPU_KVCACHE_SPACE (GiB) wins."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        gib = max(1, math.ceil(2 * tokens * info.kv_bytes_per_token / 2**30))
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
