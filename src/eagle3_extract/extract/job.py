"""One extraction job: preflight, the loop data -> batching -> engine -> writer, the manifest.

Preflight first: everything that can be wrong with a config (model shape, layer
ids, tokenizer, dataset, output dir, disk space, run identity, vLLM engine
args) is checked in seconds, before the engine spends minutes loading a model.
A preflight failure is a PreflightError whose message names the key to change
(the cli prints it and exits 2).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3_extract.dataset import token_freq
from eagle3_extract.dataset.batching import iter_batches, plan_batches, shard_owner, todo_mask
from eagle3_extract.config import ConfigError, PreflightError, max_length, validate
from eagle3_extract.errors import Interrupted, JobError, raise_interrupted
from eagle3_extract.dataset.render import Renderer
from eagle3_extract.dataset.samples import Tokenized, build_dataset, load_tokenizer
from eagle3_extract.dataset.rows import read_nonempty
from eagle3_extract.lock import ShardLock
from eagle3_extract.layout import (
    RUN_JSON,
    TOKEN_FREQ_JSON,
    foreign_entries,
    Storage,
    clean_stale_temps,
    remove_links,
    file_bytes,
    finished_indices,
    layout_pattern,
    manifest_name,
    sample_path,
    temp_path,
    verified_files,
)
from eagle3_extract.manifest import (
    Manifest,
    chat_template_sha256,
    claim_run_json,
    clean_json_temps,
    new_manifest,
    run_identity,
    retract_run_json,
    write_json_atomic,
)
from eagle3_extract.extract.progress import Progress
from eagle3_extract.lock import process_identity
from eagle3_extract.types import Batch, Engine
from eagle3_extract.extract.writer import Writer

log = logging.getLogger("eagle3_extract")
MANIFEST_EVERY_S = 60.0
# What a trainer must do with the last stored layer (id N) to get the target's logits.
TARGETS = {
    "safetensors": "pre-norm: the last layer is id N, the state before the final norm; "
                   "targets = lm_head(final_norm(last))",
    "speculators_pt": "pre-norm: the last tensor of hidden_states is id N, before the final "
                      "norm; speculators 0.3.0 in this image applies the verifier's norm "
                      "(patch 0001, speculators PR #313), as do speculators >= 0.4.0",
}
# Set by the data-parallel launcher: the job's tokenized samples, made once (parallel.py).
TOKENIZED_ENV = "EAGLE3_TOKENIZED"


@dataclass
class Plan:
    """Everything preflight established; the extraction needs nothing else."""

    cfg: Any
    resolved: dict[str, Any]
    root: Path
    info: Any
    layer_ids: list[int]
    ident: dict[str, Any]
    mine: Tokenized  # this shard's usable samples
    todo: Tokenized  # of those, the ones without a final file
    resumed: int  # finished files found at start (this shard)
    stale_temps: int
    damaged: dict[int, str]  # final files of this shard that were not whole: removed, redone
    links: list[str]  # symbolic links where the job's files belong: removed
    preflight_s: float
    lock: ShardLock | None = None  # this job's shard of root, until close()
    storage: Storage = Storage()  # how the states are stored (output.dtype)
    disk_need: int = 0  # bytes the files still to write take, about (bytes_needed)
    engine_start: Any = None  # engine/start.py's EngineStart, loading since preflight
    engine_start_at_s: float | None = None  # how far into preflight it began loading

    def close(self) -> None:
        if self.engine_start is not None:  # not taken: stopped (a no-op once taken)
            self.engine_start.cancel()
            self.engine_start = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    @property
    def shard(self) -> tuple[int, int]:
        return int(self.cfg.shard.index), int(self.cfg.shard.count)


def resolve_config(cfg: Any) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        missing = re.search(r"Missing mandatory value: (\S+)", msg)
        if missing:
            key = missing.group(1) if "." in missing.group(1) else (e.full_key or missing.group(1))
            raise ConfigError(
                f"{key} is missing: set it on the command line (e.g. "
                "layers=explicit layers.ids=[1,3,5]; dataset=local dataset.path=/data/x.jsonl)"
            ) from e
        raise ConfigError(f"config error: {msg}") from e


def check_own_dir(root: Path) -> None:
    """A folder holding someone else's files is never written into (nor is anything in
    it replaced): refused before the job makes a file there."""
    try:
        foreign = foreign_entries(root)
    except OSError as e:
        raise PreflightError(f"output.dir={str(root)!r} cannot be read ({e.strerror or e}); "
                             "fix its permissions or set output.dir elsewhere") from e
    if foreign:
        shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
        raise PreflightError(
            f"output.dir={str(root)!r} is not empty and holds no eagle3-extract run (no "
            f"{RUN_JSON}; it has {shown}); nothing in it was touched: set output.dir to a "
            "new or empty directory")


def check_writable(root: Path) -> None:
    check_own_dir(root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = temp_path(root / ".write-probe")
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise PreflightError(
            f"output.dir={str(root)!r} is not writable ({e.strerror or e}); set output.dir "
            "to a writable directory"
        ) from e


def _check_engine_args(cfg: Any) -> None:
    if str(cfg.engine.name) == "vllm":
        from eagle3_extract.engine.vllm import check_vllm_args

        check_vllm_args(cfg)


def _launcher_samples(cfg: Any, info: Any, layer_ids: list[int],
                      max_len: int) -> tuple[Tokenized, dict[str, Any]] | None:
    """The samples and run identity the data-parallel launcher made for this job, or None.

    The launcher tokenized the dataset once (parallel.py). The set is trusted only if
    this replica's own config yields the same run identity (the chat template's hash is
    the launcher's: the tokenizer is not loaded again).
    """
    artifact = os.environ.get(TOKENIZED_ENV)
    if not artifact:
        return None
    try:
        data, meta = Tokenized.load(Path(artifact))
        template = meta["ident"]["model"]["chat_template_sha256"]
    except (OSError, ValueError, KeyError) as e:
        raise PreflightError(f"{TOKENIZED_ENV}={artifact}: unreadable ({e}); unset it to "
                             "tokenize the dataset here") from e
    ident = run_identity(cfg, info, layer_ids, template, max_len)
    if ident["run_id"] != meta["ident"]["run_id"]:
        raise PreflightError(f"{TOKENIZED_ENV}={artifact} was tokenized for run "
                             f"{meta['ident']['run_id']}, this job is run {ident['run_id']}; "
                             "unset it to tokenize the dataset here")
    log.info("samples from the launcher's tokenized set %s", artifact)
    return data, ident


def preflight(cfg: Any, start_engine: bool = False) -> Plan:
    """Check the config against the model, data and disk; raise PreflightError.

    `start_engine`: once every check that needs no tokens has passed, the engine starts
    loading (engine/start.py) while this shard is tokenized; `Plan.engine_start` has it.
    """
    from eagle3_extract.engine import inspect_model, resolve_layer_ids
    from eagle3_extract.engine.memory import check_capture_memory
    from eagle3_extract.engine.start import EngineStart, starts_apart

    t0 = time.perf_counter()
    validate(cfg)
    resolved = resolve_config(cfg)
    root = Path(os.path.abspath(os.path.expanduser(str(cfg.output.dir))))
    # Cheap checks first: a wrong path should not wait for a model config to load.
    check_writable(root)
    rows = None if os.environ.get(TOKENIZED_ENV) else read_nonempty(cfg.dataset)
    max_len = max_length(cfg)
    if cfg.engine.token_budget < max_len:
        raise PreflightError(
            f"engine.token_budget={cfg.engine.token_budget} is smaller than the longest "
            f"allowed sample ({max_len} tokens = dataset.max_length or model.max_model_len - 1)"
            f"; raise engine.token_budget to >= {max_len} or lower dataset.max_length"
        )
    _check_engine_args(cfg)
    try:
        info = inspect_model(cfg.model)
    except (ValueError, OSError) as e:
        raise PreflightError(f"model.path={str(cfg.model.path)!r}: {e}") from e
    limit = info.max_positions
    if limit and int(cfg.model.max_model_len) > limit:
        raise PreflightError(
            f"model.max_model_len={cfg.model.max_model_len} is above the model's limit of "
            f"{limit} tokens (config.json of {info.path}); set model.max_model_len <= {limit}")
    try:
        layer_ids = resolve_layer_ids(
            None if cfg.layers.ids is None else list(cfg.layers.ids), info.num_layers
        )
    except ValueError as e:
        raise PreflightError(f"layers.ids: {e}") from e
    storage = Storage.from_output(cfg.output)  # how the states are stored: built once
    try:  # a GPU plan that cannot fit fails here, not after the weights load
        check_capture_memory(cfg, info, layer_ids, storage.scale_columns(len(layer_ids)))
    except ValueError as e:
        raise PreflightError(str(e)) from e
    from_launcher = _launcher_samples(cfg, info, layer_ids, max_len)
    if from_launcher:
        data, ident = from_launcher
    else:
        tokenizer = load_tokenizer(info.tokenizer_path, bool(cfg.model.trust_remote_code),
                                   info.vocab_size)
        renderer = Renderer(tokenizer)  # raises if there is no chat template
        from eagle3_extract.dataset.regenerated import check_regenerated_input

        check_regenerated_input(str(cfg.dataset.path), tokenizer, info)
        ident = run_identity(cfg, info, layer_ids, chat_template_sha256(tokenizer), max_len)
    index, count = int(cfg.shard.index), int(cfg.shard.count)
    lock = ShardLock.acquire(root, (index, count))  # before anything in root is touched
    engine_start = None
    engine_start_at_s = None
    claimed = False
    try:
        # The directory's identity, fixed by the first shard before any sample exists
        # (one atomic step): every later or concurrent shard is checked against it.
        claimed = not claim_run_json(root, ident)
        early = start_engine and bool(cfg.engine.start_early) and not bool(cfg.dry_run)
        # a rerun of a finished shard likely has nothing to do: no model load for it (the
        # file check after tokenization decides)
        before = _previous_manifest(root, (index, count), ident["run_id"])
        early = early and starts_apart(cfg) and not (before and before.status == "complete")

        def start() -> None:  # after the tokenizer workers are forked (data.tokenize_rows)
            nonlocal engine_start, engine_start_at_s
            if early and engine_start is None:
                engine_start_at_s = time.perf_counter() - t0
                engine_start = EngineStart(cfg, info, layer_ids, storage)

        if from_launcher:  # the launcher's shard, tokenized once: this replica's part
            start()
            mine = data.shard(index, count)
        else:  # only this shard's rows are rendered and tokenized, once per key
            from eagle3_extract.dataset import tokenized_cache as tc

            key = tc.key_of(ident["dataset"], tc.tokenizer_identity(info.tokenizer_path),
                            ident["model"]["chat_template_sha256"], (index, count))
            mine, reused = tc.cached(key, lambda: build_dataset(
                cfg.dataset, renderer.tok, max_len, rows, (index, count), on_workers=start))
            start()  # reused: nothing was forked
            if reused:
                log.info("tokenized set reused (%s)", tc.cache_dir() / key)
        fmt = str(cfg.output.format)
        # names are not trusted: headers (and with output.recheck=content, every byte) are
        # read, of this shard's files only
        owned = shard_owner(index, count)
        whole, broken = verified_files(root, fmt, owned, ident["run_id"],
                                       str(cfg.output.recheck) == "content")
        damaged = dict(broken)
        todo = mine.select(todo_mask(mine.indices, whole))
        disk_need = _check_disk(root, info, layer_ids, todo, storage)
        linked = remove_links(root)  # never written or read through (layout.links)
        for i in damaged:  # redone by this run
            sample_path(root, i, int(cfg.output.files_per_dir), fmt).unlink(missing_ok=True)
        stale = clean_stale_temps(root, owned)
        clean_json_temps(root, [manifest_name(index, count),
                                manifest_name(index, count, "token_freq")])
    except BaseException:
        if engine_start is not None:
            engine_start.cancel()
        if claimed:  # nothing of the run exists yet: the corrected rerun fixes it anew
            retract_run_json(root, ident)
        lock.release()
        raise
    return Plan(
        cfg=cfg, resolved=resolved, root=root, info=info, layer_ids=layer_ids, ident=ident,
        mine=mine, todo=todo, resumed=len(mine) - len(todo), stale_temps=stale, links=linked,
        damaged=damaged, preflight_s=time.perf_counter() - t0, lock=lock,
        storage=storage, disk_need=disk_need, engine_start=engine_start,
        engine_start_at_s=engine_start_at_s,
    )


def bytes_needed(info: Any, layer_ids: list[int], tokens: int, samples: int,
                 storage: Storage = Storage()) -> int:
    """Disk for `samples` files of `tokens` tokens in all (states, scales, ids, mask,
    headers)."""
    per_token = storage.bytes_per_token(len(layer_ids), info.hidden_size, info.dtype) + 9
    return tokens * per_token + samples * 4096


def _check_disk(root: Path, info: Any, layer_ids: list[int], todo: Tokenized,
                storage: Storage) -> int:
    need = bytes_needed(info, layer_ids, int(todo.lengths.sum()), len(todo), storage)
    free = shutil.disk_usage(root).free
    if need > free:
        per = storage.bytes_per_token(len(layer_ids), info.hidden_size, info.dtype)
        raise PreflightError(
            f"output.dir={str(root)!r}: {len(todo)} samples need about {need / 1e9:.2f} GB "
            f"({int(todo.lengths.sum())} tokens x {per} bytes: {len(layer_ids)} layers x "
            f"hidden {info.hidden_size}, {storage.dtype}), only {free / 1e9:.2f} GB "
            "free; free space, set output.dir elsewhere, output=fp8 (half the bytes), or "
            "lower dataset.max_samples"
        )
    return need


@dataclass
class LoopTimes:
    """Where the loop's wall time went: in engine.extract, blocked in submit (every host
    slot in flight), and draining the writer after the last batch."""

    extract_s: float = 0.0
    submit_s: float = 0.0
    drain_s: float = 0.0
    engine_s: float = 0.0  # as the engine measured its own calls
    batches: int = 0


def extraction_loop(engine: Engine, writer: Writer, batches: Iterable[Batch],
                    tick: Callable[[], None] | None = None) -> LoopTimes:
    """The job's hot loop, also what the benchmark times: extract batch i while the
    writer threads write batch i-1, then drain the writer."""
    times = LoopTimes()
    try:
        for batch in batches:
            t0 = time.perf_counter()
            eb = engine.extract(batch, wait=False)  # the Writer waits for the copy
            t1 = time.perf_counter()
            writer.submit(eb)
            times.extract_s += t1 - t0
            times.submit_s += time.perf_counter() - t1
            times.engine_s += eb.seconds
            times.batches += 1
            if tick is not None:
                tick()
    except BaseException:
        abort = getattr(engine, "abort", None)
        if abort is not None:  # copies that will not finish must not block the drain
            abort()
        try:
            writer.close()  # write what was extracted; the original error goes on
        except Exception as e:  # noqa: BLE001
            log.error("writer: %s", e)
        raise
    t0 = time.perf_counter()
    writer.close()  # re-raises the first writer error
    times.drain_s = time.perf_counter() - t0
    return times


# The engine blocked on the writer (every host slot unwritten) for more than this share of
# the extraction: the disk, not the engine, set the pace.
DISK_BOUND_SHARE = 0.05


def disk_limit_note(loop: LoopTimes, extract_s: float, nbytes: int, threads: int) -> str | None:
    """One line when the writer, not the engine, was the limit; None otherwise. (The final
    drain, one batch's writes, is not counted: every run has it.)"""
    if extract_s <= 0 or loop.submit_s <= DISK_BOUND_SHARE * extract_s:
        return None
    return (f"the disk was the limit: the engine waited {loop.submit_s:.1f} s "
            f"({loop.submit_s / extract_s:.0%} of the extraction) for the writer, which wrote "
            f"{nbytes / max(extract_s, 1e-9) / 1e9:.2f} GB/s with output.writer_threads="
            f"{threads}; more writer threads (output.writer_threads), a faster output.dir "
            "or output=fp8 (half the bytes) would raise the rate")


def new_writer(plan: Plan, engine: Engine, on_sample: Callable | None = None) -> Writer:
    cfg = plan.cfg
    return Writer(plan.root, str(cfg.output.format), int(cfg.output.files_per_dir),
                  plan.layer_ids, plan.info.hidden_size,
                  plan.storage.stored_dtype(plan.info.dtype),
                  plan.ident["run_id"], threads=int(cfg.output.writer_threads),
                  max_pending=int(cfg.engine.host_buffers), on_sample=on_sample)


def plan_engine_batches(plan: Plan, engine: Engine) -> list:
    budget = int(plan.cfg.engine.token_budget)
    budget = min(budget, int(getattr(engine, "max_batch_tokens", budget) or budget))
    return plan_batches(plan.todo.lengths, budget, int(plan.cfg.engine.max_num_seqs))


def run(cfg: Any) -> dict[str, Any]:
    """Run one job (one shard, one engine); return the final manifest as a dict."""
    t_start = time.perf_counter()
    if int(cfg.parallel.data_parallel_size) > 1:
        raise ConfigError(
            "parallel.data_parallel_size > 1 runs one process per replica: use the "
            "eagle3-extract command (or eagle3_extract.extract.parallel.launch), not job.run()"
        )
    # SIGTERM (what a cluster sends) stops the job as Ctrl-C does: in-flight writes
    # finish, the manifest says "interrupted", the rerun resumes.
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, raise_interrupted) if main else None
    try:
        plan = preflight(cfg, start_engine=True)
        try:
            return _run(plan, t_start)
        finally:
            plan.close()
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)


