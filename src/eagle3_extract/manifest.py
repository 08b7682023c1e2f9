"""Provenance of an output directory: run identity (`run.json`) and `manifest.json`.

`run.json` is written before extraction starts and holds what determines the
data (model, layers, dataset options, output layout), hashed into `run_id`. A
rerun into the same directory resumes only when its `run_id` matches, so files
from two different configs can never mix. Performance knobs (token budget,
writer threads, engine choice, parallelism) are not part of the identity.

`manifest.json` describes the finished (or in-progress) run: resolved config,
model identity, package versions, applied patches, counts, bytes, timings.
Every JSON file here is written atomically (temp + `os.replace`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_extract.cpu_build import NAMES as CPU_BUILDS
from eagle3_extract.errors import PreflightError
from eagle3_extract.layout import (RUN_JSON, Storage, atomic_write, json_temp_name,
                                   link_target, manifest_name, temp_path)

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import DatasetConfig, ModelConfig, OutputConfig

FORMAT_VERSION = 1
LAYER_CONVENTION = ("vllm: id k = residual stream entering decoder layer k; "
                    "id N = final state before the final norm")


@dataclass
class Manifest:
    """manifest.json: the schema every writer and reader of it shares.

    The job fills it in as it goes (status running -> complete | failed);
    eagle3-status, eagle3-validate, eagle3-verify and the data-parallel
    launcher read it with `Manifest.read`. Sections that are plain dicts keep
    the keys docs/job.md lists; a field a reader needs but an old or partial
    manifest lacks is None, never an exception.
    """

    run_id: str | None = None
    status: str | None = None
    format_version: int = FORMAT_VERSION
    started: str | None = None
    updated: str | None = None
    finished: str | None = None
    host: str | None = None
    process: dict[str, Any] | None = None  # who writes it (status tells a killed job)
    config: dict[str, Any] | None = None  # the resolved Hydra config
    layer_ids: list[int] | None = None
    layer_convention: str = LAYER_CONVENTION
    model: dict[str, Any] | None = None  # path, architecture, num_layers, hidden_size, dtype
    output: dict[str, Any] | None = None  # format, layout
    shard: dict[str, int] = field(default_factory=lambda: {"index": 0, "count": 1})
    data: dict[str, Any] | None = None  # the dataset report: rows, usable, skipped by reason
    engine: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    counts: dict[str, Any] | None = None  # only when complete
    tokens: dict[str, Any] | None = None
    bytes: dict[str, Any] | None = None
    token_freq: str | None = None
    produced_by: dict[str, int] | None = None  # engine name -> sample files it wrote
    vocab: dict[str, Any] | None = None  # merged token_freq.json, vocab/ (d2t, t2d) when written
    versions: dict[str, Any] | None = None
    patches: dict[str, Any] | None = None

    @property
    def shard_index(self) -> int:
        return int((self.shard or {}).get("index", 0))

    @property
    def shard_count(self) -> int:
        return int((self.shard or {}).get("count", 1))

    @property
    def file_name(self) -> str:
        return manifest_name(self.shard_index, self.shard_count)

    @property
    def storage(self) -> Storage:
        """How this run stored its states (its output.*), for the readers of a run."""
        return Storage.from_output(((self.config or {}).get("output")) or {})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> "Manifest":
        if not isinstance(obj, dict):
            raise ValueError(f"a manifest is a JSON object, not {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})

    @classmethod
    def read(cls, path: Path) -> "Manifest":
        """Raises OSError or ValueError (json.JSONDecodeError included)."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def write(self, root: Path) -> None:
        write_json_atomic(root / self.file_name, self.to_dict())


