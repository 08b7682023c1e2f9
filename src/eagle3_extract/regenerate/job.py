"""`eagle3-regenerate`: the target writes the answers its drafter will learn to predict.

A drafter learns the target's distribution, so its training answers should be the
target's own: a reasoning model's thinking block included, which no public chat
dataset has. This step runs before extraction and writes a dataset that
`eagle3-extract dataset=local dataset.path=<dir>/conversations.jsonl` takes as it is.

This module is the job: preflight, resume, the files, the manifest. The generation
itself (which turns, prompts, vLLM's `LLM` stepped with continuous batching over
conversations and turns) is generation.py; each request has its own seed, so the
answers do not depend on batching, sharding or resume.

What a sample becomes is recorded in part files (`parts/`, one per chunk of sample
indices, written whole or not at all): a rerun redoes only missing or damaged
chunks. When every chunk of every shard is there, `conversations.jsonl` and
`manifest.json` are assembled from them. Turns the target did not write (a tool
call from the data, a leading greeting, the history in turns=last) get `weight: 0`,
so extraction's loss mask covers exactly what the target generated; how the template
renders the generated ids back is recorded per turn ("fidelity").
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from eagle3_extract.config import (DatasetConfig, EngineConfig, GenerateConfig, ModelConfig,
                                   PreflightError, validate_regenerate)
from eagle3_extract.dataset.messages import GENERATED_KEY, REGENERATED_TURNS
from eagle3_extract.dataset.render import Renderer
from eagle3_extract.dataset.samples import load_tokenizer, seeded_order
from eagle3_extract.errors import Interrupted, raise_interrupted
from eagle3_extract.regenerate.generation import (OUTCOMES, Regenerator, build_llm, close_llm,
                                                  engine_limits, make_reasoning_parser)
from eagle3_extract.lock import ShardLock
from eagle3_extract.dataset.rows import read_nonempty
from eagle3_extract.dataset.regenerated import CONVERSATIONS, KIND, PARTS, vocab_sha256  # noqa: F401 - re-exported
from eagle3_extract.layout import MANIFEST_JSON, RUN_JSON, atomic_write
from eagle3_extract.manifest import (
    chat_template_sha256,
    with_run_id,
    check_run_json,
    clean_json_temps,
    dataset_identity,
    package_versions,
    write_json_atomic,
    write_run_json,
)

log = logging.getLogger("eagle3_extract")

MANIFEST = MANIFEST_JSON
WRITTEN = ("finished", "max_tokens")
PROGRESS_EVERY_S = 30.0

# --- part files: the unit of resume -------------------------------------------------------


def part_name(chunk: int, shard: tuple[int, int]) -> str:
    return f"chunk-{chunk:06d}.shard-{shard[0]}-of-{shard[1]}.jsonl"


def chunk_indices(chunk: int, size: int, n: int, shard: tuple[int, int]) -> list[int]:
    """This shard's sample indices in chunk `chunk` (indices chunk*size .. +size-1)."""
    lo, hi = chunk * size, min((chunk + 1) * size, n)
    return [i for i in range(lo, hi) if i % shard[1] == shard[0]]


def read_part(path: Path, want: list[int]) -> list[dict[str, Any]] | None:
    """The records of a part file if it holds exactly the samples `want`, else None."""
    try:
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if sorted(r.get("index", -1) for r in recs) != want:
        return None
    if any(r.get("status") not in OUTCOMES for r in recs):
        return None
    return recs


def write_part(path: Path, recs: list[dict[str, Any]]) -> None:
    with atomic_write(path, "w") as f:
        for r in sorted(recs, key=lambda r: r["index"]):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def clean_temps(root: Path, shard: tuple[int, int]) -> int:
    """Temps a killed run left: this shard's part files (its lock makes them ours), and
    the shared outputs' once they are old (another shard may be writing them now)."""
    n = 0
    for t in (root / PARTS).glob(f".chunk-*.shard-{shard[0]}-of-{shard[1]}.jsonl.tmp-*"):
        t.unlink(missing_ok=True)
        n += 1
    return n + clean_json_temps(root, [], shared=(RUN_JSON, MANIFEST, CONVERSATIONS))


