"""Plain prefill of one vLLM, nothing captured: the engine's own speed, to split a gap
between our extraction (vLLM 0.16) and the peer's (vLLM 0.32) into engine and capture.

Only vLLM's public `LLM` API, so the same script runs in our env and in the peer's:
`generate(max_tokens=1)` over the token ids of a bench/throughput/peer.py run (tokens.jsonl), the
same engine limits on both, prefix caching off (no free hits), one untimed warm-up pass
over the first prompts. Prints one JSON line.

    .venv/bin/python bench/throughput/plain_prefill.py --model DIR --tokens run/tokens.jsonl
    .venv-train/bin/python bench/throughput/plain_prefill.py --model DIR --tokens run/tokens.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True, type=Path)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=64)
    a = p.parse_args()
    import vllm
    from vllm import LLM, SamplingParams

    prompts = [json.loads(line)["input_ids"] for line in a.tokens.read_text().splitlines()
               if line]
    llm = LLM(model=a.model, dtype=a.dtype, max_model_len=a.max_model_len, enforce_eager=True,
              max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
              enable_prefix_caching=False, skip_tokenizer_init=True)
    params = SamplingParams(max_tokens=1, detokenize=False)

    def run(ids: list[list[int]]) -> float:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        return time.perf_counter() - t

    run(prompts[:8])
    seconds = run(prompts)
    tokens = sum(map(len, prompts))
    print(json.dumps({"vllm": vllm.__version__, "tokens": tokens, "seconds": round(seconds, 3),
                      "tokens_per_s": round(tokens / seconds, 1)}))


if __name__ == "__main__":
    main()
