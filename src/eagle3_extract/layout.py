"""The on-disk layout of an output dir: every path, temp and manifest name, and the scans.

Torch-free, so eagle3-status and eagle3-validate start at once. The writer,
the job, status, validate and parallel all take names from here.

    <root>/run.json                        run identity (manifest.py)
    <root>/manifest[.shard-i-of-c].json    one per shard when shards share the dir
    <root>/token_freq[.shard-i-of-c].json
    <root>/data/<index // files_per_dir:05d>/<index:09d><ext>

A file appears under its final name only when complete (temp name in the same dir,
fsync, rename: `atomic_write`). Temp names are `.<name>.tmp-<pid>-<random>`: never
`*.safetensors` or `*pt` (speculators' loader takes every file whose name ends in "pt"
for a sample), and never the same for two writers (pods of a Kubernetes Job often all
run as pid 1, and the last of several shards writes the shared files).
"""

from __future__ import annotations

import json
import os
import re
import struct
import uuid
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_extract.errors import PreflightError

DATA_DIR = "data"
RUN_JSON = "run.json"
MANIFEST_JSON = "manifest.json"  # one shard; manifest_name() for several
TOKEN_FREQ_JSON = "token_freq.json"  # the shards' counts merged (dataset/token_freq.py)
VOCAB_DIR = "vocab"  # the draft vocabulary mapping, speculators' layout:
D2T_NPY, T2D_NPY = "d2t.npy", "t2d.npy"  # int64 [draft vocab], bool [target vocab]
EXPORT_JSON = "export.json"  # an export's record of its source (drafter/export.py)
TRAIN_JSON = "eagle3-train.json"  # a drafter's record of its data and settings (drafter/train.py)
ACCEPTANCE_JSON = "acceptance.json"  # eagle3-acceptance's report (drafter/acceptance.py)
ACCEPTANCE_PNG = "acceptance.png"  # its per-position chart (drafter/chart.py)
# the tensors of a sample file
INPUT_IDS_KEY, LOSS_MASK_KEY, STATES_KEY = "input_ids", "loss_mask", "hidden_states"
EXTENSIONS = {"safetensors": ".safetensors", "speculators_pt": ".pt"}
SAMPLE_TEMP = re.compile(r"^\.(\d+)\.(safetensors|pt)\.tmp-\d+(-[0-9a-f]+)?$")
MANIFEST_RE = re.compile(r"^manifest(?:\.shard-(\d+)-of-(\d+))?\.json$")
SUBDIR_RE = re.compile(r"^\d{5,}$")
# Files the job and its tools write next to data/.
TOP_LEVEL_RE = re.compile(
    r"^(manifest|token_freq)(\.shard-\d+-of-\d+)?\.json$"
    r"|^run\.json$|^(validate|verify)_report\.json$"
)


# fp8 states' scales: hs_connectors.fp8_utils.SCALES_KEY (speculators 0.9.0), quant.py
SCALES_KEY = "hidden_states_scales"
# safetensors metadata: xxh3-128 of every byte after the header (the tensors), computed
# by the writer from memory as it writes; speculators_pt files carry the zip's CRC-32
# of each member instead (torch.save computes it).
CHECKSUM_KEY = "content_xxh3_128"


@dataclass(frozen=True)
class Storage:
    """How a run stores its states (`output.dtype`, `output.fp8_scale`): the model's
    dtype, or fp8 e4m3 with float32 scales (quant.py has the arithmetic)."""

    dtype: str = "model"
    scale: str = "token"

    @classmethod
    def from_output(cls, output: Any) -> Storage:
        """From the job's config node or a manifest's recorded `config.output` dict
        (a manifest written before fp8 existed has neither key: the model dtype)."""
        get = output.get if hasattr(output, "get") else lambda k, d: getattr(output, k, d)
        return cls(str(get("dtype", None) or "model"), str(get("fp8_scale", None) or "token"))

    @property
    def fp8(self) -> bool:
        return self.dtype == "fp8"

    def stored_dtype(self, model_dtype: Any) -> Any:
        import torch

        return torch.float8_e4m3fn if self.fp8 else model_dtype

    def scale_columns(self, num_layers: int) -> int:
        """Scales per token: 0 (none), 1 (token) or one per layer (token_layer)."""
        if not self.fp8:
            return 0
        return num_layers if self.scale == "token_layer" else 1

    def bytes_per_token(self, num_layers: int, hidden: int, model_dtype: Any) -> int:
        """States and scales of one token (ids and mask not included)."""
        return (num_layers * hidden * self.stored_dtype(model_dtype).itemsize
                + 4 * self.scale_columns(num_layers))

    def identity(self) -> dict[str, str] | None:
        """What the run identity records (None for the model dtype: older run ids hold)."""
        return {"dtype": "float8_e4m3fn", "scale": self.scale} if self.fp8 else None


LOGS_DIR = "logs"  # Hydra's logs of each job in its output dir (conf/config.yaml)


