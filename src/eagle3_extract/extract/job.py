"""One extraction job: preflight (preflight.py), then the loop data -> batching -> engine ->
writer, this shard's manifest while it runs, and the merge the run's last shard writes.

`run(cfg)` is the only function here that sees the whole job config: it hands preflight
the config and everything after reads the Plan (the engine, model and output groups, the
layer ids, the job's one Storage)."""

from __future__ import annotations

import errno
import json
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from eagle3_extract.dataset import token_freq
from eagle3_extract.dataset.batching import iter_batches, plan_batches, shard_owner
from eagle3_extract.config import ConfigError
from eagle3_extract.errors import Interrupted, JobError, raise_interrupted
from eagle3_extract.run_state import run_state
from eagle3_extract.layout import (
    TOKEN_FREQ_JSON,
    file_bytes,
    finished_indices,
    layout_pattern,
    manifest_name,
)
from eagle3_extract.manifest import (
    Manifest,
    new_manifest,
    write_json_atomic,
)
from eagle3_extract.extract.progress import Progress
from eagle3_extract.lock import process_identity
from eagle3_extract.types import Batch, Engine
from eagle3_extract.extract.preflight import Plan, bytes_needed, preflight, previous_manifest
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
    out = plan.output
    return Writer(plan.root, str(out.format), int(out.files_per_dir),
                  plan.layer_ids, plan.info.hidden_size,
                  plan.storage.stored_dtype(plan.info.dtype),
                  plan.ident["run_id"], threads=int(out.writer_threads),
                  max_pending=int(plan.engine.host_buffers), on_sample=on_sample)


def plan_engine_batches(plan: Plan, engine: Engine) -> list:
    budget = int(plan.engine.token_budget)
    budget = min(budget, int(getattr(engine, "max_batch_tokens", budget) or budget))
    return plan_batches(plan.todo.lengths, budget, int(plan.engine.max_num_seqs))


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
        fmt, per_dir = str(plan.output.format), int(plan.output.files_per_dir)
        self.plan, self.root = plan, plan.root
        self.manifest = m = new_manifest(plan.resolved, plan.ident, plan.info, plan.layer_ids,
                                         layout_pattern(fmt, per_dir), plan.shard)
        m.output["targets"] = TARGETS[fmt]
        m.process = process_identity()
        m.data = plan.mine.report
        before = previous_manifest(plan.root, plan.shard, plan.ident["run_id"])
        self.produced = dict(before.produced_by or {}) if before else {}
        if before and before.engine:
            m.engine = before.engine  # replaced only if this run starts an engine
        self.engine_name = str(plan.engine.name)
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
    if plan.dry_run:
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
    todo, timings = plan.todo, record.timings
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
                                   int(plan.output.writer_threads))
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
    fmt, root, manifest = str(plan.output.format), plan.root, record.manifest
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
    fmt, per_dir = str(plan.output.format), int(plan.output.files_per_dir)
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
        engine = build_engine(plan.engine, plan.model, plan.info, plan.layer_ids, plan.storage,
                              plan.verbose)
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
    state = run_state(root, check_links=False)  # the question status and export ask
    if (state.problems or state.not_complete or state.manifests[0].shard_count != count
            or any(m.run_id != plan.ident["run_id"] for m in state.manifests)):
        return None
    try:
        docs = [json.loads((root / manifest_name(i, count, "token_freq")).read_text())
                for i in range(count)]
    except (OSError, ValueError):
        return None
    freq = docs[0] if count == 1 else token_freq.merge(docs)
    if count > 1:
        write_json_atomic(root / TOKEN_FREQ_JSON, freq)
    size, vocab = plan.output.draft_vocab_size, plan.info.vocab_size
    if size is None or not vocab:
        return {"token_freq": TOKEN_FREQ_JSON}
    return {"token_freq": TOKEN_FREQ_JSON, **token_freq.write_vocab(root, freq, int(size), vocab)}


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
