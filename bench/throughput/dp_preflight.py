"""Preflight + tokenization cost of data parallelism: DP=N vs DP=1, same dataset, one run.

    python bench/throughput/dp_preflight.py --rows 100000 --dp 4 [--out /tmp/dp-bench]

Writes a .jsonl of `--rows` chat conversations (the committed sample conversations,
each varied by a row number so no two rows tokenize alike), then times
`eagle3-extract dry_run=true` (everything up to the engine start: config, dataset,
tokenizer, layer ids, disk, run identity, tokenization) with
parallel.data_parallel_size=1 and =N, and prints the ratio. With DP=N the launcher
tokenizes once and its replicas load that tokenized set; without it each replica
would read and tokenize the whole dataset again (N + 1 times in all).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from inputs import write_rows

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent / "eagle3-extract"


def timed_run(dataset: Path, out: Path, dp: int) -> float:
    cmd = [str(BIN), "engine=hf", "dataset=local", f"dataset.path={dataset}",
           f"output.dir={out}", f"parallel.data_parallel_size={dp}", "dry_run=true"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "EAGLE3_TOKENIZED_CACHE": "off"}  # each run tokenizes: that is what is timed
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("/tmp/eagle3-dp-bench"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / f"chats-{args.rows}.jsonl"
    if not dataset.exists():
        write_rows(dataset, args.rows)
    one = timed_run(dataset, args.out / "dp1", 1)
    many = timed_run(dataset, args.out / f"dp{args.dp}", args.dp)
    print(json.dumps({"rows": args.rows, "cores": len(os.sched_getaffinity(0)),
                      "dp1_s": round(one, 3), f"dp{args.dp}_s": round(many, 3),
                      "ratio": round(many / one, 3)}))


if __name__ == "__main__":
    main()