def foreign_entries(root: Path) -> list[str]:
    """What in `root` says it is not a run directory of ours: every visible entry but
    Hydra's `logs/`, unless `root` holds a `run.json` (written before any other file of a
    run: manifest.claim_run_json). Our hidden files (temps, locks) are not counted; a
    directory that does not exist or is empty has none. Names only, nothing followed."""
    try:
        entries = [e for e in os.scandir(root)]
    except (FileNotFoundError, NotADirectoryError):  # to be made (or refused as unwritable)
        return []
    names = {e.name for e in entries}
    if RUN_JSON in names and not (root / RUN_JSON).is_symlink():
        return []
    return sorted(n for n in names if not n.startswith(".") and n != LOGS_DIR)


def manifest_name(shard_index: int, shard_count: int, stem: str = "manifest") -> str:
    """`manifest.json`, or one file per shard when shards share a directory."""
    if shard_count == 1:
        return f"{stem}.json"
    return f"{stem}.shard-{shard_index:05d}-of-{shard_count:05d}.json"


def json_temp_name(name: str, tag: str) -> str:
    return f".{name}.tmp-{tag}"


def temp_path(path: Path) -> Path:
    """The temp file beside `path` that one writer fills before the rename."""
    return path.with_name(json_temp_name(path.name, f"{os.getpid()}-{uuid.uuid4().hex[:8]}"))


def remove_temps(path: Path) -> int:
    """Remove what killed writers of `path` left beside it (`temp_path` files or
    directories): only for a path one job owns (its lock, or a user's new directory)."""
    import shutil

    removed = 0
    for entry in path.parent.glob(json_temp_name(path.name, "*")):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed += 1
    return removed