def _log_plan(plan: Plan) -> None:
    """What preflight found, as the user reads it before the engine runs."""
    mine, todo = plan.mine, plan.todo
    log.info(
        "preflight ok in %.1fs: %d samples for this shard (%d tokens), %d already done, "
        "%d to do; layers %s; output %s",
        plan.preflight_s, len(mine), int(mine.lengths.sum()), plan.resumed, len(todo),
        plan.layer_ids, plan.root,
    )
    per_token = plan.storage.bytes_per_token(len(plan.layer_ids), plan.info.hidden_size,
                                             plan.info.dtype)
    log.info("disk: about %.2f GB to write (%d bytes a token, states %s), %.2f GB free",
             plan.disk_need / 1e9, per_token,
             "fp8 + scales" if plan.storage.fp8 else str(plan.info.dtype).removeprefix(
                 "torch."), shutil.disk_usage(plan.root).free / 1e9)
    if plan.links:
        log.warning("removed %d symbolic links where this job's files belong (%s%s): "
                    "nothing is written or read through them; what they held is redone",
                    len(plan.links), ", ".join(plan.links[:3]),
                    ", ..." if len(plan.links) > 3 else "")
    if plan.stale_temps:
        log.info("removed %d stale temp files from an interrupted run", plan.stale_temps)
    if plan.damaged:
        first = next(iter(plan.damaged.items()))
        log.warning("%d sample files were not whole and will be redone (e.g. index %d: %s)",
                    len(plan.damaged), *first)


