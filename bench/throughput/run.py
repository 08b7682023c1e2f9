"""Throughput benchmark: what capture, host copies and writing cost on top of prefill.

One engine instance, the same batches, three phases, each warmed up and then
repeated R times, interleaved (1, 2, 3, 1, 2, 3, ...), medians reported:
  (1) prefill       engine.prefill (capture off): the baseline
  (2) extract_host  engine.extract + release: capture and the device-to-host copy
  (3) extract_disk  engine.extract into the real Writer (threads overlap the next batch)
plus the disk's raw fsync'd write bandwidth for the same files, so the target
"(3) >= 95% of min((1), disk bandwidth / bytes per token)" can be judged.

    .venv/bin/python bench/throughput/run.py                       # no arguments: --smoke (CPU, < 2 min)
    python3 bench/throughput/run.py --model bench/throughput/configs/llama3_8b.json --load-format dummy \
        --synthetic 128x2048 --token-budget 32768 --out docs/bench/x.json   # on a GPU

Ratios between phases on one engine are the figures to quote; absolute tok/s
depends on the vLLM build (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import inputs
import phases
import report
import torch

from eagle3_extract.engine import inspect_model, resolve_layer_ids
from eagle3_extract.engine.start import build_engine
from eagle3_extract.layout import STATES_KEY, Storage
from eagle3_extract.models.config import read_config

ROOT = Path(__file__).resolve().parents[2]
TARGET = 0.95
# A CPU smoke run (make bench, tests/test_bench.py): tiny Llama, 12 conversations of the
# sample set cut to 256 tokens, several batches so the writer overlaps the engine, the
# in-process executor (starts in seconds). Real runs name their own data and executor.
SMOKE = ["--samples", "12", "--max-length", "256", "--token-budget", "1024",
         "--executor", "uni", "--repeats", "2"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--model", default="llama",
                   help="tiny arch (llama, qwen3, deepseek_v3), model dir or config.json")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights, no checkpoint (vLLM load_format=dummy; HF "
                        "from_config)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="layer ids, comma-separated (default: 2, N//2, N-3, N)")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--synthetic", metavar="NxL", help="N random sequences of L tokens")
    data.add_argument("--lengths", metavar="A:B",
                      help="--samples random sequences, lengths uniform in [A, B]")
    data.add_argument("--mix", type=int, metavar="TOKENS",
                      help="random sequences of bench/throughput/mix.py's chat and reasoning lengths, "
                           "TOKENS in all")
    p.add_argument("--samples", type=int, default=64,
                   help="count for --lengths; at most this many of the sample set")
    p.add_argument("--max-length", type=int, default=None,
                   help="cut sample-set conversations to this many tokens (default: "
                        "--max-model-len - 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--host-buffers", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="raised to the longest synthetic sequence + 1")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--executor", default="mp", help="vLLM executor: mp (the job's), uni")
    p.add_argument("--vllm-args", type=json.loads, default=None,
                   help='JSON dict merged into EngineArgs, e.g. \'{"attention_config": '
                        '{"backend": "TRITON_ATTN"}}\'')
    p.add_argument("--device", default="auto", help="HF engine device")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--warmup", type=int, default=1, help="batches run untimed before phases")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phases", default="prefill,extract_host,extract_disk",
                   help="which of prefill, extract_host, extract_disk run (comma-separated; "
                        "--more-writer-threads adds its own)")
    p.add_argument("--no-disk-test", action="store_true",
                   help="skip the raw-write test after the phases (a long run's bytes)")
    p.add_argument("--writer-threads", type=int, default=2)
    p.add_argument("--more-writer-threads", type=lambda s: [int(x) for x in s.split(",")],
                   default=[], metavar="N,M",
                   help="also run phase (3) with these writer thread counts, same engine, "
                        "interleaved (phases extract_disk_wN)")
    p.add_argument("--output-dtype", choices=("model", "fp8"), default="model",
                   help="how the states are stored (output.dtype): fp8 halves the bytes")
    p.add_argument("--fp8-scale", choices=("token", "token_layer"), default="token")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON figures (default outputs/bench/<engine>-<time>.json)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "outputs/bench/files",
                   help="where phase (3) and the disk test write (emptied before and after)")
    p.add_argument("--peak-tflops", type=float, default=790.0,
                   help="peak dense TFLOP/s for MFU (790: H200 bf16 measured on random data)")
    p.add_argument("--breakdown", action="store_true",
                   help="also: driver time per vLLM RPC, the Writer alone, D2H bandwidth")
    p.add_argument("--keep-files", action="store_true",
                   help="keep the last phase (3) run's files under --out-dir/extract")
    p.add_argument("--smoke", action="store_true", help=f"prepend {' '.join(SMOKE)}")
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or "--smoke" in argv:
        argv = SMOKE + [a for a in argv if a != "--smoke"]
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats >= 1 and --warmup >= 0")
    if not {"prefill", "extract_disk"} <= set(args.phases.split(",")) or not set(
            args.phases.split(",")) <= {"prefill", "extract_host", "extract_disk"}:
        p.error("--phases: prefill and extract_disk, and extract_host if wanted")
    return args


def cpu_env() -> None:
    """vLLM's CPU build: a small KV cache, MLA off (unsupported on CPU). Before vLLM loads."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_MLA_DISABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def median_rate(amount: float, seconds: list[float]) -> float | None:
    return statistics.median(amount / s for s in seconds) if seconds else None


