"""The tokenized dataset as an artifact later jobs reuse, never trust.

Rendering and tokenizing is the slow part of preflight (38 s for 20k conversations on
two cores); a rerun, a resume, a shard rerun or a Hydra sweep over layers would do it
again for the same rows. So a shard's `Tokenized` is kept under
`$EAGLE3_CACHE/tokenized/<key>/` (default `~/.cache/eagle3-extract`), keyed by
everything that determines it: the dataset (its bytes' sha256, or hub name, config,
files and split), max_samples, seed, shuffle, max length, overlong policy, the
tokenizer's files, the chat template, the shard, and the code that renders
(the bytes of RENDERING_CODE: this folder's modules that turn rows into samples).
Written once, atomically (a temp dir renamed; a second writer of the same key keeps the
first's), with the xxh3-128 of every array and of the report (its counts) in its meta; read back
only when every array and the report hash to what was written, else rebuilt, with a warning.
`rm -rf ~/.cache/eagle3-extract/tokenized` clears it; EAGLE3_TOKENIZED_CACHE names another
directory, or `off` (benchmarks that time tokenizing set it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np

from eagle3_extract.dataset.samples import Tokenized
from eagle3_extract.layout import content_checksum
from eagle3_extract.manifest import file_sha256

log = logging.getLogger("eagle3_extract")
FORMAT = 2  # 2: the report is hashed too
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")


CACHE_ENV = "EAGLE3_TOKENIZED_CACHE"  # a directory, or "off" (benchmarks of tokenizing)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    root = Path(os.environ.get("EAGLE3_CACHE", Path.home() / ".cache" / "eagle3-extract"))
    return root / "tokenized"


def enabled() -> bool:
    return os.environ.get(CACHE_ENV, "").lower() not in ("off", "0", "none")


def tokenizer_identity(path: str) -> dict[str, Any]:
    """The tokenizer by its files' content where they are local, else by name (a hub
    tokenizer's resolved snapshot path names its revision)."""
    p = Path(path).expanduser()
    files = {n: file_sha256(p / n) for n in TOKENIZER_FILES if (p / n).is_file()}
    return {"files": files} if files else {"name": str(path)}


# the modules whose code decides a row's tokens and mask: a change to any makes a new key
RENDERING_CODE = ("rows.py", "messages.py", "render.py", "samples.py")


def key_of(dataset: dict[str, Any], tokenizer: dict[str, Any], template_sha256: str,
           shard: tuple[int, int]) -> str:
    code = [file_sha256(Path(__file__).with_name(f)) for f in RENDERING_CODE]
    ident = {"format": FORMAT, "dataset": dataset, "tokenizer": tokenizer,
             "chat_template_sha256": template_sha256, "shard": list(shard), "code": code}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def _hashes(arrays: dict[str, np.ndarray], report: dict[str, Any]) -> dict[str, str]:
    """Every array's bytes and the report (the counts the manifest takes from it): a
    count edited in meta.json is damage like a flipped byte."""
    out = {name: content_checksum([np.ascontiguousarray(a).view(np.uint8).reshape(-1)])
           for name, a in arrays.items()}
    out["report"] = content_checksum([json.dumps(report, sort_keys=True, default=str).encode()])
    return out


def _as_saved(data: Tokenized) -> dict[str, np.ndarray]:
    """The arrays as `Tokenized.save` writes them (token ids as int32)."""
    return {n: (data.ids.astype(np.int32) if n == "ids" else getattr(data, n))
            for n in Tokenized._ARRAYS}


def load(key: str) -> Tokenized | None:
    """The artifact of `key` (memory-mapped), or None when there is none or it is not
    what was written (every array hashed against the record written with it)."""
    path = cache_dir() / key
    if not path.is_dir():
        return None
    try:
        data, meta = Tokenized.load(path)
        if meta.get("key") != key or meta.get("hashes") != _hashes(_as_saved(data),
                                                                   data.report):
            raise ValueError("its arrays or counts differ from what was written")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("tokenized set %s is damaged (%s): rebuilding it", path, e)
        shutil.rmtree(path, ignore_errors=True)
        return None
    return data


def store(key: str, data: Tokenized) -> None:
    """Write the artifact once; a concurrent writer of the same key keeps the first."""
    path = cache_dir() / key
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data.save(path, {"key": key, "hashes": _hashes(_as_saved(data), data.report)})
    except OSError as e:  # another job's copy landed first, or no room: not our problem
        if not path.is_dir():
            log.warning("tokenized set not kept in %s (%s)", cache_dir(), e)


def cached(key: str, build: Callable[[], Tokenized]) -> tuple[Tokenized, bool]:
    """(the tokenized set, whether it was reused); built and stored when it is not kept."""
    if not enabled():
        return build(), False
    data = load(key)
    if data is not None:
        return data, True
    data = build()
    store(key, data)
    return data, False