class ShardRecord:
    """This shard's manifest while the job runs: written at each change of state and at
    least every MANIFEST_EVERY_S while it extracts, so eagle3-status sees the progress and
    tells a killed job (its process) from a live one."""

    def __init__(self, plan: Plan):
        cfg = plan.cfg
        fmt, per_dir = str(cfg.output.format), int(cfg.output.files_per_dir)
        self.plan, self.root = plan, plan.root
        self.manifest = m = new_manifest(plan.resolved, plan.ident, plan.info, plan.layer_ids,
                                         layout_pattern(fmt, per_dir), plan.shard)
        m.output["targets"] = TARGETS[fmt]
        m.process = process_identity()
        m.data = plan.mine.report
        before = _previous_manifest(plan.root, plan.shard, plan.ident["run_id"])
        self.produced = dict(before.produced_by or {}) if before else {}
        if before and before.engine:
            m.engine = before.engine  # replaced only if this run starts an engine
        self.engine_name = str(cfg.engine.name)
        self.timings: dict[str, float] = {"preflight_s": round(plan.preflight_s, 3)}
        self.writer: Writer | None = None
        self.tokens_mine = int(plan.mine.lengths.sum())
        self.tokens_before = self.tokens_mine - int(plan.todo.lengths.sum())
        self._last = time.monotonic()

    def write(self, state: str) -> None:
        m, plan, writer = self.manifest, self.plan, self.writer
        done_now = writer.written if writer else 0
        m.status = state
        m.updated = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        m.progress = {"done_at_start": plan.resumed, "written_this_run": done_now,
                      "to_do_at_start": len(plan.todo), "samples": len(plan.mine),
                      "tokens": self.tokens_mine,
                      "tokens_done": self.tokens_before + (writer.tokens if writer else 0)}
        m.timings = self.timings
        name = self.engine_name
        m.produced_by = {**self.produced, name: self.produced.get(name, 0) + done_now}
        if not m.produced_by[name]:
            del m.produced_by[name]
        m.write(self.root)

    def tick(self) -> None:
        if time.monotonic() - self._last > MANIFEST_EVERY_S:
            self._last = time.monotonic()
            self.write("running")


