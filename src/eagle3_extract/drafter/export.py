"""`eagle3-export DIR OUT [--format F]`: an extraction in the layout a trainer reads.

Three trainers, each read by its own released code (drafter/export_formats.py says what
each file holds): speculators 0.9.0 (`--format speculators`, the default: an Arrow
dataset and `hidden_states/hs_<row>.safetensors`), SpecForge 0.2.0 (`specforge`:
`rows/*/<index>.ckpt`) and ModelOpt 0.47.0 (`modelopt`: `rows/*/<index>.pt`). The two
last want the final state after the final norm, which is applied here from the model's
checkpoint (`--model`, default the one the manifest names).

Nothing is taken on trust: every sample the manifests say was written must be there,
each source file's bytes are checked against the checksum written with them as they are
read, and every row written is fsynced under its final name and journaled with its
sha256. The export fills `.<OUT>.partial` and is renamed to OUT only when whole, with
export.json listing every file and its sha256; a killed export rerun with the same
command resumes there, keeping only rows whose file re-hashes to its journal line and
whose source file is unchanged. Each trainer needs its own environment (make
venv-train, venv-specforge, venv-modelopt), none this one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.entry import command
from eagle3_extract.errors import PreflightError
from eagle3_extract.check.run_dir import DamagedSample, missing_samples, read_checked, run_state
from eagle3_extract.drafter import export_formats as formats
from eagle3_extract.drafter.export_formats import FORMATS, POST_NORM, FormatError
from eagle3_extract.safetensors_file import save_safetensors
from eagle3_extract.layout import (EXPORT_JSON, SCALES_KEY, STATES_KEY, VOCAB_DIR, atomic_write, remove_temps, temp_path, verified_files)
from eagle3_extract.lock import _try_flock
from eagle3_extract.manifest import file_sha256, write_json_atomic
from eagle3_extract.quant import states_of, states_tensor

FORMAT_NAMES = {"speculators": "speculators-0.9", "specforge": "specforge-0.2",
                "modelopt": "modelopt-0.47"}
JOURNAL = "export-journal.jsonl"  # in the partial dir: its identity, then a line per row


class ExportError(PreflightError):
    """The extraction cannot be exported as it is (what to fix is in the line): exit 2."""


def partial_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial")


def _spans(mask: torch.Tensor) -> list[list[int]]:
    """A loss mask as [start, length] runs of ones (the journal keeps it for the Arrow rows)."""
    runs, start = [], None
    for i, v in enumerate(mask.tolist() + [0]):
        if v and start is None:
            start = i
        elif not v and start is not None:
            runs.append([start, i - start])
            start = None
    return runs


def _unspans(runs: list[list[int]], n: int) -> list[int]:
    mask = [0] * n
    for start, length in runs:
        mask[start:start + length] = [1] * length
    return mask


def _source_id(entry: os.DirEntry) -> str:
    st = entry.stat(follow_symlinks=False)
    return f"{st.st_size}:{st.st_mtime_ns}"


def _checked_source(root: Path, out: Path) -> tuple[list, dict, str, bool]:
    """(manifests, whole files by index, format, fp8) of a finished, undamaged extraction."""
    if out == root or out.is_relative_to(root) or root.is_relative_to(out):
        raise ExportError(f"{out} is inside {root} (or holds it): give an OUT outside the "
                          "extraction, whose directory must hold only what the job wrote")
    try:
        state = run_state(root)
    except PermissionError as e:
        raise ExportError(f"{e.filename or root}: cannot be read ({e.strerror}); fix its "
                          "permissions") from e
    if state.unfinished:
        raise ExportError(f"{root}: {state.unfinished[0]}; finish the extraction first "
                          "(eagle3-status)")
    if state.why:  # links where its files belong: their own fix, in the line
        raise ExportError(f"{root}: {state.why}")
    manifests = state.manifests
    fmt = str(manifests[0].config["output"]["format"])
    fp8 = manifests[0].storage.fp8
    whole, damaged = verified_files(root, fmt)
    if damaged:
        raise ExportError(f"{root}: {len(damaged)} sample files are not whole (e.g. index "
                          f"{next(iter(damaged))}); rerun the extraction to redo them")
    gone = missing_samples(manifests, whole)
    if gone:
        raise ExportError(f"{root}: {gone}; rerun the extraction with the same config to "
                          "redo the missing files (eagle3-validate names them)")
    return manifests, whole, fmt, fp8


def _final_norm(man: Any, model: str | None):
    """The model's final norm (post-norm formats), from --model or the manifest's model."""
    from omegaconf import OmegaConf

    from eagle3_extract.models.config import inspect_model

    mcfg = OmegaConf.create(man.config["model"])
    if model:
        mcfg.path = model
    try:
        info = inspect_model(mcfg)
        if (info.num_layers, info.hidden_size) != (man.model["num_layers"],
                                                   man.model["hidden_size"]):
            raise ExportError(f"{info.path} has {info.num_layers} layers x {info.hidden_size}, "
                              f"the extraction was made with {man.model['num_layers']} x "
                              f"{man.model['hidden_size']}; give --model the model it ran on")
        want = man.model.get("config_sha256")
        if want and info.config_sha256 != want:
            raise ExportError(f"{info.path}: its config.json (sha256 "
                              f"{str(info.config_sha256)[:12]}..) is not the one the extraction "
                              f"ran on ({want[:12]}..); give --model the checkpoint it ran on")
        return formats.load_final_norm(info.path, info.hidden_size), info
    except (ValueError, OSError) as e:
        raise ExportError(f"{e} (--model DIR: the checkpoint the extraction ran on)") from None


def _is_temp(name: str) -> bool:
    """What a killed writer of ours left: layout's temp names (`.NAME.tmp-TAG`)."""
    return name.startswith(".") and ".tmp-" in name


