"""A dataset file (or hub dataset) -> its rows, in file order.

Rows are what the file holds, unjudged: a line that is not JSON or not UTF-8 keeps its
place as a Malformed (messages.py skips it, samples.py counts it). A plain .jsonl
file's rows are parsed when read (JsonlRows): a job over a million conversations keeps offsets, not dicts.
"""

from __future__ import annotations

import json
import mmap
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_extract.config import PreflightError

COMPRESSED = {".gz": "gzip", ".zst": "zstd"}
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Malformed:
    """Stands in for an unparsable row: it keeps its place in the order, and its reason."""

    line: int
    error: str
    reason: str = "malformed_json"


def split_compression(path: str) -> tuple[str, str | None]:
    """("chats.jsonl", "zstd") for "chats.jsonl.zst"; (path, None) if not compressed."""
    for ext, kind in COMPRESSED.items():
        if path.endswith(ext):
            return path[: -len(ext)], kind
    return path, None


def _resolve_format(ds: Any) -> str:
    fmt = ds.format
    if fmt != "auto":
        return fmt
    path = str(ds.path)
    name, _ = split_compression(path)
    for ext in ("jsonl", "json", "parquet"):
        if name.endswith("." + ext):
            return ext
    if Path(path).exists():
        raise PreflightError(
            f"dataset.path={path!r}: cannot tell the format from the name; set "
            "dataset.format=jsonl|json|parquet (.gz and .zst compression are read)"
        )
    return "hub"