def _run(plan: Plan, t_start: float) -> dict[str, Any]:
    record = ShardRecord(plan)
    _log_plan(plan)
    if bool(plan.cfg.dry_run):
        log.info("dry_run: preflight only, nothing extracted")
        return {"status": "dry_run", "preflight_s": plan.preflight_s, "samples": len(plan.mine),
                "to_do": len(plan.todo)}
    record.write("running")
    _extract(plan, record)
    _finish(plan, record, t_start)
    return record.manifest.to_dict()


def _extract(plan: Plan, record: ShardRecord) -> None:
    """Every sample still to do, through the engine to the writer. Whatever stops it, the
    engine is closed and the manifest says how it ended (interrupted, failed)."""
    cfg, todo, timings = plan.cfg, plan.todo, record.timings
    engine = progress = None
    status = "failed"
    reserve = _Reserve(plan.root / f".reserve-{manifest_name(*plan.shard)}")
    try:
        if len(todo):
            engine = _take_engine(plan, timings)
            record.manifest.engine = {"name": record.engine_name,
                                      "describe": getattr(engine, "describe", None)}
            batches = plan_engine_batches(plan, engine)
            progress = Progress(len(todo), int(todo.lengths.sum()))
            record.writer = writer = new_writer(plan, engine, on_sample=progress.on_sample)
            t = time.perf_counter()
            loop = extraction_loop(engine, writer, iter_batches(todo, batches), record.tick)
            timings["extract_s"] = round(time.perf_counter() - t, 3)
            timings["engine_s"] = round(loop.engine_s, 3)
            timings["writer_wait_s"] = round(loop.submit_s + loop.drain_s, 3)
            note = disk_limit_note(loop, timings["extract_s"], writer.bytes,
                                   int(cfg.output.writer_threads))
            if note:
                log.warning(note)
        status = "complete"
    except (KeyboardInterrupt, Interrupted) as e:
        status = "interrupted"
        signum = getattr(e, "signum", signal.SIGINT)
        written = record.writer.written if record.writer else 0
        raise JobError(f"interrupted by {signal.Signals(signum).name} after {written} samples "
                       "written this run; rerun the same command to resume",
                       exit_code=128 + signum) from e
    except BaseException as e:
        if _disk_full(e):
            reserve.free()  # room for the manifest that says so
            writer = record.writer
            left = len(todo) - (writer.written if writer else 0)
            tokens_left = int(todo.lengths.sum()) - (writer.tokens if writer else 0)
            need = bytes_needed(plan.info, plan.layer_ids, tokens_left, left, plan.storage)
            raise JobError(f"output.dir={str(plan.root)!r}: the disk is full with {left} samples "
                           f"to go, about {need / 1e9:.2f} GB still needed; free space and "
                           "rerun the same command to resume") from e
        raise
    finally:
        if progress is not None:
            progress.close()
        if engine is not None:
            engine.close()
        reserve.free()
        if status != "complete":
            try:
                record.write(status)
            except OSError as e:  # the original error says more
                log.error("manifest: %s", e)


