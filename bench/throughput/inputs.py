"""What a benchmark run prefills: the model, the engine and the batches.

Everything is built the way the extraction job builds it (inspect_model,
build_engine, plan_batches), so the figures are those of the production path.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import torch

from eagle3_extract.dataset.batching import iter_batches, plan_batches
from eagle3_extract.dataset.samples import Tokenized, build_dataset, load_tokenizer
from eagle3_extract.models.tiny import TINY_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_SET = ROOT / "src/eagle3_extract/assets/sample/conversations.jsonl"


def write_rows(path: Path, rows: int) -> None:
    """`rows` chat rows from the sample set, each made unique by its index (a dataset of
    any size whose rows tokenize as real chat does)."""
    base = [json.loads(line) for line in SAMPLE_SET.read_text().splitlines() if line.strip()]
    with open(path, "w") as f:
        for i in range(rows):
            row = json.loads(json.dumps(base[i % len(base)]))
            turns = row.get("conversations") or row.get("messages")
            key = "value" if "conversations" in row else "content"
            turns[0][key] = f"[{i}] {turns[0][key]}"
            f.write(json.dumps(row) + "\n")


def model_dir(spec: str) -> tuple[str, str | None]:
    """`--model` -> (model.path, model.tiny_config).

    A tiny arch name builds the embedded tiny model; a bare config.json is
    copied into a directory of its own (vLLM and transformers read a directory).
    """
    if spec in TINY_CONFIGS:
        return "tiny", spec
    path = Path(spec)
    if path.is_dir():
        return str(path), None
    if path.is_file():
        raw = path.read_bytes()
        out = Path(tempfile.gettempdir()) / f"eagle3-bench-{hashlib.sha256(raw).hexdigest()[:12]}"
        out.mkdir(exist_ok=True)
        (out / "config.json").write_bytes(raw)
        return str(out), None
    raise SystemExit(f"--model {spec!r}: not a tiny arch ({sorted(TINY_CONFIGS)}), "
                     "a model directory or a config.json")


def job_config(args: Any, path: str, tiny: str | None, max_model_len: int) -> SimpleNamespace:
    """The subset of the job's config that build_engine reads (as tests/conftest.py builds it)."""
    model = SimpleNamespace(
        path=path, tiny_config=tiny, tokenizer=None, trust_remote_code=args.trust_remote_code,
        dtype=args.dtype, max_model_len=max_model_len, tensor_parallel_size=1,
        pipeline_parallel_size=1, gpu_memory_utilization=args.gpu_memory_utilization,
        quantization=None, load_format="dummy" if args.load_format == "dummy" else None,
    )
    engine = SimpleNamespace(
        name=args.engine, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
        host_buffers=args.host_buffers, enforce_eager=True, device=args.device,
        distributed_executor_backend=args.executor, vllm_args=args.vllm_args,
    )
    output = SimpleNamespace(dtype=getattr(args, "output_dtype", "model"),
                             fp8_scale=getattr(args, "fp8_scale", "token"))
    return SimpleNamespace(model=model, engine=engine, output=output)


@contextmanager
def random_hf_weights(device: str):
    """HFEngine loads a checkpoint; for `--load-format dummy` build from config instead.

    The model is created directly on the target device so an 8B model's random
    init takes seconds on a GPU instead of minutes on the CPU.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"

    def from_config(path, torch_dtype=None, trust_remote_code=False, **_):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device(device):
            return AutoModelForCausalLM.from_config(
                config, torch_dtype=torch_dtype, trust_remote_code=trust_remote_code)

    with mock.patch.object(AutoModelForCausalLM, "from_pretrained", from_config):
        yield


def synthetic(lengths: list[int], vocab: int, seed: int) -> Tokenized:
    """Random token ids (no tokenizer needed), every token in the loss mask."""
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    return Tokenized(
        indices=np.arange(len(lengths), dtype=np.int64), offsets=offsets,
        ids=rng.integers(10, max(11, vocab - 1), size=total, dtype=np.int64),
        mask=np.ones(total, dtype=np.uint8), truncated=np.zeros(len(lengths), dtype=bool),
        report={"tokens": total},
    )


def parse_lengths(args: Any) -> list[int] | None:
    """`--synthetic NxL` (N samples of L tokens), `--lengths A:B` (N uniform in [A, B]) or
    `--mix TOKENS` (bench/throughput/mix.py's chat and reasoning lengths, adding up to TOKENS)."""
    if getattr(args, "mix", None):
        import length_mix as mix

        return mix.lengths(args.mix, args.seed)
    if args.synthetic:
        n, _, length = args.synthetic.lower().partition("x")
        return [int(length)] * int(n)
    if args.lengths:
        lo, _, hi = args.lengths.partition(":")
        rng = np.random.default_rng(args.seed)
        return rng.integers(int(lo), int(hi or lo) + 1, size=args.samples).tolist()
    return None


def load_data(args: Any, info: Any, config: dict, max_length: int) -> tuple[Tokenized, dict]:
    """The samples and where they came from; the sample set is cut to `max_length`."""
    lengths = parse_lengths(args)
    if lengths is not None:
        vocab = int((config.get("text_config") or config).get("vocab_size", 32000))
        data = synthetic(lengths, vocab, args.seed)
        return data, {"source": "synthetic",
                      "spec": args.synthetic or args.lengths or f"mix:{args.mix}",
                      "seed": args.seed}
    try:
        tok = load_tokenizer(info.tokenizer_path, args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - re-raised with the fix
        raise SystemExit(f"{e}\nno tokenizer for the sample set: use --synthetic NxL or "
                         "--lengths A:B") from e
    ds = SimpleNamespace(path=str(SAMPLE_SET), format="jsonl", split="train", hub_config=None,
                         data_files=None, max_samples=args.samples, seed=args.seed,
                         shuffle=True, overlong="truncate")
    data = build_dataset(ds, tok, max_length=max_length)
    return data, {"source": "sample", "path": str(SAMPLE_SET.relative_to(ROOT)),
                  "tokenizer": info.tokenizer_path, "skipped": data.report.get("skipped_total")}


def make_batches(data: Tokenized, budget: int, max_num_seqs: int) -> list:
    """Length-sorted batches under the token budget, as the job plans them."""
    return list(iter_batches(data, plan_batches(data.lengths, budget, max_num_seqs)))


def clear_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
