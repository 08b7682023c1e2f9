"""The production engine: our own driver over vLLM 0.16's engine core.

Why not speculators 0.3.0's generator: on vLLM 0.16 almost every line of it
had to change (docs/engine.md), and upstream deleted it in v0.4.1. What is
left is what vLLM's own `EngineCore` does, in the order it does it:
`EngineArgs` -> `VllmConfig`, `Executor.get_class`, KV cache sizing with
`get_kv_cache_configs`, a `Scheduler`, and a step loop of
`execute_model`/`sample_tokens`. The capture itself is engine/worker.py,
loaded into the workers through vLLM's `worker_extension_cls`.

Settings that would silently truncate captures are fixed here and refused in
`engine.vllm_args`: prefix caching (skips shared KV blocks: 46 tokens gave 14
rows), chunked prefill (a partly scheduled prompt keeps its first chunk), and
async scheduling (this driver steps the scheduler itself).
"""

from __future__ import annotations

import difflib
import functools
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from eagle3_extract.layout import Storage
from eagle3_extract.types import Batch, ExtractedBatch
from eagle3_extract.engine import ModelInfo, hostbuf
from eagle3_extract.engine.memory import CAPTURE_SLACK_ROWS, capture_plan
from eagle3_extract.engine.worker import QUALNAME

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import EngineConfig, ModelConfig

# A call's device-to-host copy takes milliseconds; this long without its ready mark means
# a worker is gone.
READY_TIMEOUT_S = 120.0
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


def locate(steps: list, positions: torch.Tensor, prompt_lens: dict[str, int],
           req_ids: list[str]) -> list[tuple[int, int]]:
    """(first row, length) of each request; raises unless each ran whole, once, from 0."""
    where: dict[str, tuple[int, int]] = {}
    for step_req_ids, start, step_rows in steps:
        offset = start
        for rid in step_req_ids:
            n = prompt_lens.get(rid)
            if n is None or rid in where:
                raise RuntimeError(f"unexpected request {rid} in a captured step")
            if offset + n > start + step_rows or not torch.equal(
                    positions[offset:offset + n], torch.arange(n, dtype=positions.dtype)):
                raise RuntimeError(f"request {rid}: captured rows do not cover positions "
                                   f"0..{n - 1} (prefix caching or chunked prefill on?)")
            where[rid] = (offset, n)
            offset += n
    missing = [rid for rid in req_ids if rid not in where]
    if missing:
        raise RuntimeError(f"no hidden states captured for requests {missing}")
    return [where[rid] for rid in req_ids]


def check_replies(replies: list, num_columns: int) -> tuple[list, torch.Tensor]:
    """Every stage agrees on the token layout and every layer column came back once."""
    parts = [r for r in replies if r is not None]
    if not parts:
        raise RuntimeError("no worker captured hidden states")
    steps, positions = parts[0]["steps"], parts[0]["positions"]
    for part in parts[1:]:
        if part["steps"] != steps or not torch.equal(part["positions"], positions):
            raise RuntimeError("pipeline stages disagree on the token layout")
    covered = sorted(c for part in parts for c in part["columns"])
    if covered != list(range(num_columns)):
        raise RuntimeError(f"captured layer columns {covered} are not each layer once")
    return steps, positions