def phase_figures(tokens: int, runs: list[tuple[float, dict]]) -> dict:
    seconds = [s for s, _ in runs]
    out = {"tok_s": median_rate(tokens, seconds), "seconds": seconds,
           "tok_s_all": [tokens / s for s in seconds]}
    extra = runs[-1][1]
    if extra.get("bytes"):
        out["bytes"], out["files"] = extra["bytes"], extra["files"]
        out["bytes_per_s"] = median_rate(out["bytes"], seconds)
    steady = [x.get("steady_tok_s") for _, x in runs]
    if all(steady):
        out["steady_tok_s"] = statistics.median(steady)
        out["steady_tok_s_all"] = steady
    split = [{k: v for k, v in x.items() if k.endswith("_s") and k != "steady_tok_s"}
             for _, x in runs]
    if split[0]:
        out["split_s"] = split
    return out


def check_files(root: Path, batches: list, layers: int, hidden: int) -> dict:
    """Every sample has its file, and one opens as [T, L, H] (what the test relies on)."""
    from safetensors import safe_open

    files = phases.list_files(root)
    want = sum(len(b.samples) for b in batches)
    if len(files) != want:
        raise RuntimeError(f"{len(files)} files under {root}, expected {want}")
    with safe_open(str(files[0]), "pt") as f:
        shape = list(f.get_slice(STATES_KEY).get_shape())
    if shape[1:] != [layers, hidden]:
        raise RuntimeError(f"{files[0]}: hidden_states {shape}, expected [T, {layers}, {hidden}]")
    return {"count": len(files), "sizes": [p.stat().st_size for p in files],
            "example": str(files[0].relative_to(root)), "example_shape": shape}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cpu_env()
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    path, tiny = inputs.model_dir(args.model)
    info = inspect_model(inputs.job_config(args, path, tiny, args.max_model_len).model)
    config, _ = read_config(info.path)
    shape = report.model_shape(config)
    layer_ids = resolve_layer_ids(args.layers, info.num_layers)
    data, data_desc = inputs.load_data(args, info, config,
                                       args.max_length or args.max_model_len - 1)
    lengths = [int(n) for n in data.lengths]
    max_model_len = max(args.max_model_len, max(lengths) + 1)
    cfg = inputs.job_config(args, path, tiny, max_model_len)

    storage = Storage.from_output(cfg.output)  # as the job's preflight makes it
    t0 = time.perf_counter()
    if args.engine == "hf" and args.load_format == "dummy":
        with inputs.random_hf_weights(args.device):
            engine = build_engine(cfg.engine, cfg.model, info, layer_ids, storage)
    else:
        engine = build_engine(cfg.engine, cfg.model, info, layer_ids, storage)
    start_s = time.perf_counter() - t0
    budget = min(args.token_budget, getattr(engine, "max_batch_tokens", None) or 1 << 62)
    batches = inputs.make_batches(data, budget, args.max_num_seqs)
    ntok = phases.tokens(batches)
    files_root, raw_root = args.out_dir / "extract", args.out_dir / "raw"
    threads, pending = args.writer_threads, args.host_buffers

    def run_disk(bs, n=threads):
        inputs.clear_dir(files_root)  # untimed: a fresh directory each run
        return phases.timed(lambda: phases.extract_disk(engine, bs, files_root, n, pending))

    runs = {
        "prefill": lambda bs: phases.timed(lambda: phases.prefill(engine, bs)),
        "extract_host": lambda bs: phases.timed(lambda: phases.extract_host(engine, bs)),
        **{f"extract_disk_w{n}": lambda bs, n=n: run_disk(bs, n)
           for n in args.more_writer_threads},
        "extract_disk": run_disk,  # last: its files are the ones checked and kept
    }
    wanted = set(args.phases.split(",")) | {f"extract_disk_w{n}" for n in args.more_writer_threads}
    runs = {k: fn for k, fn in runs.items() if k in wanted}
    results: dict[str, list] = {k: [] for k in runs}
    breakdown: dict = {}
    try:
        warm = batches[: args.warmup]
        for fn in runs.values():
            if warm:
                fn(warm)
        for _ in range(args.repeats):
            for name, fn in runs.items():
                results[name].append(fn(batches))
                print(f"  {name:13s} {ntok / results[name][-1][0]:12,.0f} tok/s", flush=True)
        files = check_files(files_root, batches, len(layer_ids), info.hidden_size) \
            if "extract_disk" in runs else {"sizes": []}
        if not args.keep_files:  # checked: the raw-write test below needs their space
            shutil.rmtree(files_root, ignore_errors=True)
        raw_root.mkdir(parents=True, exist_ok=True)
        if args.no_disk_test or not files["sizes"]:
            disk_runs = []
        elif shutil.disk_usage(raw_root).free < 1.05 * sum(files["sizes"]):
            print(f"  disk: {raw_root} has less room than the {sum(files['sizes']) / 1e9:.1f} GB "
                  "the raw-write test writes: skipped (--keep-files off gives it theirs)")
            disk_runs = []
        else:
            disk_runs = [phases.disk_bandwidth(raw_root, files["sizes"], threads)["seconds"]
                         for _ in range(args.repeats)]
        if args.breakdown:
            breakdown = run_breakdown(engine, batches, args.out_dir / "writer", threads,
                                      pending, args.repeats)
    finally:
        engine.close()
        for d in ([] if args.keep_files else [files_root]) + [raw_root, args.out_dir / "writer"]:
            shutil.rmtree(d, ignore_errors=True)
    if args.breakdown:
        breakdown["d2h"] = phases.d2h_bandwidth()

    figures = {k: phase_figures(ntok, v) for k, v in results.items()}
    disk_bytes = sum(files["sizes"])
    disk = {"path": str(raw_root), "bytes": disk_bytes, "files": len(files["sizes"]),
            "threads": threads, "seconds": disk_runs,
            "bytes_per_s": median_rate(disk_bytes, disk_runs)}
    raw_per_token = engine.storage.bytes_per_token(len(layer_ids), info.hidden_size,
                                                   info.dtype)
    file_per_token = figures["extract_disk"]["bytes"] / ntok
    prefill_tok_s = figures["prefill"]["tok_s"]
    disk_tok_s = (disk["bytes_per_s"] / file_per_token if disk["bytes_per_s"]
                  else float("inf"))  # the raw-write test was skipped
    bound = min(prefill_tok_s, disk_tok_s)
    wall = figures["extract_disk"]["tok_s"]
    # The target judges the pipeline's steady rate (a job runs thousands of batches);
    # with a single batch there is none, and the wall figure stands in.
    steady = figures["extract_disk"].get("steady_tok_s")
    e2e = steady or wall
    flops = report.flops_per_token(
        report.decoder_params(info.path, args.trust_remote_code), shape, lengths)
    if flops["per_token"]:
        flops["peak_tflops"] = args.peak_tflops
        flops["mfu"] = {k: v["tok_s"] * flops["per_token"] / (args.peak_tflops * 1e12)
                        for k, v in figures.items()}
    result = {
        "schema": 1,
        "date": started,
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": report.machine(args.out_dir, gpu=args.engine == "hf" or args.breakdown),
        "engine": {"name": args.engine, "start_s": start_s, "executor": args.executor,
                   "token_budget": budget, "max_num_seqs": args.max_num_seqs,
                   "host_buffers": args.host_buffers, "max_model_len": max_model_len,
                   "writer_threads": threads, "vllm_args": args.vllm_args,
                   "describe": getattr(engine, "describe", None)},
        "model": {"path": args.model, "resolved": info.path, "load_format": args.load_format,
                  "dtype": str(info.dtype).removeprefix("torch."), **shape},
        "layer_ids": layer_ids,
        "output": {"dtype": args.output_dtype, "fp8_scale": args.fp8_scale},
        "data": {**data_desc, "samples": len(lengths), "tokens": ntok, "batches": len(batches),
                 "max_batch_tokens": max(b.num_tokens for b in batches),
                 "length_min": min(lengths), "length_mean": statistics.fmean(lengths),
                 "length_max": max(lengths), "warmup_batches": len(batches[: args.warmup]),
                 "repeats": args.repeats},
        "bytes_per_token": {"states": raw_per_token, "file": file_per_token},
        "phases": figures,
        "files": {k: v for k, v in files.items() if k != "sizes"},
        "disk": disk,
        "ratios": {"extract_host_vs_prefill": (figures["extract_host"]["tok_s"] / prefill_tok_s
                                               if "extract_host" in figures else None),
                   "extract_disk_vs_prefill": wall / prefill_tok_s,
                   "extract_disk_steady_vs_prefill": e2e / prefill_tok_s,
                   **{f"extract_disk_w{n}_vs_prefill":
                      figures[f"extract_disk_w{n}"]["tok_s"] / prefill_tok_s
                      for n in args.more_writer_threads}},
        "target": {"threshold": TARGET, "measure": "steady" if steady else "wall",
                   "disk_tok_s": disk_tok_s, "bound_tok_s": bound,
                   "bound_by": "prefill" if prefill_tok_s <= disk_tok_s else "disk",
                   "extract_disk_vs_bound": e2e / bound, "met": e2e >= TARGET * bound,
                   "met_vs_prefill": e2e >= TARGET * prefill_tok_s,
                   "met_wall": wall >= TARGET * bound},
        "flops": flops,
        "breakdown": breakdown or None,
    }
    out = args.out or ROOT / f"outputs/bench/{args.engine}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print_summary(result, out)
    return result


