"""Job wall with the engine loading beside tokenization vs after it, one dataset, one run.

    .venv/bin/python bench/throughput/overlap.py [--rows 6000] [--repeats 2] [--job-timeout S] [--out DIR] [OVERRIDE ...]

Writes `--rows` chat conversations (bench/throughput/dp_preflight.py's rows: the committed sample
set, each row varied so none tokenizes alike), then runs the whole `eagle3-extract` job
(tiny model, vLLM) with `engine.start_early=false` and `=true`, alternating, each with
the tokenized-set cache off (each run tokenizes). `dataset.overlong=skip` with a short
`dataset.max_length` keeps the extraction small: every row is rendered and tokenized,
the short ones are extracted. Prints each run's phases from its manifest and the ratio of
the median walls, next to what full overlap would give: max(preflight, engine start) +
extraction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from inputs import write_rows

from eagle3_extract.layout import MANIFEST_JSON



def run_job(dataset: Path, out: Path, early: bool, max_length: int, extra: list[str],
            timeout: float) -> dict:
    cmd = [sys.executable, "-m", "eagle3_extract.cli", "engine=vllm", "dataset=local", f"dataset.path={dataset}",
           "dataset.overlong=skip", f"dataset.max_length={max_length}",
           "model.max_model_len=1024", "engine.token_budget=4096",
           f"engine.start_early={str(early).lower()}", f"output.dir={out}", *extra]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "EAGLE3_TOKENIZED_CACHE": "off"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the job is killed; its watcher ends its tree
        tail = (e.stdout or b"")[-3000:], (e.stderr or b"")[-3000:]
        raise SystemExit(f"{' '.join(cmd)} ran past {timeout} s (a hang?):\n"
                         + "\n".join(t.decode(errors="replace") if isinstance(t, bytes) else t
                                      for t in tail))
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    m = json.loads((out / MANIFEST_JSON).read_text())
    return {"early": early, "wall_s": round(wall, 2), **m["timings"],
            "samples": m["counts"]["samples"], "tokens": m["tokens"]["total"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=6000)
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--job-timeout", type=float, default=900, help="seconds a job may run")
    ap.add_argument("--out", type=Path, default=Path("/tmp/eagle3-overlap-bench"))
    ap.add_argument("overrides", nargs="*", help="more eagle3-extract overrides (the GPU kit's "
                                                 "+engine.vllm_args..., model=...)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dataset = args.out / f"chats-{args.rows}.jsonl"
    if not dataset.exists():
        write_rows(dataset, args.rows)
    runs = []
    for rep in range(args.repeats):
        for early in (False, True):
            out = args.out / f"run-{rep}-{'early' if early else 'after'}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            r = run_job(dataset, out, early, args.max_length, args.overrides, args.job_timeout)
            runs.append(r)
            print(f"start_early={str(early).lower():5}  wall {r['wall_s']:6.1f} s   preflight "
                  f"{r['preflight_s']:5.1f}  engine start {r.get('engine_start_s', 0):5.1f}"
                  f" (after preflight {r.get('engine_wait_s', r.get('engine_start_s', 0)):5.1f})"
                  f"  extract {r['extract_s']:5.1f}  total {r['total_s']:5.1f}   "
                  f"{r['samples']} samples, {r['tokens']} tokens", flush=True)
    med = {e: statistics.median(r["wall_s"] for r in runs if r["early"] is e)
           for e in (False, True)}
    seq = [r for r in runs if not r["early"]]
    ideal = statistics.median(max(r["preflight_s"], r["engine_start_s"]) + r["extract_s"]
                              + (r["wall_s"] - r["preflight_s"] - r["engine_start_s"]
                                 - r["extract_s"]) for r in seq)
    print(f"median wall: after {med[False]:.1f} s, beside {med[True]:.1f} s: "
          f"beside / after = {med[True] / med[False]:.3f} "
          f"(full overlap would give {ideal:.1f} s, {ideal / med[False]:.3f})")
    (args.out / "overlap.json").write_text(json.dumps(
        {"rows": args.rows, "max_length": args.max_length, "runs": runs,
         "median_wall_s": {"after": med[False], "beside": med[True]},
         "ratio": med[True] / med[False], "full_overlap_s": ideal}, indent=1) + "\n")


if __name__ == "__main__":
    main()
