"""Dataset rows -> tokenized samples (messages.py, render.py), in the seeded order.

A sample's identity is its position in the seeded dataset order (shuffle with
`dataset.seed`, then take `dataset.max_samples`), so resume, sharding and file names stay
stable whatever rows turn out unusable. Rows are tokenized in forked workers for a large
dataset; every skipped row is counted by reason.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from eagle3_extract.config import PreflightError
from eagle3_extract.dataset.rows import read_nonempty
from eagle3_extract.types import Sample
from eagle3_extract.dataset.messages import (REGENERATED_TURNS, SKIP_REASONS, SPECIAL_TEXT, SkipRow,
                                             generated_turns, to_messages)
from eagle3_extract.dataset.render import Renderer

log = logging.getLogger(__name__)

def seeded_order(num_rows: int, seed: int, shuffle: bool, max_samples: int | None) -> list[int]:
    """Row number for each sample index: shuffle with `seed`, then keep `max_samples`."""
    order = list(range(num_rows))
    if shuffle:
        random.Random(seed).shuffle(order)
    return order[:max_samples] if max_samples is not None else order


NOTE_BITS = {"reasoning_content": 1, "tool_calls": 2, SPECIAL_TEXT: 4}  # Tokenized.flags


@dataclass
class Tokenized:
    """Usable samples, stored flat (numpy) so a large dataset stays small in memory.

    `sample(j)` builds the j-th usable sample as a `Sample` when a batch needs it. What
    the report counts is kept per sample too (the skipped ones by index and reason, the
    used ones' notes), so that the report of any shard of it is exact (`shard`).
    """

    indices: np.ndarray  # int64 [n]: sample index (position in the seeded order)
    offsets: np.ndarray  # int64 [n+1]: token range of sample j is offsets[j]:offsets[j+1]
    ids: np.ndarray  # int32 [total] (token ids; 4 bytes a token in memory and in the cache)
    mask: np.ndarray  # uint8 [total]
    truncated: np.ndarray  # bool [n]
    report: dict[str, Any] = field(default_factory=dict)
    flags: np.ndarray | None = None  # uint8 [n]: NOTE_BITS of each used sample
    regen: np.ndarray | None = None  # int32 [n, 3]: REGENERATED_TURNS counts per sample
    skip_index: np.ndarray | None = None  # int64 [k]: skipped sample indices
    skip_code: np.ndarray | None = None  # uint8 [k]: their reasons (SKIP_REASONS position)
    skip_row: np.ndarray | None = None  # int64 [k]: their row numbers

    def __post_init__(self) -> None:  # samples built without records: none noted, none skipped
        n = len(self.indices)
        if self.flags is None:
            self.flags = np.zeros(n, dtype=np.uint8)
        if self.regen is None:
            self.regen = np.zeros((n, len(REGENERATED_TURNS)), dtype=np.int32)
        for name, dtype in (("skip_index", np.int64), ("skip_code", np.uint8),
                            ("skip_row", np.int64)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(0, dtype=dtype))

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, j: int) -> Sample:
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        return Sample(
            index=int(self.indices[j]),
            input_ids=self.ids[a:b].tolist(),
            loss_mask=self.mask[a:b].tolist(),
            truncated=bool(self.truncated[j]),
        )

    _ARRAYS = ("indices", "offsets", "ids", "mask", "truncated", "flags", "regen",
               "skip_index", "skip_code", "skip_row")

    def save(self, path: Path, meta: dict[str, Any]) -> None:
        """Write to directory `path` (one .npy per array, token ids as int32), `meta`
        (the run identity it was made under) beside them; complete or absent."""
        import shutil

        from eagle3_extract.layout import temp_path

        tmp = temp_path(path)  # pid and a random tag: pods of a k8s Job are often all pid 1
        tmp.mkdir(parents=True)
        try:
            for name in self._ARRAYS:
                a = getattr(self, name)
                np.save(tmp / f"{name}.npy", a.astype(np.int32) if name == "ids" else a)
            (tmp / "meta.json").write_text(json.dumps({**meta, "report": self.report}))
            os.replace(tmp, path)  # refused when `path` is there already (a dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def load(cls, path: Path) -> tuple["Tokenized", dict[str, Any]]:
        """(samples, meta) as `save` wrote them; the arrays are memory-mapped, so a
        replica reads only the pages of the samples it selects."""
        meta = json.loads((path / "meta.json").read_text())
        arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in cls._ARRAYS}
        return cls(**arrays, report=meta.pop("report")), meta

    def select(self, keep: np.ndarray) -> "Tokenized":
        """The samples at positions `keep` (a boolean mask over usable samples); the
        report and the skipped records stay as they are (`shard` recounts them)."""
        keep = np.asarray(keep, dtype=bool)
        if keep.all():  # a fresh run's to-do set: the same arrays, no copy
            return Tokenized(
                self.indices, self.offsets, self.ids, self.mask, self.truncated, self.report,
                self.flags, self.regen, self.skip_index, self.skip_code, self.skip_row,
            )
        pos = np.flatnonzero(keep)
        lengths = self.lengths[pos]
        offsets = np.zeros(len(pos) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.repeat(keep, self.lengths)  # 1 byte a token, not an index array
        return Tokenized(
            self.indices[pos], offsets, self.ids[tokens], self.mask[tokens],
            self.truncated[pos], self.report, self.flags[pos], self.regen[pos],
            self.skip_index, self.skip_code, self.skip_row,
        )

    def shard(self, index: int, count: int) -> "Tokenized":
        """Shard `index` of `count` (sample index % count == index), its report recounted
        from the per-sample records: exact per shard, and the shards' counts add up."""
        mine = self.select(self.indices % count == index)
        keep = self.skip_index % count == index
        mine.skip_index, mine.skip_code = self.skip_index[keep], self.skip_code[keep]
        mine.skip_row = self.skip_row[keep]
        mine.report = mine.recount(self.report, (index, count))
        return mine

    def recount(self, base: dict[str, Any], shard: tuple[int, int]) -> dict[str, Any]:
        """The report of these samples: `base` gives what is not per sample (rows,
        selected, max_length, overlong, the skip details)."""
        codes = np.bincount(self.skip_code, minlength=len(SKIP_REASONS))
        skipped = {r: int(codes[i]) for i, r in enumerate(SKIP_REASONS)}
        details = {e["index"]: e.get("detail", "") for e in base.get("skipped_examples", [])}
        examples = [{"index": int(i), "row": int(r), "reason": SKIP_REASONS[int(c)],
                     "detail": details.get(int(i), "")}
                    for i, r, c in zip(self.skip_index[:20], self.skip_row[:20],
                                       self.skip_code[:20])]
        regen = self.regen.sum(axis=0)
        return {
            "rows": base["rows"],
            "selected": base["selected"],
            # this report covers the samples with index % count == index
            "shard": {"index": int(shard[0]), "count": int(shard[1])},
            "usable": len(self),
            "skipped": skipped,
            "skipped_total": int(codes.sum()),
            "skipped_examples": examples,
            # used rows whose reasoning or tool calls the chat template does not render
            "not_rendered": {k: int(((self.flags & b) > 0).sum())
                             for k, b in NOTE_BITS.items() if k != SPECIAL_TEXT},
            # turns of eagle3-regenerate rows: how their generated ids came back (this module)
            "regenerated_turns": {k: int(regen[i]) for i, k in enumerate(REGENERATED_TURNS)},
            # used rows whose message text spells a special token, kept as text (as_text)
            SPECIAL_TEXT: int(((self.flags & NOTE_BITS[SPECIAL_TEXT]) > 0).sum()),
            "truncated": int(self.truncated.sum()),
            "tokens": int(self.offsets[-1]),
            "loss_tokens": int(self.mask.sum()),
            "max_length": base["max_length"],
            "overlong": base["overlong"],
        }


# A row's bytes per token of max_length above which it is skipped unread (the default of
# dataset.max_row_bytes): text runs 3-6 bytes a token, JSON-escaped CJK about 9, so a row
# over it is at least 4x too long, and truncation would have kept under a quarter of it.
# Rendering and tokenizing take about 250 bytes of memory per byte of a row (one 50 MB row
# peaked at 12.7 GB), so the bound is what keeps one row from being the job's OOM.
ROW_BYTES_PER_TOKEN = 32
MIN_ROW_BYTES = 1 << 20


def row_byte_bound(max_row_bytes: int | None, max_length: int) -> int:
    """dataset.max_row_bytes, or its default from the length limit."""
    if max_row_bytes is not None:
        return int(max_row_bytes)
    return max(MIN_ROW_BYTES, ROW_BYTES_PER_TOKEN * int(max_length))


def _text_bytes(messages: list[dict[str, Any]]) -> int:
    """At least the UTF-8 bytes of the messages' text (characters; cheap)."""
    total = 0
    for m in messages:
        for v in m.values():
            total += len(v) if isinstance(v, str) else len(str(v)) if v is not None else 0
    return total


def _tokenize_span(rows: list[Any], order: list[int], positions: Any,
                   renderer: Renderer, max_length: int, overlong: str,
                   max_bytes: int | None = None) -> dict[str, Any]:
    """The samples at `positions` of the order: arrays of the usable ones, a record of
    each skipped one (index, row, reason, detail)."""
    skips: list[tuple[int, int, int, str]] = []
    indices, lengths, truncated, flags, regen = [], [], [], [], []
    id_chunks, mask_chunks = [], []
    bound = row_byte_bound(max_bytes, max_length)
    sized = getattr(rows, "row_bytes", None)
    for index in positions:
        row_no = order[index]
        try:
            if sized is not None and (size := sized(row_no)) > bound:
                raise SkipRow("row_too_large", f"{size} bytes > dataset.max_row_bytes {bound}")
            row = rows[row_no]
            messages = to_messages(row)
            if (size := _text_bytes(messages)) > bound:
                raise SkipRow("row_too_large", f"{size} bytes of text > dataset.max_row_bytes "
                              f"{bound}")
            ids, mask, notes = renderer.tokenize_with_notes(messages, generated_turns(row))
            cut = len(ids) > max_length
            if cut:
                if overlong == "skip":
                    raise SkipRow("overlong", f"{len(ids)} > max_length {max_length} tokens")
                ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                raise SkipRow("no_loss_tokens", "truncated" if cut else "empty assistant turns")
        except SkipRow as e:
            skips.append((index, row_no, SKIP_REASONS.index(e.reason), e.detail[:200]))
            continue
        except MemoryError:  # the machine's, not the row's
            raise
        except Exception as e:  # noqa: BLE001 - one row never ends the job
            skips.append((index, row_no, SKIP_REASONS.index("row_error"),
                          f"{type(e).__name__}: {e}"[:200]))
            continue
        flags.append(sum(b for k, b in NOTE_BITS.items() if k in notes))
        regen.append([notes.count(k) for k in REGENERATED_TURNS])
        indices.append(index)
        lengths.append(len(ids))
        truncated.append(cut)
        id_chunks.append(np.asarray(ids, dtype=np.int32))
        mask_chunks.append(np.asarray(mask, dtype=np.uint8))
    return {
        "indices": np.asarray(indices, dtype=np.int64),
        "lengths": np.asarray(lengths, dtype=np.int64),
        "truncated": np.asarray(truncated, dtype=bool),
        "ids": np.concatenate(id_chunks) if id_chunks else np.zeros(0, dtype=np.int32),
        "mask": np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, dtype=np.uint8),
        "flags": np.asarray(flags, dtype=np.uint8),
        "regen": np.asarray(regen, dtype=np.int32).reshape(-1, len(REGENERATED_TURNS)),
        "skips": skips,
    }


