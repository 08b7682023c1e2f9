"""What a rerun's check of the files it finds costs: output.recheck=header vs content.

    .venv/bin/python bench/throughput/recheck.py [--files 16] [--tokens 2048] [--out /var/tmp/eagle3-recheck]

Writes `--files` sample files of the headline job's geometry (Kimi-K2.5: four states of
hidden 7,168 in bf16, 57,344 bytes a token; `--tokens` a sample) with the job's own
writer (content checksum in the metadata), then times layout.verified_files over them,
header only and with content, each from a cold page cache (as root: drop_caches) and
warm. Prints bytes a second and the projection to the headline scale (6B tokens, about
340 TB; one shard of eight), where the content check's one read of the output is paid
on every rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch

from eagle3_extract.extract.writer import save_safetensors
from eagle3_extract.layout import sample_path, verified_files

HIDDEN, STATES, HEADLINE_TOKENS = 7168, 4, 6e9


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=Path("/var/tmp/eagle3-recheck"))
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    g = torch.Generator().manual_seed(0)
    states = torch.randn(args.tokens, STATES, HIDDEN, generator=g).to(torch.bfloat16)
    for i in range(args.files):
        p = sample_path(args.out, i, 10000, "safetensors")
        p.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors({"input_ids": torch.arange(args.tokens, dtype=torch.int64),
                          "hidden_states": states}, p,
                         {"sample_index": str(i), "run_id": "bench"})
    nbytes = sum(p.stat().st_size for p in args.out.rglob("*.safetensors"))
    rows = {}
    for mode in ("header", "content"):
        for cache in ("cold", "warm"):
            cold = _drop_caches() if cache == "cold" else False
            t0 = time.perf_counter()
            good, bad = verified_files(args.out, "safetensors", run_id="bench",
                                       content=mode == "content")
            s = time.perf_counter() - t0
            assert len(good) == args.files and not bad
            rows[f"{mode}/{cache}"] = {"s": round(s, 4), "GB/s": round(nbytes / s / 1e9, 3),
                                       "cache_dropped": cold}
    headline_bytes = HEADLINE_TOKENS * STATES * HIDDEN * 2
    print(f"{args.files} files, {nbytes / 1e9:.2f} GB ({args.tokens} tokens each)")
    print("| recheck | page cache | seconds | GB/s | headline (340 TB), 1 of 8 shards |")
    print("| --- | --- | --- | --- | --- |")
    for k, r in rows.items():
        per_file = r["s"] / args.files
        files = HEADLINE_TOKENS / args.tokens / 8
        proj = per_file * files if k.startswith("header") else headline_bytes / 8 / (
            r["GB/s"] * 1e9)
        print(f"| {k.split('/')[0]} | {k.split('/')[1]} | {r['s']} | {r['GB/s']} | "
              f"{proj / 3600:.2f} h |")
    print(json.dumps({"bytes": nbytes, "files": args.files, "tokens": args.tokens, **rows}))
    shutil.rmtree(args.out, ignore_errors=True)


if __name__ == "__main__":
    main()
