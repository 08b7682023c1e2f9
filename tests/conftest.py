"""Shared fixtures: tiny models (built from committed configs) and engines.

Engines are expensive to start (15-40 s on 2 cores), so tests share them per
module. Every engine here is the real one: vLLM 0.16's CPU build and HF
transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

# Before vLLM is imported anywhere: small KV cache (faster start), MLA off (not
# supported on CPU), two CPU workers pinned to one core each for TP/PP=2.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_MLA_DISABLE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines held by a module's fixtures wait between tests: their workers sleep after 3 s
# idle instead of spinning a core that the HF reference (or CI's other streams) needs.
os.environ.setdefault("VLLM_SLEEP_WHEN_IDLE", "1")
# setuptools before any test imports the stdlib's distutils: vLLM's import of
# torch.utils.cpp_extension imports setuptools, whose distutils override asserts (and fails
# the test, depending on test order) when the stdlib copy was loaded first.
import setuptools  # noqa: E402,F401


class _ShmOfThisSession:
    """Notes the /dev/shm files that this pytest process and its descendants map or hold
    open, once a second while a module runs. CI runs the lanes side by side on one
    machine: an entry another lane's job holds (or leaves for its own watcher to remove
    when that job ends) is not this module's leak."""

    def __init__(self):
        import threading

        self.noted: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tests-shm-notes")
        self._thread.start()

    def note(self) -> None:
        from eagle3_extract import shm_watch

        for pid in shm_watch.descendants(os.getpid()) | {os.getpid()}:
            self.noted |= shm_watch.shm_inodes_of(pid)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.note()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.note()


def _leaked_shm(before: set[str], ours: set[int]) -> list[str]:
    """/dev/shm entries made since `before`, mapped by this session's processes at some
    point, that no live process maps or holds open now."""
    from eagle3_extract import shm_watch

    new = {i: paths for i, paths in shm_watch.entries().items()
           if i in ours and not set(paths) <= before}
    if not new:
        return []
    used = shm_watch.in_use()
    return sorted(p for i, paths in new.items() if i not in used for p in paths)


@pytest.fixture(autouse=True)
def own_tokenized_cache(tmp_path_factory, monkeypatch):
    """Each test tokenizes for itself (a set another test made is not reused; the jobs it
    starts inherit this): tests/test_tokenized_cache.py tests the reuse."""
    monkeypatch.setenv("EAGLE3_TOKENIZED_CACHE", str(tmp_path_factory.mktemp("tokenized")))


_MODULE_MEMORY: list[tuple[str, int, int]] = []  # module, peak RSS MiB after it, its growth


@pytest.fixture(scope="module", autouse=True)
def note_memory(request):
    """The pytest process's peak resident memory after each module (CI's memory budget:
    the run's table names the stage, this names the module that grew it)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    yield
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    _MODULE_MEMORY.append((request.module.__name__, after, after - before))
    # What the module's models freed goes back to the system, not kept in glibc's heap for
    # the next module (which would raise the lane's resident memory by it).
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def pytest_terminal_summary(terminalreporter):
    grew = sorted((m for m in _MODULE_MEMORY if m[2] >= 256), key=lambda m: -m[2])
    if grew:
        terminalreporter.write_sep("=", "modules that raised pytest's peak RSS by >= 256 MiB")
        for name, after, growth in grew:
            terminalreporter.write_line(f"{growth:>7} MiB  (peak {after} MiB)  {name}")


@pytest.fixture(scope="module", autouse=True)
def no_shm_left_behind(request):
    """No /dev/shm entry outlives the tests of a module, killed jobs' included (their
    watcher, shm_watch.py, or Python's resource tracker removes them within seconds)."""
    import time

    from eagle3_extract import shm_watch

    if not shm_watch.SHM.is_dir():
        yield
        return
    before = {str(p) for p in shm_watch.SHM.iterdir()}
    notes = _ShmOfThisSession()
    yield
    notes.stop()
    deadline = time.monotonic() + 20
    while (left := _leaked_shm(before, notes.noted)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        for path in left:  # so that one leak is not blamed on every later module
            Path(path).unlink(missing_ok=True)
        pytest.fail(f"{request.module.__name__} left {left} in /dev/shm", pytrace=False)


def model_cfg(arch: str = "llama", dtype: str = "bfloat16", **kw) -> SimpleNamespace:
    base = dict(path="tiny", tiny_config=arch, tokenizer=None, trust_remote_code=False,
                dtype=dtype, max_model_len=1024, tensor_parallel_size=1,
                pipeline_parallel_size=1, gpu_memory_utilization=0.5, quantization=None,
                load_format=None)
    base.update(kw)
    return SimpleNamespace(**base)


def engine_cfg(name: str, **kw) -> SimpleNamespace:
    base = dict(name=name, token_budget=1024, max_num_seqs=16, host_buffers=2,
                enforce_eager=True, device="cpu", distributed_executor_backend=None,
                vllm_args=None)
    base.update(kw)
    return SimpleNamespace(**base)


def make_engine(name: str, layer_ids=None, arch="llama", dtype="bfloat16", model_kw=None,
                **engine_kw):
    from eagle3_extract.engine import inspect_model, resolve_layer_ids
    from eagle3_extract.engine.start import build_engine
    from eagle3_extract.layout import Storage

    m = model_cfg(arch, dtype, **(model_kw or {}))
    info = inspect_model(m)
    ids = resolve_layer_ids(layer_ids, info.num_layers)
    return build_engine(engine_cfg(name, **engine_kw), m, info, ids, Storage())


def rel_err(a, b):
    """Per-token relative error [T, L] of a against reference b."""
    a, b = a.float(), b.float()
    return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)