def _finish(plan: Plan, record: ShardRecord, t_start: float) -> None:
    """Every sample of the shard has its file: its token counts, the manifest that says
    complete and, from the shard that completes the run last, the merged vocabulary."""
    fmt, root, manifest = str(plan.cfg.output.format), plan.root, record.manifest
    done = finished_indices(root, fmt, shard_owner(*plan.shard))
    missing = [int(i) for i in plan.mine.indices if int(i) not in done]
    if missing:
        record.write("failed")
        raise RuntimeError(f"{len(missing)} samples have no file after the run: {missing[:10]}")
    freq_path = root / manifest_name(*plan.shard, "token_freq")
    write_json_atomic(freq_path, token_freq.of_tokenized(plan.mine))

    record.timings["total_s"] = round(time.perf_counter() - t_start, 3)
    _count(manifest, plan, record.writer, record.timings)
    manifest.token_freq = freq_path.name
    manifest.finished = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    record.write("complete")
    vocab = _merge_when_last(plan)
    if vocab is not None:
        manifest.vocab = vocab
        record.write("complete")
    _summary(manifest, root)


def _count(manifest: Manifest, plan: Plan, writer: Writer | None,
           timings: dict[str, float]) -> None:
    """The finished shard's counts, tokens and bytes, into its manifest."""
    mine = plan.mine
    fmt, per_dir = str(plan.cfg.output.format), int(plan.cfg.output.files_per_dir)
    tokens_run = writer.tokens if writer else 0
    if timings.get("extract_s"):
        timings["tokens_per_s"] = round(tokens_run / timings["extract_s"], 1)
    manifest.counts = {
        "samples": len(mine),
        "written": len(mine),
        "written_this_run": writer.written if writer else 0,
        "resumed": plan.resumed,
        "redone_damaged": len(plan.damaged),
        "skipped": mine.report["skipped"],
        "skipped_total": mine.report["skipped_total"],
        "truncated": int(mine.truncated.sum()),
    }
    manifest.tokens = {"total": int(mine.lengths.sum()),
                       "loss": int(mine.mask.sum()), "this_run": tokens_run}
    manifest.bytes = {
        "data": file_bytes(plan.root, mine.indices.tolist(), per_dir, fmt),
        "this_run": writer.bytes if writer else 0,
    }