@contextmanager
def _owned_partial(part: Path, out: Path) -> Iterator[None]:
    """Hold `part` for this export alone (a lock on the directory itself, which travels
    with its rename to OUT): a second export into the same OUT is one line, and a folder
    at `part` that an export did not make is left alone."""
    made = False
    try:
        part.mkdir(parents=True)
        made = True
    except FileExistsError:
        if part.is_symlink() or not part.is_dir():
            raise ExportError(f"{part} exists and is not an export's directory; move it away "
                              "or give another OUT") from None
    fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if not _try_flock(fd) or os.fstat(fd).st_ino != os.stat(part).st_ino:
            raise ExportError(f"another eagle3-export is writing {out} (it holds {part}); "
                              "wait for it to finish, or give another OUT")
        try:
            if not (part / JOURNAL).is_file() and any(
                    not _is_temp(e.name) for e in os.scandir(part)):
                raise ExportError(f"{part} holds files an export did not write (it has no "
                                  f"{JOURNAL}); move it away or give another OUT")
            if out.exists() and any(out.iterdir()):
                raise ExportError(f"{out} exists and is not empty: give a new directory")
            yield
        except BaseException:
            if made and not (part / JOURNAL).exists():
                shutil.rmtree(part, ignore_errors=True)  # ours, and nothing journaled in it
            raise
    finally:
        os.close(fd)


def _remove_row_temps(part: Path) -> int:
    """The temps a killed export left under `part` (files, and the Arrow index's temp
    directory): none may reach OUT."""
    removed = 0
    for dirpath, dirnames, names in os.walk(part):
        for name in [d for d in dirnames if _is_temp(d)]:
            shutil.rmtree(os.path.join(dirpath, name))
            dirnames.remove(name)
            removed += 1
        for name in names:
            if _is_temp(name):
                os.unlink(os.path.join(dirpath, name))
                removed += 1
    return removed


def _journal(part: Path, identity: dict) -> dict[int, dict]:
    """The rows a killed export of the same identity journaled, by sample index; a
    partial export of anything else is refused. A line cut short by the kill is dropped,
    and the journal rewritten without it, so the next line starts on a line of its own."""
    path = part / JOURNAL
    if not path.is_file():
        _remove_row_temps(part)
        with atomic_write(path, "w") as f:
            f.write(json.dumps(identity) + "\n")
        return {}
    text = path.read_text()
    lines = text.splitlines()
    try:
        head = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        head = None
    if head != identity:
        raise ExportError(f"{part} holds a killed export of another source, format or model; "
                          "delete it (rm -r) or give another OUT")
    rows, good = {}, [lines[0]]
    for line in lines[1:]:
        try:
            rec = json.loads(line)
            rows[int(rec["index"])] = rec
            good.append(line)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a line a killed writer cut short: its row is redone
    if len(good) != len(lines) or not text.endswith("\n"):
        with atomic_write(path, "w") as f:
            f.write("".join(line + "\n" for line in good))
    return rows