class VllmEngine:
    def __init__(self, engine: EngineConfig, model: ModelConfig, info: ModelInfo,
                 layer_ids: list[int], storage: Storage, verbose: bool = False):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.executor import Executor

        self.layer_ids = list(layer_ids)
        self.num_layers, self.hidden_size, self.dtype = info.num_layers, info.hidden_size, info.dtype
        self.storage = storage
        # The CPU worker of the in-process (uni) executor pins this process to its
        # cores; undone in close() so later jobs, writers and children get them all.
        self._affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        hostbuf.remove_orphans()
        quiet_known_warnings()
        args = engine_args(engine, model, info, verbose)
        size_cpu_kv_cache(info, args["max_num_batched_tokens"] + args["max_model_len"])
        self.vllm_config = EngineArgs(**args).create_engine_config()
        self.executor = Executor.get_class(self.vllm_config)(self.vllm_config)
        try:
            self._setup_capture(int(engine.host_buffers))
            self._setup_scheduler()
        except BaseException:
            self.close()
            raise
        self._calls = 0
        vc = self.vllm_config
        self.describe = {
            "block_size": vc.cache_config.block_size,
            "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "async_scheduling": vc.scheduler_config.async_scheduling,
            "executor": vc.parallel_config.distributed_executor_backend,
            "host_buffer_pinned": self.pinned,
            "copy_overlaps_prefill": self.overlap,
            "states": str(self.storage.stored_dtype(self.dtype)).removeprefix("torch."),
            "capture_device_bytes": self.capture_device_bytes,
        }

    # --- start-up, as vllm.v1.engine.core.EngineCore does it --------------------------

    def _setup_capture(self, slots: int) -> None:
        self.max_batch_tokens = self.vllm_config.scheduler_config.max_num_batched_tokens
        rows = self.max_batch_tokens + CAPTURE_SLACK_ROWS
        scale_cols = self.storage.scale_columns(len(self.layer_ids))
        plans = self.executor.collective_rpc("capture_setup",
                                             args=(self.layer_ids, rows, scale_cols))
        covered = sorted(c for plan in plans if plan for c in plan["columns"])
        if covered != list(range(len(self.layer_ids))):
            raise RuntimeError(f"capture plan covers layer columns {covered}, expected each "
                               f"of {list(range(len(self.layer_ids)))} once: {plans}")
        self._stages = sorted(plan["pp_rank"] for plan in plans if plan)
        hidden = self.vllm_config.model_config.get_hidden_size()
        for plan in filter(None, plans):  # what memory.py plans (and preflight checked)
            planned = capture_plan(self.max_batch_tokens, len(self.layer_ids), hidden,
                                   self.dtype.itemsize, scale_cols,
                                   buffers=2 if plan["overlap"] else 1).held_bytes
            if plan["device_bytes"] != planned:
                raise RuntimeError(f"capture buffers on PP rank {plan['pp_rank']}: "
                                   f"{plan['device_bytes']} bytes, planned {planned}")
        self.capture_device_bytes = max(plan["device_bytes"] for plan in plans if plan)
        layout = hostbuf.Layout(slots, rows, len(self.layer_ids), hidden,
                                self.storage.stored_dtype(self.dtype), scale_cols,
                                stages=max(plan["pp_size"] for plan in plans if plan))
        self.host = hostbuf.HostBuffer(layout)
        try:
            replies = self.executor.collective_rpc(
                "capture_attach_host", args=(self.host.path, layout, self.host.host))
        finally:
            self.host.unlink()  # every process maps it now: nothing can outlive the job
        self.pinned = all(r["pinned"] for r in replies if r)
        self.overlap = self.pinned and all(p["overlap"] for p in plans if p)
        self._tickets = 0
        self._closing = threading.Event()

    def _setup_scheduler(self) -> None:
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        vc = self.vllm_config
        # Specs and configs are per worker (indexed by global rank, so pipeline
        # stages get their own layers); the executor profiles memory on every platform.
        configs = get_kv_cache_configs(vc, self.executor.get_kv_cache_specs(),
                                       self.executor.determine_available_memory())
        kv_cache_config = generate_scheduler_kv_cache_config(configs)
        vc.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        vc.cache_config.num_cpu_blocks = 0
        self.executor.initialize_from_config(configs)
        par = vc.parallel_config
        # The block size from the built config: MLA backends force 64 or 128 on GPU.
        self.scheduler = Scheduler(
            vllm_config=vc, kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=vc.cache_config.block_size * par.decode_context_parallel_size
            * par.prefill_context_parallel_size)

    # --- one call -------------------------------------------------------------------

    def _run(self, token_ids: list[list[int]], capture: bool) -> dict[str, int]:
        """Schedule every prompt whole and step until all ran; {request id: prompt length}
        in the order of `token_ids`."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request, RequestStatus

        max_len = self.vllm_config.model_config.max_model_len - 1  # + 1 sampled token
        too_long = [i for i, ids in enumerate(token_ids) if len(ids) > max_len]
        if too_long:  # cutting here would be silent: the job truncates or skips, and counts
            raise ValueError(f"prompts {too_long} are longer than max_model_len - 1 = "
                             f"{max_len} tokens; truncate or skip them first")
        if any(len(ids) == 0 for ids in token_ids):
            raise ValueError("an empty prompt: every sample needs at least one token")
        total = sum(map(len, token_ids))
        if total > self.max_batch_tokens:
            raise ValueError(f"{total} tokens in one call; at most {self.max_batch_tokens} "
                             "(max_num_batched_tokens) fit the capture buffers")
        self._calls += 1
        lens: dict[str, int] = {}
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for i, ids in enumerate(token_ids):
            rid = f"c{self._calls}-{i}"
            lens[rid] = len(ids)
            self.scheduler.add_request(Request(request_id=rid, prompt_token_ids=list(ids),
                                               sampling_params=params, pooling_params=None,
                                               eos_token_id=None, arrival_time=0.0))
        self.executor.collective_rpc("capture_reset", args=(capture,))
        while self.scheduler.has_unfinished_requests():
            out = self.scheduler.schedule()
            if out.total_num_scheduled_tokens == 0:
                raise RuntimeError("the scheduler scheduled nothing: KV cache too small for "
                                   "one prompt? (raise model.gpu_memory_utilization)")
            # vLLM 0.16 executes in two phases. Finished requests reach the workers
            # with the next step's output (or the next call's first step).
            if self.executor.execute_model(out) is None:
                self.executor.sample_tokens(None)
            for rid, n in out.num_scheduled_tokens.items():
                if n != lens[rid]:  # would be truncated: every request ends after one step
                    raise RuntimeError(f"request {rid} scheduled {n} of {lens[rid]} tokens "
                                       "in one step; its hidden states would be truncated")
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        return lens

    def prefill(self, batch: Batch) -> None:
        """The same scheduler steps with capture off (the benchmark's baseline)."""
        self._run([s.input_ids for s in batch.samples], capture=False)

    def extract(self, batch: Batch, wait: bool = True) -> ExtractedBatch:
        """Prefill `batch` and capture it into a host slot.

        `wait=False` (the job's loop): return as soon as the copy is under way; on CUDA
        it overlaps the next call's prefill, and `ExtractedBatch.wait()` (the Writer
        calls it) blocks until the slot's ready marks say the rows have landed, then
        refuses NaN/Inf rows. `wait=True` returns only states that are there.
        """
        t0 = time.perf_counter()
        lens = self._run([s.input_ids for s in batch.samples], capture=True)
        slot = self.host.acquire()
        release = _once(lambda: self.host.release(slot))
        self._tickets += 1
        ticket = self._tickets
        try:
            replies = self.executor.collective_rpc("capture_flush", args=(slot, ticket))
            steps, positions = check_replies(replies, len(self.layer_ids))
            spans = locate(steps, positions, lens, list(lens))
        except BaseException:
            release()
            raise
        slot_states = self.host.tensor[slot]
        states = [slot_states[first:first + n] for first, n in spans]
        scales = None
        if self.host.scales is not None:  # [n, 1, 1] or [n, L, 1], as the file stores them
            scales = [self.host.scales[slot, first:first + n].unsqueeze(-1)
                      for first, n in spans]
        eb = ExtractedBatch(batch.samples, states, release=release,
                            seconds=time.perf_counter() - t0, finite_checked=True,
                            scales=scales,
                            ready=_once_result(lambda: self._wait_ready(slot, ticket, spans,
                                                                        batch)))
        if wait:
            try:
                eb.wait()
            except BaseException:
                release()
                raise
        return eb

    def _wait_ready(self, slot: int, ticket: int, spans: list[tuple[int, int]],
                    batch: Batch) -> None:
        """Until every capturing stage's ready mark for `slot` is `ticket`; then the
        device's finite flags of every row."""
        ready = self.host.ready[slot]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while any(int(ready[k]) != ticket for k in self._stages):
            if self._closing.is_set():
                raise RuntimeError("the engine stopped before the device-to-host copy of "
                                   f"samples {[s.index for s in batch.samples][:5]} finished")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the device-to-host copy of slot {slot} did not finish "
                                   f"in {READY_TIMEOUT_S:.0f} s (a worker died?)")
            time.sleep(0.0002)
        finite = self.host.finite[slot, self._stages].bool().all(dim=0)
        bad = [batch.samples[i].index for i, (first, n) in enumerate(spans)
               if not finite[first:first + n].all()]
        if bad:
            raise RuntimeError(f"NaN or Inf in the hidden states of samples {bad}")

    def abort(self) -> None:
        """Unblock waiters of copies that will not finish (the job is failing)."""
        if hasattr(self, "_closing"):
            self._closing.set()

    def close(self) -> None:
        self.abort()
        executor = self.__dict__.pop("executor", None)
        if executor is not None:
            from eagle3_extract import shm_watch

            # What only the workers map (vLLM's CPU communicators' cpushm files): a worker
            # ended before its own cleanup (shutdown's kill, under load) leaves them, and a
            # Hydra multirun starts the next engine in this same process.
            mine = shm_watch.shm_inodes_of(os.getpid())
            maps = {p: shm_watch.shm_inodes_of(p) for p in shm_watch.descendants(os.getpid())}
            workers = set().union(*maps.values()) - mine
            executor.shutdown()
            deadline = time.monotonic() + 5.0  # a worker still exiting maps them yet
            while (any(shm_watch.shm_inodes_of(p) & workers for p in maps)
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            left = shm_watch.remove_unused(workers)
            if left:
                logging.getLogger(__name__).debug("removed what the engine's workers left "
                                                  "in /dev/shm: %s", left)
            # The uni-process executor initialises torch.distributed in this
            # process; tear it down so the next engine (Hydra multirun) starts clean.
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()
        host = self.__dict__.pop("host", None)
        if host is not None:
            host.close()
        if self._affinity:
            os.sched_setaffinity(0, self._affinity)


def _once_result(fn):
    """`fn` run once, by whichever thread asks first; its error re-raised to every caller."""
    lock = threading.Lock()
    state: dict = {}

    def call() -> None:
        with lock:
            if "error" not in state and "done" not in state:
                try:
                    fn()
                    state["done"] = True
                except BaseException as e:  # noqa: BLE001 - re-raised below, to each caller
                    state["error"] = e
        if "error" in state:
            raise state["error"]

    return call


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
