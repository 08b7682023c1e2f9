"""An extraction job's preflight: everything that can be wrong with a config (model shape,
layer ids, tokenizer, dataset, output dir, disk space, run identity, vLLM engine args) is
checked in seconds, before the engine spends minutes loading a model. A failure is a
PreflightError whose message names the key to change (the command prints it, exits 2).

What it established is the Plan: the config groups the extraction reads (never the whole
job config), this shard's samples and what is left to do, and the one `Storage` of the job.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_extract.config import (Config, EngineConfig, ModelConfig, OutputConfig,
                                   PreflightError, max_length, resolve_config, validate)
from eagle3_extract.dataset.batching import shard_owner, todo_mask
from eagle3_extract.dataset.render import Renderer
from eagle3_extract.dataset.rows import read_nonempty
from eagle3_extract.dataset.samples import Tokenized, build_dataset, load_tokenizer
from eagle3_extract.layout import (Storage, check_writable, clean_stale_temps, manifest_name,
                                   remove_links, sample_path, verified_files)
from eagle3_extract.lock import ShardLock
from eagle3_extract.manifest import (Manifest, chat_template_sha256, claim_run_json,
                                     clean_json_temps, retract_run_json, run_identity)

log = logging.getLogger("eagle3_extract")
# Set by the data-parallel launcher: the job's tokenized samples, made once (parallel.py).
TOKENIZED_ENV = "EAGLE3_TOKENIZED"


@dataclass
class Plan:
    """Everything preflight established; the extraction needs nothing else (its own config
    groups, not the job's whole config)."""

    engine: EngineConfig
    model: ModelConfig
    output: OutputConfig
    shard: tuple[int, int]  # (index, count)
    dry_run: bool
    verbose: bool
    resolved: dict[str, Any]  # the whole config, resolved, for the manifest
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
    storage: Storage = Storage()  # how the states are stored (output.dtype): made once here
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


def _check_engine_args(engine: EngineConfig) -> None:
    if str(engine.name) == "vllm":
        from eagle3_extract.engine.vllm_args import check_vllm_args

        check_vllm_args(engine)


def _launcher_samples(identity: Any) -> tuple[Tokenized, dict[str, Any]] | None:
    """The samples and run identity the data-parallel launcher made for this job, or None.

    The launcher tokenized the dataset once (parallel.py). The set is trusted only if
    this replica's own config yields the same run identity (`identity(template_sha256)`;
    the chat template's hash is the launcher's: the tokenizer is not loaded again).
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
    ident = identity(template)
    if ident["run_id"] != meta["ident"]["run_id"]:
        raise PreflightError(f"{TOKENIZED_ENV}={artifact} was tokenized for run "
                             f"{meta['ident']['run_id']}, this job is run {ident['run_id']}; "
                             "unset it to tokenize the dataset here")
    log.info("samples from the launcher's tokenized set %s", artifact)
    return data, ident


def preflight(cfg: Config, start_engine: bool = False) -> Plan:
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
    max_len = max_length(cfg.dataset, cfg.model)
    if cfg.engine.token_budget < max_len:
        raise PreflightError(
            f"engine.token_budget={cfg.engine.token_budget} is smaller than the longest "
            f"allowed sample ({max_len} tokens = dataset.max_length or model.max_model_len - 1)"
            f"; raise engine.token_budget to >= {max_len} or lower dataset.max_length"
        )
    _check_engine_args(cfg.engine)
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
        check_capture_memory(cfg.engine, cfg.model, info, layer_ids,
                             storage.scale_columns(len(layer_ids)))
    except ValueError as e:
        raise PreflightError(str(e)) from e

    def identity(template_sha256: str) -> dict[str, Any]:
        return run_identity(cfg.model, cfg.dataset, cfg.output, storage, info, layer_ids,
                            template_sha256, max_len)

    from_launcher = _launcher_samples(identity)
    if from_launcher:
        data, ident = from_launcher
    else:
        tokenizer = load_tokenizer(info.tokenizer_path, bool(cfg.model.trust_remote_code),
                                   info.vocab_size)
        renderer = Renderer(tokenizer)  # raises if there is no chat template
        from eagle3_extract.dataset.regenerated import check_regenerated_input

        check_regenerated_input(str(cfg.dataset.path), tokenizer, info)
        ident = identity(chat_template_sha256(tokenizer))
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
        before = previous_manifest(root, (index, count), ident["run_id"])
        early = early and starts_apart(cfg.engine) and not (before and before.status == "complete")

        def start() -> None:  # after the tokenizer workers are forked (data.tokenize_rows)
            nonlocal engine_start, engine_start_at_s
            if early and engine_start is None:
                engine_start_at_s = time.perf_counter() - t0
                engine_start = EngineStart(cfg.engine, cfg.model, info, layer_ids, storage,
                                           bool(cfg.verbose))

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
        engine=cfg.engine, model=cfg.model, output=cfg.output, shard=(index, count),
        dry_run=bool(cfg.dry_run), verbose=bool(cfg.verbose), resolved=resolved, root=root, info=info, layer_ids=layer_ids, ident=ident,
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


def previous_manifest(root: Path, shard: tuple[int, int], run_id: str) -> Manifest | None:
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