def run_breakdown(engine, batches, root, threads, pending, repeats) -> dict:
    """Where the time goes: driver seconds per RPC in (1) and (2), and the Writer alone."""
    ntok = phases.tokens(batches)
    out: dict = {}
    for name, fn in (("prefill", phases.prefill), ("extract_host", phases.extract_host)):
        if hasattr(engine, "executor"):
            with phases.rpc_timer(engine) as rpcs:
                seconds, _ = phases.timed(lambda: fn(engine, batches))
            out[f"{name}_rpc_s"] = {"total_s": seconds, **dict(rpcs)}
    held = phases.hold_states(engine, batches)
    runs = []
    for _ in range(repeats):
        inputs.clear_dir(root)
        runs.append(phases.timed(lambda: phases.writer_only(engine, held, root, threads,
                                                            pending)))
    out["writer_only"] = phase_figures(ntok, runs)
    return out


def print_summary(r: dict, out: Path) -> None:
    m, d, ph, t = r["model"], r["data"], r["phases"], r["target"]
    gpu = (r["machine"]["gpu"] or {}).get("name") or r["machine"]["cpu"]
    print(f"\n{r['engine']['name']} | {m['architecture']} L={m['num_layers']} "
          f"H={m['hidden_size']} {m['dtype']} ({m['load_format']}) | layers {r['layer_ids']} | "
          f"stored {r['output']['dtype']} ({r['bytes_per_token']['states']:,} B/token) | "
          f"{gpu}")
    print(f"data: {d['source']} {d.get('spec') or 'set'} {d['samples']} samples, {d['tokens']:,} "
          f"tokens in {d['batches']} batches (<= {d['max_batch_tokens']:,} tok), "
          f"{d['repeats']} repeats, median")
    mfu = (r["flops"].get("mfu") or {})
    for name, label in (("prefill", "(1) prefill"), ("extract_host", "(2) extract->host"),
                        ("extract_disk", "(3) extract->disk")):
        if name not in ph:
            continue
        extra = f"  {ph[name]['bytes_per_s'] / 1e6:8,.0f} MB/s written" if name == (
            "extract_disk") else ""
        util = f"  MFU {mfu[name]:6.2%}" if name in mfu else ""
        print(f"  {label:18s} {ph[name]['tok_s']:12,.0f} tok/s{util}{extra}")
    if "steady_tok_s" in ph["extract_disk"]:
        print(f"  (3) steady state     {ph['extract_disk']['steady_tok_s']:12,.0f} tok/s "
              "(between the first and the last batch landing on disk)")
    ratios = r["ratios"]
    for n in r["args"].get("more_writer_threads") or []:
        f = ph[f"extract_disk_w{n}"]
        print(f"  (3) with {n} writers {f['tok_s']:12,.0f} tok/s  {f['bytes_per_s'] / 1e6:8,.0f} "
              f"MB/s written  (3)/(1) = {ratios[f'extract_disk_w{n}_vs_prefill']:.3f} wall")
    host = ratios["extract_host_vs_prefill"]
    print(("" if host is None else f"  (2)/(1) = {host:.3f}   ") +
          f"  (3)/(1) = {ratios['extract_disk_vs_prefill']:.3f} wall, "
          f"{ratios['extract_disk_steady_vs_prefill']:.3f} steady")
    if r["disk"]["bytes_per_s"]:
        print(f"  disk raw fsync write {r['disk']['bytes_per_s'] / 1e6:,.0f} MB/s -> "
              f"{t['disk_tok_s']:,.0f} tok/s at {r['bytes_per_token']['file']:,.0f} B/token")
    verdict = "MET" if t["met"] else "MISSED"
    print(f"  target (3) >= {t['threshold']:.0%} of min((1), disk) = {t['bound_tok_s']:,.0f} "
          f"tok/s ({t['bound_by']}-bound), {t['measure']}: {verdict} "
          f"({t['extract_disk_vs_bound']:.3f})")
    if r["breakdown"]:
        b = r["breakdown"]
        w = b["writer_only"]
        print(f"  breakdown: writer alone {w['tok_s']:,.0f} tok/s "
              f"({w['bytes_per_s'] / 1e6:,.0f} MB/s); D2H {b.get('d2h')}")
        for key in ("prefill_rpc_s", "extract_host_rpc_s"):
            if key in b:
                print(f"    {key}: " + ", ".join(f"{k} {v:.3f}" for k, v in b[key].items()))
    split = ph["extract_disk"]["split_s"][-1]
    print("  (3) last run: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()))
    print(f"figures: {out}")


if __name__ == "__main__":
    main()