def _open_bytes(path: Path) -> Any:
    """A binary stream of the file's content, decompressed (.gz, .zst) as its name says."""
    _, kind = split_compression(str(path))
    if kind == "gzip":
        import gzip

        return gzip.open(path, "rb")
    if kind == "zstd":
        import io

        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def _decode(raw: bytes, where: int) -> tuple[str | None, Malformed | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, Malformed(where, f"not UTF-8 at byte {e.start}", "invalid_utf8")


def _read_jsonl(path: Path) -> Sequence[Any]:
    """A compressed file's rows, parsed in full; a plain file's, parsed when read
    (JsonlRows)."""
    if split_compression(str(path))[1] is None:
        return JsonlRows(path)
    with _open_bytes(path) as f:
        return [_parse_line(raw, lineno) for lineno, _, _, raw in _row_lines(f)]


def _row_lines(f: Any) -> Any:
    """(line number, start, end, bytes) of each line that is a row: a leading BOM left
    out, blank lines skipped; start and end are byte offsets in the stream."""
    pos = 0
    for lineno, raw in enumerate(f, 1):
        start, pos = pos, pos + len(raw)
        if lineno == 1 and raw.startswith(BOM):
            start, raw = start + len(BOM), raw[len(BOM):]
        if not _blank(raw):
            yield lineno, start, pos, raw


def _blank(raw: bytes) -> bool:
    """Blank lines (and a CRLF's "\r") are not rows; Unicode whitespace counts as blank."""
    if not raw.strip():
        return True
    if raw.lstrip()[:1] in b"{[\"":  # a JSON value: the common case, decided without decoding
        return False
    try:
        return not raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


# An integer longer than this is not a number a chat row means (int() refuses past 4300
# digits): the row is malformed, never a ValueError that ends the job.
MAX_INT_DIGITS = 4000
# `\ud800`..`\udfff` written as an escape: only such a line can decode to a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class _HugeInt(str):
    """A JSON integer of more than MAX_INT_DIGITS digits, kept as its digits."""


def _parse_int(digits: str) -> Any:
    return int(digits) if len(digits) <= MAX_INT_DIGITS else _HugeInt(digits)


def loads(text: str) -> Any:
    """json.loads, with a too-long integer kept (as _HugeInt) for `value_problem` to
    name. Raises json.JSONDecodeError and RecursionError (nesting past Python's limit)."""
    return json.loads(text, parse_int=_parse_int)


def value_problem(obj: Any) -> tuple[str, str] | None:
    """(skip reason, detail) when a parsed row holds what no chat row can: a lone UTF-16
    surrogate (not text: it has no UTF-8 form, and the tokenizer raises on it; also what
    surrogateescape makes of bytes that are not UTF-8) or a too-long integer. Iterative:
    a row nested as deep as json.loads allows is walked without recursion."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, _HugeInt):
            return "malformed_json", f"an integer of {len(x)} digits"
        if isinstance(x, str):
            if any("\ud800" <= c <= "\udfff" for c in x):
                return "invalid_utf8", "a lone UTF-16 surrogate: not text"
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return None


def _parse_line(raw: bytes, lineno: int) -> Any:
    line, bad = _decode(raw, lineno)
    if bad is not None:
        return bad
    try:
        row = loads(line)
    except json.JSONDecodeError as e:
        return Malformed(lineno, str(e))
    except (RecursionError, ValueError) as e:  # nested deeper than json reads, ...
        return Malformed(lineno, f"{type(e).__name__}: {str(e)[:160]}")
    if isinstance(row, (dict, list)) and (_SURROGATE_ESCAPE.search(raw) or _has_huge(raw)):
        found = value_problem(row)
        if found:
            return Malformed(lineno, found[1], found[0])
    return row


def _has_huge(raw: bytes) -> bool:
    """Could the line hold a too-long integer? (A cheap test before walking the row.)"""
    return len(raw) > MAX_INT_DIGITS and re.search(rb"\d{%d}" % (MAX_INT_DIGITS + 1), raw) is not None


class JsonlRows(Sequence):
    """The rows of a plain JSONL file, each parsed when it is read.

    A million-conversation file held as Python dicts costs gigabytes in every job (and
    every shard needs only its share). This holds where each row's line starts and ends
    and its line number (24 bytes a row) over a read-only mapping of the file, which forked
    tokenizer workers share. A row reads as `_read_jsonl` of a compressed file gives it:
    the parsed value, or a Malformed that keeps its place. The file must not change while
    the job runs (the run's dataset identity hashes its bytes at the start).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        starts, ends, lines = array("q"), array("q"), array("q")
        with open(self.path, "rb") as f:
            for lineno, start, end, _ in _row_lines(f):
                starts.append(start)
                ends.append(end)
                lines.append(lineno)
        self._starts = np.frombuffer(starts, dtype=np.int64)
        self._ends = np.frombuffer(ends, dtype=np.int64)
        self._lines = np.frombuffer(lines, dtype=np.int64)
        self._map = None
        if len(self._starts):
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start, end = int(self._starts[i]), int(self._ends[i])
        return _parse_line(self._map[start:end], int(self._lines[i]))

    def row_bytes(self, i: int) -> int:
        """The bytes of row i's line, known before it is parsed."""
        return int(self._ends[i] - self._starts[i])

    def __reduce__(self) -> tuple:  # a spawned process maps the file itself
        return (JsonlRows, (self.path,))


def _read_json(path: Path) -> list[Any]:
    with _open_bytes(path) as f:
        raw = f.read()
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
    # Bytes that are not UTF-8 stay visible (as lone surrogates) so that only the rows
    # holding them are skipped and counted, not the whole file.
    text = raw.decode("utf-8", errors="surrogateescape")
    try:
        data = loads(text)
    except json.JSONDecodeError as e:
        raise PreflightError(
            f"dataset.path={str(path)!r} is not valid JSON ({e}); a .json dataset is one "
            "JSON list of rows (use .jsonl for one row per line)"
        ) from e
    except RecursionError as e:  # one value, so one row nested too deep ends the file
        raise PreflightError(
            f"dataset.path={str(path)!r} nests deeper than Python's JSON reader goes; write "
            "it as .jsonl (one row a line), where such a row is skipped and counted") from e
    if isinstance(data, dict):  # {"data": [...]} and similar single-key wrappers
        lists = [v for v in data.values() if isinstance(v, list)]
        data = lists[0] if len(lists) == 1 else data
    if not isinstance(data, list):
        raise PreflightError(f"dataset.path={str(path)!r}: expected a JSON list of rows")
    out = []
    for i, r in enumerate(data):
        found = value_problem(r)
        out.append(r if found is None else Malformed(i, found[1], found[0]))
    return out


def _read_file(path: Path, fmt: str) -> Sequence[Any]:
    if fmt == "jsonl":
        return _read_jsonl(path)
    if fmt == "json":
        return _read_json(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise PreflightError(f"dataset.format={fmt!r} is not a file format")


def _not_a_file(p: Path) -> str:
    """What a dataset path that is not a regular file is (stat follows a link)."""
    import stat

    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "no such file" + (" (a symbolic link to nothing)" if p.is_symlink() else "")
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return (f"is {what}, not a regular file; give a dataset file (a stream is "
                    "read twice: copy it to a file first)")
    return "is not a regular file"


def read_rows(ds: Any) -> Sequence[Any]:
    """All rows of the dataset, in file order. Raises PreflightError if unreadable."""
    fmt = _resolve_format(ds)
    path = str(ds.path)
    try:
        if fmt != "hub":
            p = Path(path).expanduser()
            if not p.is_file():
                raise PreflightError(f"dataset.path={path!r}: {_not_a_file(p)}")
            return _read_file(p, fmt)
        from eagle3_extract.hub import dataset_cached, require_hub

        require_hub("dataset.path", path, lambda: dataset_cached(path))
        files = ds.data_files
        if files and str(files).endswith((".json", ".jsonl")):
            # One raw file from a dataset repo: parse it ourselves, so that a bad row
            # is skipped and counted instead of failing Arrow's schema inference.
            from huggingface_hub import hf_hub_download

            local = hf_hub_download(path, str(files), repo_type="dataset")
            return _read_file(Path(local), "jsonl" if str(files).endswith("l") else "json")
        import datasets

        d = datasets.load_dataset(path, ds.hub_config, data_files=files, split=ds.split)
        return d  # Arrow-backed and memory-mapped: rows are read when used
    except PreflightError:
        raise
    except Exception as e:  # noqa: BLE001 - any loader failure is a config problem here
        raise PreflightError(
            f"dataset.path={path!r} could not be read ({type(e).__name__}: {e}); check "
            "dataset.path / dataset.split / dataset.data_files (hub datasets need network "
            "or a filled HF cache)"
        ) from e


def read_nonempty(ds: Any) -> Sequence[Any]:
    rows = read_rows(ds)
    if not rows:
        raise PreflightError(f"dataset.path={str(ds.path)!r} has no rows")
    return rows
