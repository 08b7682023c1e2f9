"""Preflight and resume cost at the headline job's scale, per shard count; no model weights.

    .venv/bin/python bench/throughput/scale.py [--rows 1000000] [--files 100000] [--shards 1,8,64]
                                    [--out /var/tmp/eagle3-scale]

Writes `--rows` short synthetic chat conversations (seeded words, no two alike) to one
.jsonl file and `--files` finished sample files of this run into one output directory
(whole safetensors files, as a resumed job finds them; the first `--files` sample
indices). Then, for each shard count n, runs shard 0 of n as `eagle3-extract
dry_run=true` (everything before the engine start: config, rows read, this shard's rows
rendered and tokenized, the resume scan of this shard's files, disk, lock), the tokenized
cache off, and measures its wall, its preflight, and its peak RSS (wait4: the job and its
tokenizer workers, largest); and times the resume scan alone (layout.verified_files of
shard 0 of n) in this process. Prints a cost-growth table: cost per shard against its
share, and the constant (what every shard pays: interpreter and imports, reading the
rows' offsets, listing the directory) fitted from the table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
from eagle3_extract.layout import RUN_JSON  # noqa: E402  (after the path above)

WORDS = ("the model reads every token of a long conversation and the draft learns to "
         "guess what comes next from three layers of its hidden state while vLLM serves "
         "requests on eight cards with tensor parallel prefill and a writer keeps up "
         "with the disk").split()


def write_rows(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(rows):
            q = " ".join(rng.choices(WORDS, k=rng.randint(6, 14)))
            a = " ".join(rng.choices(WORDS, k=rng.randint(10, 24)))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"[{i}] {q}?"},
                                             {"role": "assistant", "content": a + "."}]})
                    + "\n")
    os.replace(tmp, path)


def job_args(dataset: Path, out: Path, index: int, count: int) -> list[str]:
    return [sys.executable, "-m", "eagle3_extract.cli", "engine=hf", "dataset=local",
            f"dataset.path={dataset}", f"output.dir={out}", f"shard.index={index}",
            f"shard.count={count}", "dry_run=true", "hydra.run.dir=" + str(out / ".hydra-run"),
            # the disk check is real: one layer stored as fp8 keeps 1M rows' need (~11 GB)
            # under what a development machine has free
            "layers=explicit", "layers.ids=[8]", "output=fp8"]


def run_job(args: list[str]) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "EAGLE3_TOKENIZED_CACHE": "off"}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        err.seek(0)
        out += err.read()[-2000:]
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out[-3000:]}")
    m = re.search(r"preflight ok in ([\d.]+)s: (\d+) samples for this shard \((\d+) tokens\), "
                  r"(\d+) already done", out)
    if not m:
        raise SystemExit(f"no preflight line in:\n{out[-3000:]}")
    return {"wall_s": round(wall, 2), "preflight_s": float(m.group(1)),
            "samples": int(m.group(2)), "tokens": int(m.group(3)), "done": int(m.group(4)),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}  # Linux: KiB


def write_files(out: Path, files: int) -> None:
    """`files` whole sample files of this run (the run.json the first dry run wrote)."""
    import torch

    from eagle3_extract.layout import sample_path
    from eagle3_extract.types import Sample
    from eagle3_extract.extract.writer import write_sample

    run_id = json.loads((out / RUN_JSON).read_text())["run_id"]
    first = sample_path(out, 0, 10000, "safetensors")
    ids = list(range(1, 33))
    write_sample(first, Sample(0, ids, [0] * 16 + [1] * 16), torch.zeros(32, 4, 64,
                 dtype=torch.bfloat16), "safetensors", [2, 4, 5, 8], run_id)
    body = first.read_bytes()  # the same bytes under every name: the scan reads headers
    for i in range(1, files):
        p = sample_path(out, i, 10000, "safetensors")
        if i % 10000 == 0 or not p.parent.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(body)


def scan_seconds(out: Path, count: int) -> tuple[float, int]:
    from eagle3_extract.dataset.batching import shard_owner
    from eagle3_extract.layout import verified_files

    t0 = time.perf_counter()
    good, bad = verified_files(out, "safetensors", shard_owner(0, count))
    return time.perf_counter() - t0, len(good) + len(bad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--shards", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 8, 64])
    ap.add_argument("--out", type=Path, default=Path("/var/tmp/eagle3-scale"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / f"chats-{args.rows}.jsonl"
    t = time.perf_counter()
    if not dataset.exists():
        write_rows(dataset, args.rows)
    print(f"dataset {dataset} ({dataset.stat().st_size / 1e6:.0f} MB, {args.rows:,} rows) "
          f"in {time.perf_counter() - t:.0f} s", flush=True)
    out = args.out / "run"
    if not (out / RUN_JSON).exists():  # the run identity, from a dry run of a small shard
        run_job(job_args(dataset, out, 0, max(args.shards)))
    existing = sum(1 for _ in out.rglob("*.safetensors"))
    if existing < args.files:
        t = time.perf_counter()
        write_files(out, args.files)
        print(f"{args.files:,} sample files in {time.perf_counter() - t:.0f} s", flush=True)
    rows = []
    for n in args.shards:
        r = run_job(job_args(dataset, out, 0, n))
        r["scan_s"], r["scanned"] = scan_seconds(out, n)
        r["scan_s"] = round(r["scan_s"], 3)
        r["shards"], r["share"] = n, 1 / n
        rows.append(r)
        print(f"shard 0 of {n:3d}: wall {r['wall_s']:7.1f} s  preflight {r['preflight_s']:7.1f} s  "
              f"resume scan {r['scan_s']:6.2f} s ({r['scanned']:,} files)  "
              f"peak RSS {r['peak_rss_mb']:7.0f} MB  {r['samples']:,} samples "
              f"{r['tokens']:,} tokens, {r['done']:,} done", flush=True)
    # cost = constant + per_share * share, least squares over the shard counts
    xs, ys = [r["share"] for r in rows], [r["wall_s"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    const = my - slope * mx
    print(f"fit: wall = {const:.1f} s + {slope:.1f} s x share "
          f"(a whole dataset's share costs {slope:.1f} s over the constant)")
    (args.out / "scale.json").write_text(json.dumps(
        {"rows": args.rows, "files": args.files, "cores": len(os.sched_getaffinity(0)),
         "runs": rows, "fit": {"constant_s": const, "per_share_s": slope}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