def _take_engine(plan: Plan, timings: dict[str, float]) -> Engine:
    """The engine that started beside preflight (or one started now)."""
    from eagle3_extract.engine.start import build_engine

    start, plan.engine_start = plan.engine_start, None
    if start is None:
        t = time.perf_counter()
        engine = build_engine(plan.cfg, plan.info, plan.layer_ids, plan.storage)
        timings["engine_start_s"] = round(time.perf_counter() - t, 3)
        return engine
    engine = start.take()  # raises the start's error; its thread has ended either way
    timings["engine_start_s"] = round(start.start_s, 3)
    timings["engine_wait_s"] = round(start.waited_s, 3)  # after preflight was done
    # the overlap's measure: wall = preflight + wait + extract; max(preflight, at + start)
    # + extract when the start overlaps everything after `at`
    timings["engine_start_at_s"] = round(plan.engine_start_at_s or 0.0, 3)
    log.info("engine started in %.1fs beside preflight, from %.1fs into it (%.1fs of the "
             "start after preflight)", start.start_s, plan.engine_start_at_s or 0.0,
             start.waited_s)
    return engine


def _merge_when_last(plan: Plan) -> dict[str, Any] | None:
    """Once every shard of this run's partition is complete: one token_freq.json over all
    of them (the shard that completes last writes it; two at once write the same) and the
    draft vocabulary mapping from its loss counts."""
    root, count = plan.root, plan.shard[1]
    docs = []
    for i in range(count):
        try:
            m = Manifest.read(root / manifest_name(i, count))
            if m.status != "complete" or m.run_id != plan.ident["run_id"]:
                return None
            docs.append(json.loads((root / manifest_name(i, count, "token_freq")).read_text()))
        except (OSError, ValueError):
            return None
    freq = docs[0] if count == 1 else token_freq.merge(docs)
    if count > 1:
        write_json_atomic(root / TOKEN_FREQ_JSON, freq)
    size, vocab = plan.cfg.output.draft_vocab_size, plan.info.vocab_size
    if size is None or not vocab:
        return {"token_freq": TOKEN_FREQ_JSON}
    return {"token_freq": TOKEN_FREQ_JSON, **token_freq.write_vocab(root, freq, int(size), vocab)}