def write_json_atomic(path: Path, obj: Any) -> None:
    with atomic_write(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")


def clean_json_temps(root: Path, names: list[str], shared: tuple[str, ...] = (RUN_JSON,),
                     shared_min_age_s: float = 300.0) -> int:
    """Remove temps of `names` left by a killed run (`.<name>.tmp-<pid>`).

    `names` are this job's own files; temps of files every shard writes (`run.json`)
    go only once they are old, so a live shard's in-flight write is never touched.
    """
    removed = 0
    now = time.time()
    for entry in os.scandir(root):
        for name in (*names, *shared):
            if entry.name.startswith(json_temp_name(name, "")) and entry.is_file():
                if name in shared and now - entry.stat().st_mtime < shared_min_age_s:
                    continue
                os.unlink(entry.path)
                removed += 1
    return removed


def file_sha256(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tree_sha256(root: Path) -> str:
    """Every file under `root` (a local dataset folder) by relative path and content."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(".") or "/." in rel:  # .git, .cache: not the data
            continue
        h.update(f"{rel}\0{file_sha256(path)}\0".encode())
    return h.hexdigest()


def dataset_identity(ds: Any, max_length: int) -> dict[str, Any]:
    """What selects and shapes the samples. Local files and folders by content, hub
    datasets by the commit the hub cache resolved (a dataset updated upstream is another
    dataset: its tokenized set and its run are new)."""
    from eagle3_extract.hub import dataset_revision

    path = Path(str(ds.path)).expanduser()
    source: dict[str, Any]
    if ds.format != "hub" and path.is_file():
        source = {"file_sha256": file_sha256(path)}
    else:
        source = {"hub": str(ds.path), "hub_config": ds.hub_config,
                  "data_files": ds.data_files, "split": ds.split}
        if path.is_dir():
            source["tree_sha256"] = tree_sha256(path)
        else:
            source["revision"] = dataset_revision(str(ds.path))
    ident = {
        "source": source,
        "max_samples": ds.max_samples,
        "seed": int(ds.seed),
        "shuffle": bool(ds.shuffle),
        "max_length": int(max_length),
        "overlong": str(ds.overlong),
    }
    row_bytes = getattr(ds, "max_row_bytes", None)
    if row_bytes is not None:  # the default follows max_length: earlier run ids stay
        ident["max_row_bytes"] = int(row_bytes)
    return ident


def chat_template_sha256(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()


def run_identity(model: ModelConfig, dataset: DatasetConfig, output: OutputConfig,
                 storage: Storage, info: Any, layer_ids: list[int], template_sha256: str,
                 max_length: int) -> dict[str, Any]:
    """What determines the data (the model, its layers, the dataset as read, the layout and
    how states are stored), hashed into run_id; nothing of how fast it is made."""
    ident = {
        "format_version": FORMAT_VERSION,
        "model": {
            "path": str(model.path),
            "tiny_config": model.tiny_config if str(model.path) == "tiny" else None,
            "config_sha256": info.config_sha256,
            "architecture": info.architecture,
            "num_layers": info.num_layers,
            "hidden_size": info.hidden_size,
            "dtype": str(info.dtype).removeprefix("torch."),
            "quantization": model.quantization,
            "tokenizer": model.tokenizer,
            "chat_template_sha256": template_sha256,
        },
        "layer_ids": list(layer_ids),
        "dataset": dataset_identity(dataset, max_length),
        "output": {"format": str(output.format), "files_per_dir": int(output.files_per_dir)},
    }
    stored = storage.identity()
    if stored:  # only when not the model dtype: the run ids of earlier runs stay valid
        ident["output"]["states"] = stored
    return with_run_id(ident)


def with_run_id(ident: dict[str, Any]) -> dict[str, Any]:
    """`ident` plus its `run_id`: 16 hex digits of the sha256 of its canonical JSON. One
    definition for extraction, regeneration and training runs: a rerun is the same run
    exactly when everything that determines its output is the same."""
    ident = {k: v for k, v in ident.items() if k != "run_id"}
    ident["run_id"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return ident


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k == "run_id":
                continue
            out += _diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]}: {a!r} -> {b!r}"]


def read_run_json(root: Path) -> dict[str, Any]:
    """`root`'s run identity. Raises OSError (missing, or a symbolic link: not this
    directory's own record, never read through) or ValueError (not JSON)."""
    path = root / RUN_JSON
    if path.is_symlink():
        raise OSError(f"run.json is a symbolic link (to {link_target(path)}), not this "
                      "directory's own record")
    return json.loads(path.read_text())


def check_run_json(root: Path, ident: dict[str, Any]) -> bool:
    """True if `root` holds an earlier run of this identity (resume); raise if another."""
    path = root / RUN_JSON
    if not path.exists() and not path.is_symlink():
        return False
    try:
        old = read_run_json(root)
    except (OSError, ValueError) as e:
        raise PreflightError(f"output.dir={str(root)!r}: unreadable run.json ({e}); remove "
                             "it, or set output.dir to a new directory") from e
    if old.get("run_id") == ident["run_id"]:
        return True
    changes = "; ".join(_diff(old, ident)[:8]) or "(identity hash differs)"
    raise PreflightError(
        f"output.dir={str(root)!r} holds a run with a different data-determining config "
        f"(run_id {old.get('run_id')} there, {ident['run_id']} now): {changes}. Resume "
        "only with the same model, layers, dataset options and output format; set "
        "output.dir to a new directory for this config."
    )


def write_run_json(root: Path, ident: dict[str, Any]) -> None:
    write_json_atomic(root / RUN_JSON, ident)


def claim_run_json(root: Path, ident: dict[str, Any], wait_s: float = 10.0) -> bool:
    """Fix `root`'s run identity, or check it: the one step every shard takes before it
    writes a sample. Returns True when `root` already held this identity (resume), False
    when this call created `run.json`; raises PreflightError when it holds another.

    Creation is exclusive: the whole file is written under a temp name and hard-linked
    to `run.json` (link(2) fails if the name exists), so of shards starting at the same
    moment exactly one creates it and every other reads that one's whole file and is
    checked against it. Where a filesystem has no hard links, `O_EXCL` creates it and a
    reader waits (up to `wait_s`) for a just-created file to be whole.
    """
    path = root / RUN_JSON
    if path.exists() or path.is_symlink():
        return _check_claimed(root, ident, wait_s)
    data = (json.dumps(ident, indent=2, default=str) + "\n").encode()
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return _check_claimed(root, ident, wait_s)
        except OSError:  # no hard links here (some FUSE and SMB mounts)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return _check_claimed(root, ident, wait_s)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    finally:
        tmp.unlink(missing_ok=True)
    return False


def _check_claimed(root: Path, ident: dict[str, Any], wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return check_run_json(root, ident)
        except PreflightError as e:
            fresh = "unreadable run.json" in str(e) and _age_s(root / RUN_JSON) < wait_s
            if not fresh or time.monotonic() > deadline:  # not one being written now
                raise
            time.sleep(0.05)


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return float("inf")


def retract_run_json(root: Path, ident: dict[str, Any]) -> bool:
    """Undo this job's `claim_run_json` after its own preflight failed, when nothing of
    the run exists yet (no manifest, no sample file) and no other shard holds a lock in
    `root` (lock.py's guard serialises this with their start): a first attempt whose
    dataset was unusable must not fix the identity for the corrected one."""
    from eagle3_extract.layout import DATA_DIR, MANIFEST_RE
    from eagle3_extract.lock import when_alone

    def retract() -> bool:
        if (any(MANIFEST_RE.match(e.name) for e in os.scandir(root))
                or any((root / DATA_DIR).rglob("*"))):
            return False
        if read_run_json(root).get("run_id") != ident["run_id"]:
            return False
        (root / RUN_JSON).unlink()
        return True

    try:
        return bool(when_alone(root, retract))
    except (OSError, ValueError):
        return False


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, dists in {
        "vllm": (*CPU_BUILDS, "vllm"),  # a CPU build first: it names its instruction set
        "torch": ("torch",),
        "transformers": ("transformers",),
        "speculators": ("speculators",),
        "safetensors": ("safetensors",),
        "datasets": ("datasets",),
        "eagle3_extract": ("eagle3-extract",),
    }.items():
        out[name] = None
        for d in dists:
            try:
                out[name] = importlib.metadata.version(d)
                if d != name:
                    out[name] += f" ({d})"
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def patch_manifest() -> dict[str, Any] | None:
    """The applied-patch manifest shipped inside the speculators install, if any."""
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "_eagle3_patches.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def new_manifest(resolved_cfg: dict[str, Any], ident: dict[str, Any], info: Any,
                 layer_ids: list[int], layout: str, shard: tuple[int, int]) -> Manifest:
    return Manifest(
        run_id=ident["run_id"],
        status="running",
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        host=socket.gethostname(),
        config=resolved_cfg,
        layer_ids=list(layer_ids),
        model={
            "path": str(resolved_cfg["model"]["path"]),
            "resolved_path": info.path,
            "tokenizer_path": info.tokenizer_path,
            "architecture": info.architecture,
            "num_layers": info.num_layers,
            "hidden_size": info.hidden_size,
            "dtype": str(info.dtype).removeprefix("torch."),
            "config_sha256": info.config_sha256,
            "vocab_size": getattr(info, "vocab_size", None),
        },
        output={"format": resolved_cfg["output"]["format"], "layout": layout},
        shard={"index": shard[0], "count": shard[1]},
        versions=package_versions(),
        patches=patch_manifest(),
    )