def export(root: Path, out: Path, fmt: str = "speculators", model: str | None = None) -> dict:
    """Write OUT in `fmt` from the extraction in ROOT (complete, verified); return
    export.json. A killed export of the same source and format resumes."""
    t0 = time.perf_counter()
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    root, out = Path(os.path.abspath(root)), Path(os.path.abspath(out))
    manifests, whole, src_fmt, fp8 = _checked_source(root, out)
    man = manifests[0]
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: give a new directory")
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{out} exists and is not a directory: give a new directory")
    layer_ids = list(man.layer_ids)
    norm, dtype, model_rec = None, None, None
    if fmt in POST_NORM:
        try:
            formats.check_layers(fmt, layer_ids, int(man.model["num_layers"]))
        except FormatError as e:
            raise ExportError(str(e)) from None
        norm, info = _final_norm(man, model)
        dtype = info.dtype
        model_rec = {"path": info.path, "final_norm": norm.key, "rms_norm_eps": norm.eps,
                     "final_norm_sha256": norm.sha256}
    identity = {"source_run_id": man.run_id, "format": fmt,
                "final_norm_sha256": norm.sha256 if norm else None}
    remove_temps(out)  # an earlier (pre-journal) export's, killed
    part = partial_dir(out)
    with _owned_partial(part, out):
        done = _journal(part, identity)
        _remove_row_temps(part)
        return _write_rows(root, out, part, fmt, man, whole, src_fmt, fp8, norm, dtype,
                           model_rec, identity, done, t0)


def _write_rows(root: Path, out: Path, part: Path, fmt: str, man: Any, whole: dict,
                src_fmt: str, fp8: bool, norm: Any, dtype: Any, model_rec: dict | None,
                identity: dict, done: dict[int, dict], t0: float) -> dict:
    layer_ids = list(man.layer_ids)
    kept = 0
    journal = open(part / JOURNAL, "a")
    last_sync = time.monotonic()
    try:
        for row, index in enumerate(sorted(whole)):
            entry = whole[index]
            rel = formats.rel_path(fmt, row, index)
            old = done.get(index)
            if (old and old["file"] == rel and old["source"] == _source_id(entry)
                    and (part / rel).is_file() and file_sha256(part / rel) == old["sha256"]):
                kept += 1
                continue
            try:
                tensors, _, had = read_checked(Path(entry.path), index, src_fmt, man.run_id)
            except DamagedSample as e:
                raise ExportError(f"{e}; delete it and rerun the extraction with the same "
                                  "config to redo it, then export again") from None
            if fp8 != (SCALES_KEY in tensors):
                raise ExportError(f"{entry.path}: {'no' if fp8 else ''} scales, the manifest "
                                  f"says output.dtype={'fp8' if fp8 else 'model'}")
            ids = tensors["input_ids"].to(torch.int64)
            if fmt == "speculators":
                sha = _write_speculators_row(part / rel, tensors, ids, index, layer_ids, fp8)
            else:
                states = states_of(tensors, dtype)  # fp8 dequantized to the model dtype
                sha = formats.save_torch(formats.trainer_tensors(
                    fmt, ids, tensors["loss_mask"], states, norm, dtype), part / rel)
            journal.write(json.dumps({"row": row, "index": index, "file": rel, "sha256": sha,
                                      "source": _source_id(entry), "tokens": len(ids),
                                      "checksum": had,
                                      "mask": _spans(tensors["loss_mask"])}) + "\n")
            if time.monotonic() - last_sync > 2:  # a lost line only costs its row again
                journal.flush()
                os.fsync(journal.fileno())
                last_sync = time.monotonic()
        journal.flush()
        os.fsync(journal.fileno())
    finally:
        journal.close()
    rows = _journal(part, identity)
    lost = sorted(set(whole) - set(rows))
    if lost:  # nothing may look whole with a row short
        raise ExportError(f"{len(lost)} of {len(whole)} rows are not in {part}'s journal "
                          f"(e.g. sample {lost[0]}); rerun the same command to redo them")
    rows = {i: rows[i] for i in whole}
    return _finish(root, out, part, fmt, man, rows, fp8, model_rec, kept, t0)


def _write_speculators_row(path: Path, tensors: dict, ids: torch.Tensor, index: int,
                           layer_ids: list[int], fp8: bool) -> str:
    states = states_tensor(tensors[STATES_KEY])
    extra = {SCALES_KEY: tensors[SCALES_KEY]} if fp8 else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    save_safetensors({"token_ids": ids, STATES_KEY: states.contiguous(), **extra}, tmp,
                     metadata={"sample_index": str(index), "layer_ids": json.dumps(layer_ids)})
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return file_sha256(path)