@contextmanager
def atomic_write(path: Path, mode: str = "wb", **open_kw: Any) -> Iterator[Any]:
    """Write `path` whole or not at all: into `temp_path(path)`, fsync, rename; the temp
    is removed if the block raises."""
    tmp = temp_path(path)
    try:
        with open(tmp, mode, **open_kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sample_path(root: Path, index: int, files_per_dir: int, fmt: str) -> Path:
    return root / DATA_DIR / f"{index // files_per_dir:05d}" / f"{index:09d}{EXTENSIONS[fmt]}"


def sample_temp(path: Path) -> Path:
    return temp_path(path)


def layout_pattern(fmt: str, files_per_dir: int) -> str:
    """The sample path template as the manifest records it."""
    return f"data/{{index // {files_per_dir}:05d}}/{{index:09d}}{EXTENSIONS[fmt]}"


def _subdirs(root: Path) -> Iterable[os.DirEntry]:
    """data/'s real subdirectories: a symbolic link is never followed (`links` names it)."""
    data = root / DATA_DIR
    if data.is_symlink() or not data.is_dir():
        return []
    return [d for d in os.scandir(data) if d.is_dir(follow_symlinks=False)]


def links(root: Path) -> list[str]:
    """Symbolic links where the job's own files belong (relative paths), never followed.

    A link there would make resume write, and validate or export read, outside the
    output dir (a sample file linked to one elsewhere looks whole by its header): every
    tool treats it as damage, and the job removes it and redoes what it held.
    """
    out = [e.name for e in os.scandir(root)
           if e.is_symlink() and (e.name == DATA_DIR or TOP_LEVEL_RE.match(e.name))]
    data = root / DATA_DIR
    if data.is_dir() and not data.is_symlink():
        for sub in os.scandir(data):
            if sub.is_symlink():
                out.append(f"{DATA_DIR}/{sub.name}")
            elif sub.is_dir():
                out += [f"{DATA_DIR}/{sub.name}/{e.name}" for e in os.scandir(sub.path)
                        if e.is_symlink()]
    return sorted(out)


def link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


def remove_links(root: Path) -> list[str]:
    """Remove `links(root)` (the links themselves, never their targets); return them."""
    found = links(root)
    for rel in found:
        os.unlink(root / rel)
    return found


def sample_files(root: Path, fmt: str) -> dict[int, os.DirEntry]:
    """Index -> final sample file, for every final regular file under data/ (links are
    not sample files: `links`)."""
    ext = EXTENSIONS[fmt]
    files: dict[int, os.DirEntry] = {}
    for sub in _subdirs(root):
        for e in os.scandir(sub.path):
            stem = e.name[: -len(ext)]
            if e.name.endswith(ext) and stem.isdigit() and e.is_file(follow_symlinks=False):
                files[int(stem)] = e
    return files


def file_problem(path: str | Path, fmt: str, size: int | None = None, index: int | None = None,
                 run_id: str | None = None, content: bool = False) -> str | None:
    """Why a final sample file is not whole, or None. Cheap by default: the header, not
    the data.

    safetensors: the 8-byte header length, the JSON header, and the file size, which
    must be exactly header + the end of the last tensor; with `index` / `run_id`, the
    sample and run its metadata names. speculators_pt (a torch zip): the zip's central
    directory, which sits at the end, and every member inside the file. A file cut short,
    overwritten by something else, or relabelled fails either. `content=True` also reads
    the data once against the checksum written with it (a flipped bit; CRC-32 per member
    for speculators_pt): one read of the output.
    """
    try:
        size = os.path.getsize(path) if size is None else size
        if fmt == "safetensors":
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    return f"{size} bytes: no safetensors header"
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    return f"header of {n} bytes in a file of {size}"
                header = json.loads(f.read(n))
                end = max((t["data_offsets"][1] for k, t in header.items()
                           if k != "__metadata__"), default=0)
                if size != 8 + n + end:
                    return f"{size} bytes, the header says {8 + n + end}"
                meta = header.get("__metadata__") or {}
                if index is not None and meta.get("sample_index") != str(index):
                    return f"holds sample {meta.get('sample_index')!r}, not {index}"
                if run_id is not None and meta.get("run_id") != run_id:
                    return f"a file of run {meta.get('run_id')!r}, not {run_id!r}"
                if content and meta.get(CHECKSUM_KEY) is not None:
                    import xxhash

                    h = xxhash.xxh3_128()
                    while chunk := f.read(1 << 24):
                        h.update(chunk)
                    if h.hexdigest() != meta[CHECKSUM_KEY]:
                        return (f"content checksum {h.hexdigest()[:12]}.., written as "
                                f"{meta[CHECKSUM_KEY][:12]}..: the file changed after it "
                                "was written")
            return None
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"member {info.filename} runs past the end of the file"
            bad = z.testzip() if content else None
        return None if bad is None else f"member {bad} fails its CRC-32: changed after written"
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        return f"unreadable ({type(e).__name__}: {e})"


def content_checksum(blobs: Iterable[Any]) -> str:
    """xxh3-128 of the tensors' bytes in file order (about 10 GB/s a core: no second
    pass over the data worth the name)."""
    import xxhash

    h = xxhash.xxh3_128()
    for b in blobs:
        h.update(b)
    return h.hexdigest()


def safetensors_header(data: bytes | memoryview) -> tuple[int, dict[str, Any]]:
    """(header length, header) of a safetensors file's bytes; the tensors start at
    8 + length."""
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    return n, json.loads(bytes(data[8:8 + n]))


def content_problem(data: bytes | memoryview, fmt: str) -> tuple[str | None, bool]:
    """(why a whole file's bytes differ from the checksum written with them, or None;
    whether a checksum was there at all: files of older runs have none)."""
    if fmt != "safetensors":
        import io

        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
        return (None if bad is None else f"member {bad} fails its CRC-32: changed after "
                "it was written"), True
    n, header = safetensors_header(data)
    want = (header.get("__metadata__") or {}).get(CHECKSUM_KEY)
    if want is None:
        return None, False
    got = content_checksum([memoryview(data)[8 + n:]])
    if got != want:
        return (f"content checksum {got[:12]}.., written as {want[:12]}..: the file "
                "changed after it was written"), True
    return None, True


def verified_files(root: Path, fmt: str, owned: Callable[[int], bool] = lambda i: True,
                   run_id: str | None = None, content: bool = False
                   ) -> tuple[dict[int, os.DirEntry], dict[int, str]]:
    """(whole files by index, {index: problem} of the final files that are not whole,
    symbolic links in a sample file's place included), of the indices `owned` selects
    (a shard reads the headers of its own files only). `run_id`: each file's metadata
    must name that run and its own index; `content`: file_problem's full read."""
    good, bad = {}, {}
    for i, e in sample_files(root, fmt).items():
        if not owned(i):
            continue
        problem = file_problem(e.path, fmt, e.stat(follow_symlinks=False).st_size,
                               i if run_id else None, run_id, content)
        if problem is None:
            good[i] = e
        else:
            bad[i] = problem
    ext = EXTENSIONS[fmt]
    for rel in links(root):
        stem = Path(rel).name[: -len(ext)]
        if rel.endswith(ext) and stem.isdigit() and owned(int(stem)):
            bad[int(stem)] = f"a symbolic link (to {link_target(root / rel)}), not a file"
    return good, bad


def finished_indices(root: Path, fmt: str, owned: Callable[[int], bool] = lambda i: True
                     ) -> set[int]:
    """Indices (of those `owned` selects) whose final file exists and is whole."""
    return set(verified_files(root, fmt, owned)[0])


def clean_stale_temps(root: Path, owned: Callable[[int], bool] = lambda i: True) -> int:
    """Delete sample temp files left by a killed run, for the indices this job owns.

    `owned` keeps a shard from deleting another live shard's temp files when
    several shards write into one directory.
    """
    removed = 0
    for sub in _subdirs(root):
        for entry in os.scandir(sub.path):
            m = SAMPLE_TEMP.match(entry.name)
            if m and owned(int(m.group(1))):
                os.unlink(entry.path)
                removed += 1
    return removed


def file_bytes(root: Path, indices: Iterable[int], files_per_dir: int, fmt: str) -> int:
    """Total size of the final files of `indices` (missing files count 0)."""
    total = 0
    for i in indices:
        try:
            total += sample_path(root, i, files_per_dir, fmt).stat().st_size
        except FileNotFoundError:
            pass
    return total


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