# --- the job ------------------------------------------------------------------------------


@dataclass
class Plan:
    """What preflight established: the config groups generation reads (not the job's whole
    config; `resolved` is all of it, for the manifest), the data, this shard's work."""

    engine: EngineConfig
    model: ModelConfig
    generate: GenerateConfig
    shard: tuple[int, int]  # (index, count)
    dry_run: bool
    verbose: bool
    resolved: dict[str, Any]
    root: Path
    info: Any
    tokenizer: Any
    rows: Sequence[Any]  # dataset/rows.py: a plain .jsonl file's are parsed when read
    order: list[int]
    ident: dict[str, Any]
    todo: list[int]  # chunks to generate (this shard)
    done: dict[int, list[dict[str, Any]]]  # chunk -> records found whole
    redone: int  # part files that were not whole: removed, redone
    lock: ShardLock | None = None

    @property
    def size(self) -> int:
        return int(self.generate.chunk_samples)

    def chunks(self) -> list[int]:
        n = len(self.order)
        return [c for c in range(-(-n // self.size))
                if chunk_indices(c, self.size, n, self.shard)]


def identity(model: ModelConfig, dataset: DatasetConfig, g: GenerateConfig, info: Any,
             template_sha256: str, vocab: str) -> dict[str, Any]:
    """What determines the generated data (resume only into the same identity)."""
    ident = {
        "kind": KIND,
        "model": {"path": str(model.path), "config_sha256": info.config_sha256,
                  "tiny_config": model.tiny_config if str(model.path) == "tiny" else None,
                  "dtype": str(info.dtype).removeprefix("torch."),
                  "quantization": model.quantization, "tokenizer": model.tokenizer,
                  "chat_template_sha256": template_sha256, "vocab_sha256": vocab,
                  "max_model_len": int(model.max_model_len),
                  "reasoning_parser": model.reasoning_parser},
        "dataset": dataset_identity(dataset, int(model.max_model_len)),
        "generate": {k: g[k] for k in ("temperature", "top_p", "max_tokens", "seed", "turns",
                                       "reasoning", "on_max_tokens", "chunk_samples")},
    }
    return with_run_id(ident)


def preflight(cfg: Any) -> Plan:
    from eagle3_extract.engine import inspect_model
    from eagle3_extract.engine.vllm_args import check_vllm_args
    from eagle3_extract.config import resolve_config
    from eagle3_extract.layout import check_writable

    validate_regenerate(cfg)
    resolved = resolve_config(cfg)
    root = Path(os.path.abspath(os.path.expanduser(str(cfg.output.dir))))
    check_writable(root)
    rows = read_nonempty(cfg.dataset)
    check_vllm_args(cfg.engine, fixed={})
    try:
        info = inspect_model(cfg.model)
    except (ValueError, OSError) as e:
        raise PreflightError(f"model.path={str(cfg.model.path)!r}: {e}") from e
    if info.max_positions and int(cfg.model.max_model_len) > info.max_positions:
        raise PreflightError(
            f"model.max_model_len={cfg.model.max_model_len} is above the model's limit of "
            f"{info.max_positions} tokens; set model.max_model_len <= {info.max_positions}")
    tokenizer = load_tokenizer(info.tokenizer_path, bool(cfg.model.trust_remote_code),
                               info.vocab_size)
    Renderer(tokenizer)  # raises if there is no chat template
    make_reasoning_parser(cfg.model.reasoning_parser, tokenizer)  # a wrong name fails here
    ident = identity(cfg.model, cfg.dataset, cfg.generate, info,
                     chat_template_sha256(tokenizer), vocab_sha256(tokenizer))
    resuming = check_run_json(root, ident)
    shard = (int(cfg.shard.index), int(cfg.shard.count))
    lock = ShardLock.acquire(root, shard)
    try:
        parts = root / PARTS
        parts.mkdir(exist_ok=True)
        other = [p.name for p in parts.glob("chunk-*.jsonl")
                 if not p.name.endswith(f"-of-{shard[1]}.jsonl")]
        if other:
            raise PreflightError(
                f"output.dir={str(root)!r} has part files of another shard.count ({other[0]}); "
                f"rerun with that shard.count or set output.dir to a new directory")
        if not resuming:
            write_run_json(root, ident)
    except BaseException:
        lock.release()
        raise
    order = seeded_order(len(rows), int(cfg.dataset.seed), bool(cfg.dataset.shuffle),
                         cfg.dataset.max_samples)
    return Plan(cfg.engine, cfg.model, cfg.generate, shard, bool(cfg.dry_run), bool(cfg.verbose),
                resolved, root, info, tokenizer, rows, order, ident, [], {}, 0, lock)


def scan_parts(plan: Plan) -> None:
    """Which chunks of this shard are done: part files are read, not trusted by name; one
    that is not whole is removed and its chunk redone."""
    parts = plan.root / PARTS
    clean_temps(plan.root, plan.shard)
    for c in plan.chunks():
        path = parts / part_name(c, plan.shard)
        recs = read_part(path, chunk_indices(c, plan.size, len(plan.order), plan.shard)) \
            if path.exists() else None
        if recs is not None:
            plan.done[c] = recs
            continue
        if path.exists():
            path.unlink()
            plan.redone += 1
        plan.todo.append(c)


class Progress:
    """One line every PROGRESS_EVERY_S: samples, generated tok/s, ETA (log, not a bar: the
    rate is what matters and it is steady)."""

    def __init__(self, total: int, every_s: float = PROGRESS_EVERY_S):
        self.total, self.done, self.every = total, 0, every_s
        self.t0 = self.last = time.perf_counter()

    def tick(self, regen: Regenerator) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last < self.every and self.done < self.total:
            return
        self.last = now
        rate = regen.generated_tokens / max(now - self.t0, 1e-9)
        per = (now - self.t0) / self.done
        eta = per * (self.total - self.done)
        log.info("regenerate: %d/%d samples, %.1f generated tok/s, ETA %s", self.done,
                 self.total, rate, time.strftime("%H:%M:%S", time.gmtime(eta)))


def run(cfg: Any) -> dict[str, Any] | None:
    """One regeneration job (one shard); the final manifest once every shard is done."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, raise_interrupted) if main else None
    try:
        plan = preflight(cfg)
        try:
            return _run(plan)
        finally:
            if plan.lock is not None:
                plan.lock.release()
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)


def _run(plan: Plan) -> dict[str, Any] | None:
    scan_parts(plan)
    shard, n = plan.shard, len(plan.order)
    mine = sum(len(chunk_indices(c, plan.size, n, shard)) for c in plan.chunks())
    todo = sum(len(chunk_indices(c, plan.size, n, shard)) for c in plan.todo)
    log.info("preflight ok: %d samples for this shard, %d to generate (%d from before, %d part "
             "files redone)", mine, todo, mine - todo, plan.redone)
    if plan.dry_run:
        log.info("dry_run: nothing generated")
        return None
    t0 = time.perf_counter()
    stats = {"prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0}
    if plan.todo:
        llm = build_llm(plan.engine, plan.model, plan.info, plan.verbose)
        t_gen = time.perf_counter()
        try:
            limits = engine_limits(llm)
            # twice what the engine runs at once: its queue never empties while samples last
            regen = Regenerator(llm, plan.tokenizer, plan.generate,
                                int(plan.model.max_model_len), plan.model.reasoning_parser,
                                window=2 * limits["max_num_seqs"])
        except BaseException:
            close_llm(llm)  # else its engine process keeps this one from exiting
            raise
        pending: dict[int, list[dict[str, Any]]] = {c: [] for c in plan.todo}
        want = {c: len(chunk_indices(c, plan.size, n, shard)) for c in plan.todo}
        progress = Progress(todo)

        def on_done(rec: dict[str, Any]) -> None:
            c = rec["index"] // plan.size
            pending[c].append(rec)
            progress.tick(regen)
            if len(pending[c]) == want[c]:
                write_part(plan.root / PARTS / part_name(c, shard), pending.pop(c))

        items = ((i, plan.order[i], plan.rows[plan.order[i]])
                 for c in plan.todo for i in chunk_indices(c, plan.size, n, shard))
        try:
            regen.run(items, on_done)
            seconds = time.perf_counter() - t_gen
            stats = {"prompt_tokens": regen.prompt_tokens,
                     "generated_tokens": regen.generated_tokens, "seconds": seconds,
                     "generated_tok_s": round(regen.generated_tokens / max(seconds, 1e-9), 1),
                     "engine": limits, "concurrency": regen.concurrency()}
        except (KeyboardInterrupt, Interrupted):
            log.error("interrupted: finished chunks are kept; rerun the same command to resume")
            raise
        finally:
            close_llm(llm)
        assert not pending, f"chunks left unwritten: {sorted(pending)}"
    log.info("shard %d/%d done: %d generated tokens in %.1fs (%.1f tok/s)", *shard,
             stats["generated_tokens"], stats["seconds"],
             stats["generated_tokens"] / max(stats["seconds"], 1e-9))
    write_json_atomic(plan.root / PARTS / f"stats.shard-{shard[0]}-of-{shard[1]}.json",
                      {"run_id": plan.ident["run_id"], **stats,
                       "wall_s": time.perf_counter() - t0})
    return assemble(plan)


def assemble(plan: Plan) -> dict[str, Any] | None:
    """conversations.jsonl + manifest.json from the part files of every shard, once all
    are there (None while another shard is still running)."""
    n, count = len(plan.order), plan.shard[1]
    parts = plan.root / PARTS
    records: list[dict[str, Any]] = []
    for s in range(count):
        shard = (s, count)
        for c in range(-(-n // plan.size)):
            want = chunk_indices(c, plan.size, n, shard)
            if not want:
                continue
            recs = read_part(parts / part_name(c, shard), want)
            if recs is None:
                log.info("shard %d/%d: its part files are not all there yet; the last shard "
                         "to finish writes %s", s, count, CONVERSATIONS)
                return None
            records += recs
    records.sort(key=lambda r: r["index"])
    outcomes = Counter({k: 0 for k in OUTCOMES})
    fidelity = {**{k: 0 for k in REGENERATED_TURNS}, "template_drift_examples": []}
    tokens = {"generated": 0, "prompt": 0, "turns": 0}
    keep_cut = str(plan.generate.on_max_tokens) == "keep"
    # the last of several shards assembles it
    with atomic_write(plan.root / CONVERSATIONS, "w") as f:
        for r in records:
            outcomes[r["status"]] += 1
            for t in r.get("turns", []):
                tokens["generated"] += t.get("generated_tokens", 0)
                tokens["prompt"] += t.get("prompt_tokens", 0)
                tokens["turns"] += 1
            if r["status"] not in WRITTEN or (r["status"] == "max_tokens" and not keep_cut):
                continue
            for k, t in enumerate(r["turns"]):
                fidelity[t["fidelity"]] += 1
                if t["fidelity"] == "template_drift" and \
                        len(fidelity["template_drift_examples"]) < 20:
                    fidelity["template_drift_examples"].append({"index": r["index"], "turn": k})
            meta = {"index": r["index"], "row": r["row"], "turns": r["turns"]}
            f.write(json.dumps({"messages": r["messages"], GENERATED_KEY: meta},
                               ensure_ascii=False) + "\n")
    written = sum(1 for r in records if r["status"] == "finished"
                  or (r["status"] == "max_tokens" and keep_cut))
    stats = [json.loads(p.read_text()) for p in sorted(parts.glob("stats.shard-*.json"))]
    manifest = {
        "kind": KIND,
        "status": "complete",
        "run_id": plan.ident["run_id"],
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "identity": plan.ident,
        "model": {"path": str(plan.model.path), "resolved_path": plan.info.path,
                  "architecture": plan.info.architecture,
                  "config_sha256": plan.info.config_sha256},
        "config": plan.resolved,
        "counts": {"selected": n, "written": written, "outcomes": dict(outcomes)},
        "tokens": tokens,
        # written turns by how extraction gets their ids back: exact (the template's
        # tokens are the generated ids), retokenized (same text, other ids: extraction
        # puts the generated ids back), template_drift (the template renders other text,
        # e.g. reasoning=drop or a template that drops earlier turns' reasoning: the
        # render stands)
        "fidelity": fidelity,
        "this_run": this_run(stats),
        "produced_by": package_versions(),
        "conversations": CONVERSATIONS,
    }
    write_json_atomic(plan.root / MANIFEST, manifest)
    skipped = {k: v for k, v in outcomes.items()
               if v and (k not in WRITTEN or (k == "max_tokens" and not keep_cut))}
    log.info("done: %d of %d samples written to %s; %d generated tokens; not written: %s; "
             "turns exact/retokenized/template_drift: %d/%d/%d", written, n,
             plan.root / CONVERSATIONS, tokens["generated"], skipped or "none",
             *(fidelity[k] for k in REGENERATED_TURNS))
    return manifest


def this_run(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's figures of this run's generation: tokens, the wall of its slowest
    shard, the rate, and per shard the engine's limits and the concurrency it ran at."""
    tokens = sum(s.get("generated_tokens", 0) for s in stats)
    seconds = max((s.get("seconds", 0.0) for s in stats), default=0.0)
    return {"generated_tokens": tokens, "seconds": round(seconds, 3),
            "generated_tok_s": round(tokens / seconds, 1) if seconds else None,
            "shards": [{k: s[k] for k in ("generated_tok_s", "engine", "concurrency") if k in s}
                       for s in stats]}


# --- command line ---------------------------------------------------------------------------


def _regenerate(cfg: DictConfig) -> None:
    if int(cfg.parallel.data_parallel_size) > 1:
        from eagle3_extract.replicas import launch_hydra_job

        rc = launch_hydra_job(cfg, launch)
        if rc:
            sys.exit(rc)
        return
    from eagle3_extract.replicas import die_with_launcher

    die_with_launcher()
    run(cfg)


def launch(cfg: Any, overrides: list[str], log_root: Path) -> int:
    """parallel.launch for eagle3-regenerate: preflight once, then one replica per shard; the
    last replica to finish assembles conversations.jsonl."""
    from eagle3_extract.replicas import plan_replicas, run_replicas

    t0 = time.perf_counter()
    validate_regenerate(cfg)
    replicas = plan_replicas(int(cfg.parallel.data_parallel_size),
                             (int(cfg.shard.index), int(cfg.shard.count)), cfg.engine, cfg.model,
                             log_root)
    plan = preflight(cfg)
    try:
        return run_replicas(overrides, replicas, plan.root, t0, bool(cfg.dry_run),
                             module="eagle3_extract.regenerate.job",
                             progress=lambda root, reps: "{} part files of {} replicas".format(
                                 len(list((root / PARTS).glob("chunk-*.jsonl"))),
                                 len(reps)),
                             summary=lambda root, reps, wall: log.info(
                                 "done: %d replicas in %.1fs; %s", len(reps), wall,
                                 root / CONVERSATIONS))
    finally:
        if plan.lock is not None:
            plan.lock.release()


def _task(cfg: DictConfig) -> None:
    from eagle3_extract.hydra_app import run_guarded

    run_guarded("eagle3-regenerate", _regenerate, cfg, "; rerun the same command to resume")


def main() -> None:
    """Console script `eagle3-regenerate`."""
    from eagle3_extract.hydra_app import hydra_main

    hydra_main("regenerate", "eagle3-regenerate", _task)


if __name__ == "__main__":
    main()