@pytest.fixture
def offline(monkeypatch):
    """No hub access, no output root from the environment: the job as a test needs it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("EAGLE3_OUTPUT_ROOT", raising=False)


@pytest.fixture(scope="session")
def tiny_paths():
    from eagle3_extract.models.tiny import build_tiny_model

    return {a: build_tiny_model(a) for a in ("llama", "qwen3", "deepseek_v3")}


def drafter(verifier, t2d=None, d2t=None):
    """speculators 0.3.0's EAGLE-3 draft model over a verifier (full draft vocabulary unless
    t2d/d2t are given): its `verifier_norm` and `verifier_lm_head` compute the targets."""
    import torch
    from transformers import AutoConfig, LlamaConfig

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    vc = AutoConfig.from_pretrained(verifier)
    if t2d is None:
        t2d = torch.ones(vc.vocab_size, dtype=torch.bool)
        d2t = torch.zeros(vc.vocab_size, dtype=torch.long)
    layer = LlamaConfig(hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                        num_attention_heads=vc.num_attention_heads, num_hidden_layers=1,
                        num_key_value_heads=vc.num_key_value_heads, vocab_size=vc.vocab_size,
                        rms_norm_eps=vc.rms_norm_eps, head_dim=getattr(vc, "head_dim", None))
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=int(t2d.sum()),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig()],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(verifier), architectures=vc.architectures)))
    return Eagle3DraftModel(cfg, t2d=t2d, d2t=d2t)


def _start_times() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, kernel start time, command line) of every live process (read
    as the job's watcher reads them, shm_watch.py)."""
    from eagle3_extract import shm_watch

    out = {}
    for pid, ppid in shm_watch._parents().items():
        start = shm_watch._start_time(pid)
        if start is None:  # gone, or a zombie
            continue
        try:  # vLLM names its processes in their argv (VLLM::EngineCore), not comm
            name = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        out[pid] = (ppid, start, name.decode(errors="replace").strip()[:120])
    return out


# How long an engine may take to come up before a test that waits for it gives up: under
# CI's load (five streams on two cores) a vLLM CPU engine's start took over 180 s once.
ENGINE_UP_S = 480


def follow_tree(proc, until, timeout: float = ENGINE_UP_S) -> dict[int, tuple[int, str]]:
    """Follow `proc`'s process tree until `until(names)` holds for the names seen in it
    or `proc` ends; pid -> (kernel start time, name) of everything seen."""
    import time

    seen: dict[int, tuple[int, str]] = {}
    deadline = time.monotonic() + timeout
    while True:
        procs = _start_times()
        grew = True
        while grew:
            grew = False
            for pid, (ppid, start, name) in procs.items():
                if pid in seen and seen[pid][0] == start:
                    seen[pid] = (start, name)  # vLLM renames its processes once started
                elif pid not in seen and (ppid == proc.pid or ppid in seen):
                    seen[pid] = (start, name)
                    grew = True
        if until([n for _, n in seen.values()]) or proc.poll() is not None:
            return seen
        assert time.monotonic() < deadline, f"not ready in {timeout} s: {seen}"
        time.sleep(0.3)


def still_alive(seen: dict[int, tuple[int, str]], grace: float = 0.0) -> list[str]:
    """What of `seen` is alive (as "pid name"), waiting up to `grace` s for it to go."""
    import time

    end = time.monotonic() + grace
    while True:
        procs = _start_times()
        alive = [f"{pid} {name}" for pid, (start, name) in seen.items()
                 if pid in procs and procs[pid][1] == start]
        if not alive or time.monotonic() >= end:
            return alive
        time.sleep(0.3)


def sigkill_main_leaves_nothing(proc, ready, timeout: float = ENGINE_UP_S, grace: float = 15
                                ) -> list[str]:
    """Follow `proc`'s process tree until `ready(names)` holds for the names seen in it,
    SIGKILL only `proc` (not its group), and return what of the tree is still alive
    `grace` seconds later (as "pid name"): a job's processes must not outlive it."""
    import signal

    seen = follow_tree(proc, ready, timeout)
    assert proc.poll() is None, f"the job ended before it was killed (rc {proc.returncode}): {seen}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return still_alive(seen, grace)
