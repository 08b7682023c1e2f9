"""`eagle3-export DIR OUT`: an extraction in the layout speculators 0.9.0's trainer reads.

speculators >= 0.5 trains from an Arrow dataset (`datasets.load_from_disk(OUT)`, columns
`input_ids`, `loss_mask`, `seq_len`, torch format) and one hidden-state file per row,
`OUT/hidden_states/hs_<row>.safetensors` with `token_ids` [T] and `hidden_states`
[T, L, H] (read through hs_connectors' FileTransfer). Its ArrowDataset skips a row
whose `token_ids` differ from the row's `input_ids`; it takes the last layer as the
verifier's final state, before the final norm (it applies the verifier's norm itself):
exactly our id N. Rows follow the sample index; the draft vocabulary (vocab/) and a
record of the source (export.json) go along. fp8 extractions (output.dtype=fp8) stay
fp8: the files keep `hidden_states_scales` as hs_connectors' fp8 backend reads them
(`--hidden-states-backend fp8`, which dequantizes; export.json says `fp8`).

speculators 0.9.0 needs transformers >= 5, so it cannot share the vLLM 0.16
environment: `make venv-train` builds its own (requirements/train*.lock).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from eagle3_extract.layout import (EXPORT_JSON, SCALES_KEY, STATES_KEY, VOCAB_DIR, Storage, links,
                     remove_temps, temp_path, verified_files)
from eagle3_extract.manifest import write_json_atomic
from eagle3_extract.quant import states_tensor
from eagle3_extract.check.run_dir import DamagedSample, complete_run, missing_samples, read_checked
from eagle3_extract.extract.writer import save_safetensors

FORMAT = "speculators-0.9"
HS_DIR = "hidden_states"  # the trainer's folder of files (speculators 0.9.0)


class ExportError(Exception):
    pass


def export(root: Path, out: Path) -> dict:
    """Write OUT from the extraction in ROOT (complete, verified); return export.json.

    Nothing is taken on trust: every sample the manifests say was written must be there,
    and each file's bytes are checked against the checksum written with them as they are
    read (one pass: the bytes loaded are the bytes hashed), its run id against the run's.
    """
    t0 = time.perf_counter()
    root, out = Path(os.path.abspath(root)), Path(os.path.abspath(out))
    if out == root or out.is_relative_to(root) or root.is_relative_to(out):
        raise ExportError(f"{out} is inside {root} (or holds it): give an OUT outside the "
                          "extraction, whose directory must hold only what the job wrote")
    try:
        manifests, why = complete_run(root)
    except PermissionError as e:
        raise ExportError(f"{e.filename or root}: cannot be read ({e.strerror}); fix its "
                          "permissions") from e
    if why:
        raise ExportError(f"{root}: {why}; finish the extraction first (eagle3-status)")
    fmt = str(manifests[0].config["output"]["format"])
    fp8 = Storage.from_output(manifests[0].config["output"]).fp8
    run_id = manifests[0].run_id
    linked = links(root)
    if linked:
        raise ExportError(f"{root}: {len(linked)} symbolic links where the run's files belong "
                          f"(e.g. {linked[0]}); rerun the extraction to replace them")
    whole, damaged = verified_files(root, fmt)
    if damaged:
        raise ExportError(f"{root}: {len(damaged)} sample files are not whole (e.g. index "
                          f"{next(iter(damaged))}); rerun the extraction to redo them")
    gone = missing_samples(manifests, whole)
    if gone:
        raise ExportError(f"{root}: {gone}; rerun the extraction with the same config to "
                          "redo the missing files (eagle3-validate names them)")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: give a new directory")
    import datasets

    datasets.disable_progress_bars()  # our one summary line is the progress

    remove_temps(out)  # an earlier export's, killed
    tmp = temp_path(out)  # a directory, renamed into place when whole
    (tmp / HS_DIR).mkdir(parents=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": [], "sample_index": []}
    unchecked = 0
    for row, index in enumerate(sorted(whole)):
        try:
            tensors, _, had = read_checked(Path(whole[index].path), index, fmt, run_id)
        except DamagedSample as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ExportError(f"{e}; delete it and rerun the extraction with the same "
                              "config to redo it, then export again") from None
        unchecked += not had
        states = states_tensor(tensors[STATES_KEY])
        ids = tensors["input_ids"].to(torch.int64)
        extra = {SCALES_KEY: tensors[SCALES_KEY]} if fp8 else {}
        if fp8 != (SCALES_KEY in tensors):
            raise ExportError(f"{whole[index].path}: {'no' if fp8 else ''} scales, the "
                              f"manifest says output.dtype={'fp8' if fp8 else 'model'}")
        save_safetensors({"token_ids": ids, STATES_KEY: states.contiguous(), **extra},
                         tmp / HS_DIR / f"hs_{row}.safetensors", metadata={
                             "sample_index": str(index),
                             "layer_ids": json.dumps(manifests[0].layer_ids)})
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(tensors["loss_mask"].to(torch.int64).tolist())
        rows["seq_len"].append(len(ids))
        rows["sample_index"].append(index)
    ds = datasets.Dataset.from_dict(rows)
    ds.set_format("torch")
    ds.save_to_disk(str(tmp))
    if (root / VOCAB_DIR).is_dir():
        shutil.copytree(root / VOCAB_DIR, tmp / VOCAB_DIR)
    record = {"format": FORMAT, "source": str(root), "run_id": manifests[0].run_id,
              "layer_ids": manifests[0].layer_ids, "rows": len(whole),
              "hidden_states": "fp8" if fp8 else manifests[0].model["dtype"],
              "last_layer": "id N, before the final norm (the trainer applies the verifier's)",
              "checked": {"files": len(whole), "without_checksum": unchecked},
              "seconds": round(time.perf_counter() - t0, 3)}
    write_json_atomic(tmp / EXPORT_JSON, record)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-export", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="an extraction's output.dir")
    ap.add_argument("out", type=Path, help="a new directory for the speculators 0.9.0 layout")
    args = ap.parse_args(argv)
    try:
        rec = export(args.dir.resolve(), args.out.resolve())
    except ExportError as e:
        print(f"eagle3-export: error: {e}", file=sys.stderr)
        return 2
    except PermissionError as e:
        print(f"eagle3-export: error: {e.filename or args.dir}: cannot be read or written "
              f"({e.strerror}); fix its permissions", file=sys.stderr)
        return 2
    print(f"eagle3-export: {rec['rows']} rows in {args.out} ({FORMAT}) in {rec['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
