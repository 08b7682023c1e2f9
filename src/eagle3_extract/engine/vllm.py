"""The production engine: our own driver over vLLM 0.16's engine core.

Why not speculators 0.3.0's generator: on vLLM 0.16 almost every line of it
had to change (docs/engine.md), and upstream deleted it in v0.4.1. What is
left is what vLLM's own `EngineCore` does, in the order it does it:
`EngineArgs` -> `VllmConfig`, `Executor.get_class`, KV cache sizing with
`get_kv_cache_configs`, a `Scheduler`, and a step loop of
`execute_model`/`sample_tokens`. The capture itself is engine/worker.py,
loaded into the workers through vLLM's `worker_extension_cls`.

Its EngineArgs, and the settings that would silently truncate captures (fixed, and
refused in `engine.vllm_args`), are engine/vllm_args.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from eagle3_extract.layout import Storage
from eagle3_extract.types import Batch, ExtractedBatch
from eagle3_extract.engine import ModelInfo, hostbuf
from eagle3_extract.engine.memory import CAPTURE_SLACK_ROWS, capture_plan
from eagle3_extract.engine.vllm_args import engine_args, quiet_known_warnings, size_cpu_kv_cache

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import EngineConfig, ModelConfig

# A call's device-to-host copy takes milliseconds; this long without its ready mark means
# a worker is gone.
READY_TIMEOUT_S = 120.0


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