def _previous_manifest(root: Path, shard: tuple[int, int], run_id: str) -> Manifest | None:
    """This shard's manifest from an earlier run of the same identity, if any."""
    try:
        m = Manifest.read(root / manifest_name(*shard))
    except (OSError, ValueError):
        return None
    if m.run_id != run_id:
        return None
    if m.produced_by is None and m.engine and m.counts:  # written before produced_by
        m.produced_by = {m.engine["name"]: int(m.counts.get("written", 0))}
    return m


def _disk_full(e: BaseException | None) -> bool:
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        e = e.__cause__ or e.__context__
    return False


class _Reserve:
    """A little disk held back, so that a job that fills the disk can still say so in its
    manifest (freed on failure and at the end)."""

    SIZE = 1 << 20

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "wb") as f:
                f.write(b"\0" * self.SIZE)
        except OSError:
            self.path.unlink(missing_ok=True)

    def free(self) -> None:
        self.path.unlink(missing_ok=True)


def _summary(m: Manifest, root: Path) -> None:
    c, t = m.counts, m.timings
    skipped = {k: v for k, v in c["skipped"].items() if v}
    log.info(
        "done: %d samples in %s (%d written now, %d from before), %d tokens, %.3f GB; "
        "skipped %d%s; truncated %d; %s tok/s; total %.1fs",
        c["samples"], root, c["written_this_run"], c["resumed"], m.tokens["total"],
        m.bytes["data"] / 1e9, c["skipped_total"], f" {skipped}" if skipped else "",
        c["truncated"], t.get("tokens_per_s", "-"), t["total_s"],
    )
