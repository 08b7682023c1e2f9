"""Regeneration throughput: eagle3-regenerate's loop vs vLLM's own `LLM.generate`.

One `LLM`, built the way the job builds it (regenerate.build_llm), serves both
paths in one run: the same prompts (one answer per sample, so `LLM.generate` can
take them all in one call) with the same `SamplingParams` objects, greedy, runs
alternating. The baseline is timed around its `generate` call only (its prompts
are rendered and tokenized beforehand); ours includes everything the job does per
sample (render, tokenize, decode, reasoning split, the fidelity check). Prints
generated tokens/s of both and their ratio (docs/BENCHMARKS.md).

  python bench/throughput/regenerate.py --model smollm2 --samples 64 --max-tokens 128
  python bench/throughput/regenerate.py --model bench/throughput/configs/llama3_8b.json --load-format dummy \
      --tokenizer DIR   # any model dir or config.json; a tokenizer with a chat template
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
SAMPLE_SET = ROOT / "src/eagle3_extract/assets/sample/conversations.jsonl"


def model_dir(spec: str, tokenizer: str | None, vocab: int | None) -> str:
    """--model -> a directory with config and tokenizer (a config.json is copied into one,
    with the tokenizer's files beside it and, with --vocab, its vocab_size set)."""
    from eagle3_extract.models.smollm2 import build_smollm2
    from eagle3_extract.models.tiny import TINY_CONFIGS, build_tiny_model

    if spec == "smollm2":
        return str(build_smollm2())
    if spec in TINY_CONFIGS:
        return str(build_tiny_model(spec))
    path = Path(spec)
    if path.is_dir():
        return str(path)
    raw = json.loads(path.read_text())
    if vocab:
        raw["vocab_size"] = vocab
    out = Path("/tmp") / f"eagle3-regen-bench-{path.stem}-{raw.get('vocab_size')}"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw))
    src = Path(tokenizer or build_smollm2())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return str(out)