def _finish(root: Path, out: Path, part: Path, fmt: str, man: Any, rows: dict[int, dict],
            fp8: bool, model_rec: dict | None, kept: int, t0: float) -> dict:
    """The trainer's index (speculators' Arrow rows), export.json, then the rename."""
    ordered = [rows[i] for i in sorted(rows)]
    listed = {r["file"] for r in ordered}
    for top in {f.split("/")[0] for f in listed}:  # a row no journal line names is no row
        for dirpath, _, names in os.walk(part / top):
            for name in names:
                path = os.path.join(dirpath, name)
                if os.path.relpath(path, part) not in listed:
                    os.unlink(path)
    if fmt == "speculators":
        import datasets
        from safetensors import safe_open

        datasets.disable_progress_bars()  # our one summary line is the progress
        cols: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": [],
                                 "sample_index": []}
        for r in ordered:
            with safe_open(part / r["file"], "pt") as f:
                ids = f.get_tensor("token_ids")
            cols["input_ids"].append(ids.tolist())
            cols["loss_mask"].append(_unspans(r["mask"], r["tokens"]))
            cols["seq_len"].append(r["tokens"])
            cols["sample_index"].append(r["index"])
        _remove_row_temps(part)
        arrow = temp_path(part / "arrow")
        ds = datasets.Dataset.from_dict(cols)
        ds.set_format("torch")
        ds.save_to_disk(str(arrow))
        for p in arrow.iterdir():
            os.replace(p, part / p.name)
        arrow.rmdir()
    index = {}
    if fmt == "speculators":  # the Arrow files the trainer reads first, hashed like the rows
        index = {p.name: file_sha256(p) for p in sorted(part.iterdir())
                 if p.is_file() and p.name != JOURNAL and not _is_temp(p.name)}
    if (root / VOCAB_DIR).is_dir():
        shutil.rmtree(part / VOCAB_DIR, ignore_errors=True)
        shutil.copytree(root / VOCAB_DIR, part / VOCAB_DIR)
    layer_ids = list(man.layer_ids)
    record = {"format": FORMAT_NAMES[fmt], "source": str(root), "run_id": man.run_id,
              "layer_ids": layer_ids,
              "trainer_aux_layer_ids": formats.trainer_layer_ids(fmt, layer_ids),
              "rows": len(ordered),
              "hidden_states": ("fp8" if fp8 and fmt == "speculators"
                                else man.model["dtype"]),
              "last_layer": ("id N, before the final norm (the trainer applies the verifier's)"
                             if fmt == "speculators" else
                             "id N after the model's final norm (applied by eagle3-export)"),
              "model": model_rec,
              "checked": {"files": len(ordered),
                          "without_checksum": sum(not r["checksum"] for r in ordered)},
              "resumed_rows": kept,
              "files": {r["file"]: r["sha256"] for r in ordered},
              "index_files": index,
              "seconds": round(time.perf_counter() - t0, 3)}
    write_json_atomic(part / EXPORT_JSON, record)
    (part / JOURNAL).unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()
    part.rename(out)
    return record


def export_problem(out: Path) -> str | None:
    """Why a finished export cannot be trusted, or None: export.json whole, every file it
    lists (rows and the trainer's index) there and re-hashing to its sha256, one file per
    row. One read of the export: what a kept export costs before a trainer reads it."""
    try:
        rec = json.loads((out / EXPORT_JSON).read_text())
        files, index = dict(rec["files"]), rec.get("index_files")
        rows = int(rec["rows"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{out / EXPORT_JSON}: not a finished export's record ({type(e).__name__})"
    if len(files) != rows:
        return f"{EXPORT_JSON} lists {len(files)} files for {rows} rows"
    if index is None and rec.get("format") == FORMAT_NAMES["speculators"]:
        return f"{EXPORT_JSON} has no hashes of the trainer's index (an older export)"
    for rel, sha in {**files, **(index or {})}.items():
        path = out / rel
        if path.is_symlink() or not path.is_file():
            return f"{path} is missing"
        if file_sha256(path) != sha:
            return f"{path} changed after it was exported (sha256 differs)"
    return None


@command("eagle3-export", os_errors=True)
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-export", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="an extraction's output.dir")
    ap.add_argument("out", type=Path, help="a new directory for the trainer's layout")
    ap.add_argument("--format", default="speculators", choices=FORMATS,
                    help="the trainer: speculators (0.9.0), specforge (0.2.0), modelopt (0.47.0)")
    ap.add_argument("--model", default=None,
                    help="the checkpoint the extraction ran on, for the final norm the "
                         "specforge and modelopt layouts apply (default: the manifest's)")
    args = ap.parse_args(argv)
    # the disk, not the code (a full one included): one line, and the rerun resumes
    rec = export(args.dir.resolve(), args.out.resolve(), args.format, args.model)
    resumed = f", {rec['resumed_rows']} kept from a killed export" if rec["resumed_rows"] else ""
    print(f"eagle3-export: {rec['rows']} rows in {args.out} ({rec['format']}{resumed}) in "
          f"{rec['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
