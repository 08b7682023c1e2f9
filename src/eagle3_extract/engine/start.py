"""The engine loads while preflight tokenizes.

Tokenizing a shard (CPU) and starting the engine (weights from disk onto the devices: 20
minutes for Kimi-K2.5) need different resources; one after the other, a job's wall is
their sum. The job starts the engine in a thread once every check that needs no tokens
has passed, and takes it after tokenization: the wall is about max(tokenize, start) +
extraction. An error on either side stops both: a failed start is raised when the job
takes the engine (tokenization ran to its end or failed first: either error is one
line), and a failed tokenization (or an interrupt) cancels the start: the processes the
start made are ended, and an engine that came up anyway is closed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from eagle3_extract.layout import Storage
from eagle3_extract.models.config import ModelInfo
from eagle3_extract.types import Engine

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)

# After a cancel, the start's processes get SIGTERM, then SIGKILL after this long.
KILL_AFTER_S = 5.0
JOIN_S = 60.0  # a start thread still running this long after its processes ended: leave it


def starts_apart(engine: EngineConfig) -> bool:
    """Whether the engine can start in a thread and run in the main one: vLLM's workers in
    processes of their own (mp, ray), or the HF engine. An in-process vLLM worker (the
    uni executor, vLLM's choice for one device when none is named) sets per-thread state
    where it starts: torch's CPU threads and affinity, the CUDA device; the CPU attention
    then refuses a forward from another thread (thread_num 2 vs. 1)."""
    if str(engine.name) == "hf":
        return True
    return str(engine.distributed_executor_backend) in ("mp", "ray")


def build_engine(engine: EngineConfig, model: ModelConfig, info: ModelInfo,
                 layer_ids: list[int], storage: Storage, verbose: bool = False) -> Engine:
    """The engine of `engine.name`, from its own config groups; `storage`: how the states
    are stored, as the job's preflight built it (layout.Storage, made once per job);
    `verbose`: vLLM's weight-loading progress bar."""
    name = engine.name
    if name == "hf":
        from eagle3_extract.engine.hf import HFEngine

        return HFEngine(engine, model, info, layer_ids, storage)
    if name == "vllm":
        from eagle3_extract.engine.vllm import VllmEngine

        return VllmEngine(engine, model, info, layer_ids, storage, verbose)
    raise ValueError(f"engine={name!r}: choose engine=vllm or engine=hf")


class EngineStart:
    """`build_engine(engine, model, info, layer_ids, storage)` in a thread, started now."""

    def __init__(self, engine: EngineConfig, model: ModelConfig, info: ModelInfo,
                 layer_ids: list[int], storage: Storage, verbose: bool = False):
        # the kernel's clock for process start times (/proc/PID/stat): ticks since boot
        self._since = int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._error: BaseException | None = None
        self._cancelled = False
        self.start_s: float | None = None
        self.waited_s = 0.0
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._start,
                                        args=(engine, model, info, layer_ids, storage,
                                              verbose),
                                        name="engine-start", daemon=True)
        self._thread.start()

    def _start(self, engine_cfg: EngineConfig, model: ModelConfig, info: ModelInfo,
               layer_ids: list[int], storage: Storage, verbose: bool) -> None:
        try:
            engine = build_engine(engine_cfg, model, info, layer_ids, storage, verbose)
        except BaseException as e:  # raised where the job takes the engine
            with self._lock:
                self._error = e
            return
        finally:
            self.start_s = time.perf_counter() - self._t0
        with self._lock:
            if not self._cancelled:
                self._engine = engine
                return
        engine.close()  # cancelled while it came up

    def take(self) -> Engine:
        """The engine, once started (waits); the start's error if it failed."""
        t = time.perf_counter()
        self._thread.join()
        self.waited_s = time.perf_counter() - t
        with self._lock:
            if self._error is not None:
                raise self._error
            engine, self._engine = self._engine, None
        return engine

    def cancel(self) -> None:
        """Stop the start: end the processes it made, close an engine that came up."""
        with self._lock:
            self._cancelled = True
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
            return
        if not self._thread.is_alive():
            return
        children = _started_since(self._since)
        for sig, wait in ((signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, JOIN_S)):
            for pid in children:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            self._thread.join(wait)
            if not self._thread.is_alive():
                return
        log.warning("the engine start did not stop within %.0f s; leaving it", JOIN_S)


def _started_since(since_ticks: int) -> list[int]:
    """This process's descendants started after `since_ticks` (the engine start's: not
    the job's watcher, nor what this process started before)."""
    from eagle3_extract import shm_watch

    return sorted(p for p in shm_watch.descendants(os.getpid()) if not shm_watch._is_watcher(p)
                  and (shm_watch._start_time(p) or 0) >= since_ticks - 1)