def null(value: int | None) -> str:
    return "null" if value is None else str(value)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a tiny arch, a dir, a config")
    p.add_argument("--tokenizer", default=None, help="for a bare config.json (default SmolLM2)")
    p.add_argument("--vocab", type=int, default=None, help="set a bare config's vocab_size")
    p.add_argument("--load-format", default=None, help="vLLM load_format, e.g. dummy")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    # default: vLLM's own (the job's default too, conf/regenerate.yaml)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--enforce-eager", choices=("auto", "true", "false"), default="auto",
                   help="auto: CUDA graphs where the build has them (the job's default)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--executor", default="mp")
    p.add_argument("--vllm-args", type=json.loads, default=None)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _measure(llm, tok, cfg, rows: list, args: argparse.Namespace, window: int
             ) -> tuple[dict, int, dict]:
    """Both paths over the same prompts and SamplingParams, alternating, after a warm-up."""
    from eagle3_extract.dataset.messages import to_messages
    from eagle3_extract.regenerate.generation import Pending, Regenerator, plan_turns

    max_model_len = int(cfg.model.max_model_len)
    regen = Regenerator(llm, tok, cfg.generate, max_model_len, None, window=window)
    prompts, params = [], []
    for i, row in enumerate(rows):
        msgs, targets = plan_turns(to_messages(row, need_assistant=False), "last")
        p = Pending(i, i, msgs, targets)
        ids = regen.prompt(p)
        prompts.append({"prompt_token_ids": ids})
        params.append(regen.params(p, len(ids)))

    def baseline() -> tuple[float, int, list]:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        ids = [list(o.outputs[0].token_ids) for o in outs]
        return dt, sum(map(len, ids)), ids

    def ours() -> tuple[float, int, list]:
        recs: list[dict] = []
        regen.reset_counts()
        t = time.perf_counter()
        regen.run(((i, i, r) for i, r in enumerate(rows)), recs.append)
        dt = time.perf_counter() - t
        recs.sort(key=lambda r: r["index"])
        return dt, regen.generated_tokens, [r["turns"][-1]["token_ids"] for r in recs]

    baseline(), ours()  # warm-up of both: allocations, and kernels JIT-compiled per shape
    runs: dict[str, list[float]] = {"llm_generate": [], "eagle3_regenerate": []}
    differing = 0  # samples whose tokens differ between the paths, most in one pair
    for r in range(args.repeats):  # b o, o b, ...: neither path always runs second
        pair = (baseline, ours) if r % 2 == 0 else (ours, baseline)
        got = {f.__name__: f() for f in pair}
        b, o = got["baseline"], got["ours"]
        runs["llm_generate"].append(b[1] / b[0])
        runs["eagle3_regenerate"].append(o[1] / o[0])
        differing = max(differing, sum(x != y for x, y in zip(b[2], o[2], strict=True)))
        print(f"pair {r}: LLM.generate {b[1] / b[0]:.1f} tok/s, eagle3-regenerate "
              f"{o[1] / o[0]:.1f} tok/s", flush=True)
    return runs, differing, regen.concurrency()


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from eagle3_extract.config import conf_dir
    from eagle3_extract.dataset.render import Renderer
    from eagle3_extract.models.config import inspect_model
    from eagle3_extract.regenerate.generation import build_llm, close_llm, engine_limits

    path = model_dir(args.model, args.tokenizer, args.vocab)
    over = [f"model.path={path}", f"model.max_model_len={args.max_model_len}",
            f"model.gpu_memory_utilization={args.gpu_memory_utilization}",
            f"engine.max_num_seqs={null(args.max_num_seqs)}",
            f"engine.token_budget={null(args.token_budget)}",
            f"engine.enforce_eager={'null' if args.enforce_eager == 'auto' else args.enforce_eager}",
            f"engine.distributed_executor_backend={args.executor}", "generate.turns=last",
            f"generate.max_tokens={args.max_tokens}", "generate.on_max_tokens=keep"]
    if args.load_format:
        over.append(f"model.load_format={args.load_format}")
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        cfg = compose("regenerate", overrides=over)
    if args.vllm_args:
        cfg.engine.vllm_args = args.vllm_args
    rows = [json.loads(line) for line in SAMPLE_SET.read_text().splitlines() if line.strip()]
    rows = [rows[i % len(rows)] for i in range(args.samples)]
    info = inspect_model(cfg.model)
    tok = AutoTokenizer.from_pretrained(info.tokenizer_path)
    Renderer(tok)  # no chat template: fail before the engine starts
    t0 = time.perf_counter()
    llm = build_llm(cfg.engine, cfg.model, info)
    start_s = time.perf_counter() - t0
    limits = engine_limits(llm)  # what vLLM resolved our null keys to
    try:
        runs, differing, concurrency = _measure(llm, tok, cfg, rows, args,
                                           2 * limits["max_num_seqs"])
    finally:
        close_llm(llm)
    result = {
        "model": args.model, "samples": args.samples, "max_tokens": args.max_tokens,
        "engine": limits, "concurrency_last_run": concurrency,
        "engine_start_s": round(start_s, 1),
        "generated_tok_s": {k: round(statistics.median(v), 1) for k, v in runs.items()},
        "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        # on the CPU build every sample's tokens match; on a GPU, greedy bf16 decoding is
        # not batch-invariant (the paths batch requests differently, near-ties flip)
        "same_tokens": differing == 0, "samples_differing": differing,
    }
    result["ratio"] = round(result["generated_tok_s"]["eagle3_regenerate"]
                            / result["generated_tok_s"]["llm_generate"], 3)
    print(json.dumps(result, indent=2))
    print(f"eagle3-regenerate / LLM.generate generated tok/s: {result['ratio']} "
          f"(samples whose tokens differ: {differing} of {args.samples})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