_FORKED: tuple | None = None  # what forked tokenizer workers inherit (never pickled)


def _forked_worker_init() -> None:
    """A worker takes the default SIGTERM (the pool's terminate() must end it quietly, not
    raise the job's Interrupted in it) and ignores SIGINT (Ctrl-C is the parent's to act on)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _forked_span(bounds: tuple[int, int]) -> dict[str, Any]:
    rows, order, positions, renderer, max_length, overlong, max_bytes = _FORKED
    return _tokenize_span(rows, order, positions[bounds[0]:bounds[1]], renderer, max_length,
                          overlong, max_bytes)


def auto_num_proc(num_proc: int | None, num_rows: int) -> int:
    """`dataset.num_proc`, or by default one process per core (<= 32) for big datasets."""
    if num_proc is not None:
        return max(1, int(num_proc))
    return min(os.cpu_count() or 1, 32) if num_rows >= 5000 else 1


def _threads_beside() -> list[str]:
    import threading

    me = threading.current_thread()
    return [t.name for t in threading.enumerate() if t is not me and t.is_alive()]


def _in_workers(spans: list[tuple[int, int]], num_proc: int,
                on_workers: Callable[[], None] | None) -> list[dict[str, Any]]:
    """`_forked_span` of each span in `num_proc` forked workers, in span order. A worker
    that dies (a signal, the OOM killer) ends the job in one line within a second: with
    multiprocessing.Pool its span was lost and the job waited for it forever."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from eagle3_extract.errors import JobError

    ex = ProcessPoolExecutor(num_proc, mp_context=mp.get_context("fork"),
                             initializer=_forked_worker_init)
    procs: list = []
    try:
        futures = [ex.submit(_forked_span, span) for span in spans]  # forks them all
        procs = list(getattr(ex, "_processes", {}).values())
        if on_workers is not None:
            on_workers()
        return [f.result() for f in futures]
    except BrokenProcessPool:
        for proc in procs:
            proc.join(1.0)  # the dead one's status is there at once
        # the cause first: a signal other than the SIGTERM the pool then sends the others
        codes = sorted((p.exitcode for p in procs if p.exitcode),
                       key=lambda c: (c >= 0, c == -15))
        how = (f"killed by {__import__('signal').Signals(-codes[0]).name}"
               if codes and codes[0] < 0 else f"exit status {codes[0]}" if codes else "died")
        raise JobError(f"a tokenizer worker {how} (the OOM killer, or a signal sent to it); "
                       "nothing was written: rerun, or set dataset.num_proc=1 to tokenize in "
                       "the job's own process") from None
    except BaseException:
        for proc in procs:  # they ignore SIGINT: the job's Ctrl-C or SIGTERM ends them here
            proc.terminate()
        raise
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def tokenize_rows(
    rows: list[Any], order: list[int], renderer: Renderer, max_length: int, overlong: str,
    num_proc: int = 1, shard: tuple[int, int] = (0, 1),
    on_workers: Callable[[], None] | None = None, max_row_bytes: int | None = None,
) -> Tokenized:
    """Tokenize the rows of shard `shard` (sample index % count == index) in seeded
    order; skip and count what cannot be used. Only the shard's rows are rendered and
    tokenized; its report counts them (`Tokenized.recount`).

    With `num_proc > 1` contiguous spans of the shard's positions go to forked worker
    processes (they inherit rows and tokenizer, nothing is pickled but results);
    the result is identical to the serial one.

    `on_workers` is called once the workers exist (at once when there are none), before
    any row is tokenized: what starts a thread (the engine start) goes there. A fork
    beside a running thread copies the locks that thread holds, held forever: a worker
    that then needs one (a module the thread was importing) hangs, and the job with it
    (seen on the H200: 16 workers forked while vLLM's engine started).
    """
    index, count = shard
    positions = range(index, len(order), count)
    n = len(positions)
    if num_proc <= 1 or n < 2 * num_proc:
        if on_workers is not None:
            on_workers()
        parts = [_tokenize_span(rows, order, positions, renderer, max_length, overlong,
                                max_row_bytes)]
    else:
        global _FORKED
        step = -(-n // (num_proc * 4))
        spans = [(a, min(a + step, n)) for a in range(0, n, step)]
        beside = _threads_beside()
        if beside:
            log.warning("forking %d tokenizer workers beside running threads %s: a worker "
                        "may hang on a lock one of them held", num_proc, beside)
        _FORKED = (rows, order, positions, renderer, max_length, overlong, max_row_bytes)
        try:
            parts = _in_workers(spans, num_proc, on_workers)
        finally:
            _FORKED = None
    lengths = np.concatenate([p["lengths"] for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    skips = [sk for p in parts for sk in p["skips"]]
    data = Tokenized(
        np.concatenate([p["indices"] for p in parts]), offsets,
        np.concatenate([p["ids"] for p in parts]), np.concatenate([p["mask"] for p in parts]),
        np.concatenate([p["truncated"] for p in parts]),
        flags=np.concatenate([p["flags"] for p in parts]),
        regen=np.concatenate([p["regen"] for p in parts]),
        skip_index=np.asarray([sk[0] for sk in skips], dtype=np.int64),
        skip_row=np.asarray([sk[1] for sk in skips], dtype=np.int64),
        skip_code=np.asarray([sk[2] for sk in skips], dtype=np.uint8),
    )
    base = {"rows": len(rows), "selected": len(order), "max_length": max_length,
            "overlong": overlong,
            "skipped_examples": [{"index": sk[0], "detail": sk[3]} for sk in skips[:20]]}
    data.report = data.recount(base, shard)
    return data


def load_tokenizer(path: str, trust_remote_code: bool, model_vocab: int | None = None) -> Any:
    """The tokenizer; with `model_vocab` (the model's vocab_size), one whose ids run past
    the model's embedding is refused here, not an IndexError in the first forward pass."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise PreflightError(
            f"tokenizer {path!r} could not be loaded ({type(e).__name__}: {e}); set "
            "model.tokenizer (or model.path) to a directory or hub id with a tokenizer"
        ) from e
    if model_vocab and len(tok) > int(model_vocab):
        raise PreflightError(
            f"tokenizer {path!r} has {len(tok)} tokens, the model's vocab_size is "
            f"{model_vocab}: ids past {int(model_vocab) - 1} have no embedding; set "
            "model.tokenizer to the model's own tokenizer")
    return tok


def build_dataset(ds: Any, tokenizer: Any, max_length: int,
                  rows: list[Any] | None = None, shard: tuple[int, int] = (0, 1),
                  on_workers: Callable[[], None] | None = None) -> Tokenized:
    """dataset config + tokenizer -> usable samples of shard `shard` (only its rows are
    rendered and tokenized). Raises PreflightError if it has rows and none is usable.
    `on_workers`: tokenize_rows's."""
    rows = read_nonempty(ds) if rows is None else rows
    order = seeded_order(len(rows), int(ds.seed), bool(ds.shuffle), ds.max_samples)
    mine = len(range(shard[0], len(order), shard[1]))
    procs = auto_num_proc(getattr(ds, "num_proc", None), mine)
    data = tokenize_rows(rows, order, Renderer(tokenizer), max_length, str(ds.overlong), procs,
                         shard, on_workers, getattr(ds, "max_row_bytes", None))
    if len(data) == 0 and mine:
        where = "" if shard[1] == 1 else f" (shard {shard[0]} of {shard[1]})"
        raise PreflightError(
            f"dataset.path={str(ds.path)!r}: none of {mine} rows{where} is usable "
            f"(skipped by reason: { {k: v for k, v in data.report['skipped'].items() if v} }); "
            "check the row format (ShareGPT `conversations` or OpenAI `messages`)"
        )
    return data
