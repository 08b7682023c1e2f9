"""`eagle3-regenerate`: the target writes the answers its drafter will learn to predict.

A drafter learns the target's distribution, so its training answers should be the
target's own: a reasoning model's thinking block included, which no public chat
dataset has. This step runs before extraction and writes a dataset that
`eagle3-extract dataset=local dataset.path=<dir>/conversations.jsonl` takes as it is.

Generation is vLLM 0.16's own `LLM` engine, stepped by us so that a conversation's
next turn enters the running batch the moment its previous turn ends (continuous
batching across conversations and turns, not one round per turn). Prompts are the
chat template's render of the history with the generation prompt, the same render
extraction uses; each request has its own seed, so the answers do not depend on
batching, sharding or resume.

What a sample becomes is recorded in part files (`parts/`, one per chunk of sample
indices, written whole or not at all): a rerun redoes only missing or damaged
chunks. When every chunk of every shard is there, `conversations.jsonl` and
`manifest.json` are assembled from them. Turns the target did not write (a tool
call from the data, a leading greeting, the history in turns=last) get `weight: 0`,
so extraction's loss mask covers exactly what the target generated; whether the
template renders the generated ids back unchanged is checked per turn ("drift").
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, PreflightError, validate_regenerate  # noqa: F401
from .data import (
    GENERATED_KEY,
    REGENERATED_TURNS,
    SKIP_REASONS,
    WEIGHT_KEY,
    Renderer,
    SkipRow,
    load_tokenizer,
    read_nonempty,
    seeded_order,
    to_messages,
)
from .errors import Interrupted, raise_interrupted
from .lock import ShardLock
from .layout import RUN_JSON
from .manifest import (
    chat_template_sha256,
    check_run_json,
    clean_json_temps,
    dataset_identity,
    package_versions,
    write_json_atomic,
    write_run_json,
)

log = logging.getLogger("eagle3_extract")

CONVERSATIONS = "conversations.jsonl"
MANIFEST = "manifest.json"
PARTS = "parts"
KIND = "eagle3-regenerate"
# What happened to a sample (the manifest counts each, zeros included).
OUTCOMES = (
    "finished",  # every generated turn ended by the model (stop token)
    "max_tokens",  # a turn was cut by generate.max_tokens (kept or dropped per on_max_tokens)
    "empty",  # a turn with no text: the conversation cannot continue on it
    "error",  # the engine aborted a request, or the template failed on generated text
    "overlong",  # a prompt leaves no room to generate within model.max_model_len
    "nothing_to_generate",  # no assistant turn the model could write (e.g. ends in a tool call)
    *(r for r in SKIP_REASONS if r not in ("overlong", "no_loss_tokens", "mask_alignment",
                                           "no_assistant_turn")),
)
WRITTEN = ("finished", "max_tokens")
PROGRESS_EVERY_S = 30.0


# --- which turns the model writes ---------------------------------------------------------


def plan_turns(messages: list[dict[str, Any]], mode: str) -> tuple[list[dict[str, Any]], list[int]]:
    """The messages the model sees, and the positions of the turns it writes, in order.

    A conversation that ends with a user or tool message gets a new assistant turn at
    the end. Assistant turns with tool calls stay as they are (their tool results
    follow them); so does an opening greeting (there is nothing to answer). With
    mode "last", only the final turn is written and the history is kept.
    """
    msgs = [dict(m) for m in messages]
    if msgs[-1]["role"] != "assistant":
        msgs.append({"role": "assistant", "content": ""})
    writable = [i for i, m in enumerate(msgs)
                if i > 0 and m["role"] == "assistant" and not m.get("tool_calls")]
    if mode == "last":
        writable = [i for i in writable if i == len(msgs) - 1]
    for i, m in enumerate(msgs):  # turns the target does not write are context only
        if m["role"] == "assistant" and i not in writable:
            m[WEIGHT_KEY] = 0
    return msgs, writable


def request_seed(seed: int, index: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# --- one sample in flight -----------------------------------------------------------------


@dataclass
class Pending:
    index: int
    row: int
    messages: list[dict[str, Any]]
    targets: list[int]
    # per submitted turn: position (in messages), prompt_tokens, then generated_tokens,
    # finish, token_ids (what the model generated, its end-of-turn token included), fidelity
    turns: list[dict[str, Any]] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Where the next turn to submit goes."""
        return self.targets[len(self.turns)]

    def end(self, status: str, detail: str = "") -> dict[str, Any]:
        """The sample's record: its outcome and what each turn generated so far."""
        return {**outcome(self.index, self.row, status, detail), "turns": self.turns}


class Regenerator:
    """Drives one vLLM `LLM` over many conversations; knows nothing of files."""

    def __init__(self, llm: Any, tokenizer: Any, gen: Any, max_model_len: int,
                 reasoning_parser: str | None = None, window: int = 128):
        self.llm, self.engine = llm, llm.llm_engine
        self.tok, self.renderer = tokenizer, Renderer(tokenizer)
        self.gen, self.max_model_len, self.window = gen, int(max_model_len), int(window)
        self.parser = make_reasoning_parser(reasoning_parser, tokenizer)
        self.prompt_tokens = self.generated_tokens = 0

    # prompts and params
    def prompt(self, p: Pending) -> list[int]:
        text = self.renderer.render(p.messages[: p.position], True)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def params(self, p: Pending, prompt_len: int) -> Any:
        from vllm import SamplingParams

        g = self.gen
        return SamplingParams(
            temperature=float(g.temperature), top_p=float(g.top_p),
            max_tokens=min(int(g.max_tokens), self.max_model_len - prompt_len),
            seed=request_seed(int(g.seed), p.index, len(p.turns)),
            detokenize=False,  # decoded once per turn, by us
        )

    def start(self, index: int, row_no: int, row: Any) -> Pending | dict[str, Any]:
        try:  # a prompt-only row is fine: plan_turns adds the answer
            msgs, targets = plan_turns(to_messages(row, need_assistant=False),
                                       str(self.gen.turns))
        except SkipRow as e:
            return outcome(index, row_no, e.reason, e.detail)
        if not targets:
            return outcome(index, row_no, "nothing_to_generate")
        return Pending(index, row_no, msgs, targets)

    def prepare(self, p: Pending) -> list[int] | dict[str, Any]:
        """The prompt of p's next turn, or the sample's outcome if it has none."""
        try:
            prompt = self.prompt(p)
        except Exception as e:  # noqa: BLE001 - a template may raise anything
            return p.end("template_error", f"{type(e).__name__}: {e}")
        if len(prompt) >= self.max_model_len:
            return p.end("overlong", f"prompt of turn {len(p.turns)}: {len(prompt)} tokens")
        return prompt

    def add(self, p: Pending, prompt: list[int], inflight: dict[str, Pending]
            ) -> dict[str, Any] | None:
        """Add p's next turn to the engine; the sample's outcome if vLLM refuses it."""
        rid = f"{p.index}-{len(p.turns)}"
        try:
            self.engine.add_request(rid, {"prompt_token_ids": prompt},
                                    self.params(p, len(prompt)))
        except ValueError as e:  # vLLM's input checks refuse this one request
            return p.end("error", f"turn {len(p.turns)}: {e}")
        p.turns.append({"position": p.position, "prompt_tokens": len(prompt)})
        inflight[rid] = p
        return None

    def submit(self, p: Pending, inflight: dict[str, Pending]) -> dict[str, Any] | None:
        prompt = self.prepare(p)
        return prompt if isinstance(prompt, dict) else self.add(p, prompt, inflight)

    def split(self, text: str) -> tuple[str | None, str]:
        if self.parser is None:
            return None, text
        reasoning, content = self.parser.extract_reasoning(text, _REQUEST)
        return reasoning, content or ""

    def advance(self, p: Pending, out: Any) -> dict[str, Any] | None:
        """Record the finished turn; the sample's outcome if it is done."""
        done = out.outputs[0]
        ids = list(done.token_ids)
        turn = p.turns[-1]
        finish = "stop" if done.finish_reason == "stop" else str(done.finish_reason)
        turn.update(generated_tokens=len(ids), finish=finish, token_ids=ids)
        self.prompt_tokens += turn["prompt_tokens"]
        self.generated_tokens += len(ids)
        if finish not in ("stop", "length"):
            return p.end("error", f"turn {len(p.turns) - 1}: {finish}")
        # Ended by the EOS token (stop_reason None) or a stop token id: that last id is the
        # end of turn, which the template writes itself; the text is what comes before it.
        ended_by_token = finish == "stop" and not isinstance(done.stop_reason, str)
        body = ids[:-1] if ended_by_token and ids else ids
        reasoning, content = self.split(self.tok.decode(body, skip_special_tokens=False))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning and self.gen.reasoning == "keep":
            message["reasoning_content"] = reasoning
        if not content.strip() and "reasoning_content" not in message:
            return p.end("empty", f"turn {len(p.turns) - 1}")
        p.messages[p.targets[len(p.turns) - 1]] = message
        if finish == "length" and self.gen.on_max_tokens == "drop":
            return p.end("max_tokens", f"turn {len(p.turns) - 1}")
        if len(p.turns) < len(p.targets):
            return None
        return self.finish(p)

    def finish(self, p: Pending) -> dict[str, Any]:
        """The sample's record, with how each turn comes back through the template as
        extraction will render it (data.Renderer.splice_generated)."""
        generated = {t["position"]: (t["token_ids"], t["finish"] == "length") for t in p.turns}
        try:
            _, _, notes = self.renderer.tokenize_with_notes(p.messages, generated)
        except SkipRow as e:  # extraction would skip it the same way
            return p.end("error", f"render: {e}")
        for turn, kind in zip(p.turns, [n for n in notes if n in REGENERATED_TURNS]):
            turn["fidelity"] = kind
        rec = p.end("max_tokens" if any(t["finish"] == "length" for t in p.turns)
                    else "finished")
        rec["messages"] = p.messages
        return rec

    def run(self, items: Iterable[tuple[int, int, Any]],
            on_done: Callable[[dict[str, Any]], None]) -> None:
        """Generate every sample of `items` ((index, row number, row)); `on_done` gets
        each sample's record as soon as it is complete (in completion order)."""
        inflight: dict[str, Pending] = {}
        source: Iterator = iter(items)

        def feed() -> None:
            # Render every new prompt first, then add them together: the engine's first
            # steps then see the whole window, as with LLM.generate, not a trickle.
            ready: list[tuple[Pending, list[int]]] = []
            while len(inflight) + len(ready) < self.window:
                item = next(source, None)
                if item is None:
                    break
                p = self.start(*item)
                prompt = p if isinstance(p, dict) else self.prepare(p)
                if isinstance(prompt, dict):
                    on_done(prompt)
                else:
                    ready.append((p, prompt))
            for p, prompt in ready:
                rec = self.add(p, prompt, inflight)
                if rec is not None:
                    on_done(rec)

        try:
            feed()
            while inflight:
                for out in self.engine.step():
                    if not out.finished:
                        continue
                    p = inflight.pop(out.request_id)
                    rec = self.advance(p, out)
                    if rec is None:
                        rec = self.submit(p, inflight)
                    if rec is not None:
                        on_done(rec)
                feed()
        except BaseException:
            if inflight:
                self.engine.abort_request(list(inflight))
            raise


def outcome(index: int, row: int, status: str, detail: str = "") -> dict[str, Any]:
    assert status in OUTCOMES, status
    rec: dict[str, Any] = {"index": index, "row": row, "status": status}
    if detail:
        rec["detail"] = detail[:200]
    return rec


class _Request:
    """What vLLM's reasoning parsers read of a chat request: nothing, for these parsers."""

    skip_special_tokens = False
    chat_template_kwargs: dict[str, Any] = {}


_REQUEST = _Request()


def make_reasoning_parser(name: str | None, tokenizer: Any) -> Any:
    """vLLM's own reasoning parser by name (as `vllm serve --reasoning-parser` takes it)."""
    if not name:
        return None
    from vllm.reasoning import ReasoningParserManager

    try:
        cls = ReasoningParserManager.get_reasoning_parser(str(name))
    except KeyError as e:
        known = sorted(ReasoningParserManager.list_registered()) if hasattr(
            ReasoningParserManager, "list_registered") else []
        raise ConfigError(f"model.reasoning_parser={name!r} is not a vLLM 0.16 reasoning "
                          f"parser{'; one of ' + str(known) if known else ''}") from e
    try:
        return cls(tokenizer)
    except Exception as e:  # noqa: BLE001 - e.g. the tokenizer lacks <think> tokens
        raise PreflightError(f"model.reasoning_parser={name!r} does not fit the tokenizer "
                             f"({type(e).__name__}: {e}); set model.reasoning_parser=null or "
                             "the parser of this model's format") from e


# --- part files: the unit of resume -------------------------------------------------------


def part_name(chunk: int, shard: tuple[int, int]) -> str:
    return f"chunk-{chunk:06d}.shard-{shard[0]}-of-{shard[1]}.jsonl"


def chunk_indices(chunk: int, size: int, n: int, shard: tuple[int, int]) -> list[int]:
    """This shard's sample indices in chunk `chunk` (indices chunk*size .. +size-1)."""
    lo, hi = chunk * size, min((chunk + 1) * size, n)
    return [i for i in range(lo, hi) if i % shard[1] == shard[0]]


def read_part(path: Path, want: list[int]) -> list[dict[str, Any]] | None:
    """The records of a part file if it holds exactly the samples `want`, else None."""
    try:
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    if sorted(r.get("index", -1) for r in recs) != want:
        return None
    if any(r.get("status") not in OUTCOMES for r in recs):
        return None
    return recs


def write_part(path: Path, recs: list[dict[str, Any]]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        for r in sorted(recs, key=lambda r: r["index"]):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def clean_temps(root: Path, shard: tuple[int, int]) -> int:
    """Temps a killed run left: this shard's part files (its lock makes them ours), and
    the shared outputs' once they are old (another shard may be writing them now)."""
    n = 0
    for t in (root / PARTS).glob(f".chunk-*.shard-{shard[0]}-of-{shard[1]}.jsonl.tmp-*"):
        t.unlink(missing_ok=True)
        n += 1
    return n + clean_json_temps(root, [], shared=(RUN_JSON, MANIFEST, CONVERSATIONS))


# --- the job ------------------------------------------------------------------------------


@dataclass
class Plan:
    cfg: Any
    root: Path
    info: Any
    tokenizer: Any
    rows: list[Any]
    order: list[int]
    ident: dict[str, Any]
    todo: list[int]  # chunks to generate (this shard)
    done: dict[int, list[dict[str, Any]]]  # chunk -> records found whole
    redone: int  # part files that were not whole: removed, redone
    lock: ShardLock | None = None

    @property
    def shard(self) -> tuple[int, int]:
        return int(self.cfg.shard.index), int(self.cfg.shard.count)

    @property
    def size(self) -> int:
        return int(self.cfg.generate.chunk_samples)

    def chunks(self) -> list[int]:
        n = len(self.order)
        return [c for c in range(-(-n // self.size))
                if chunk_indices(c, self.size, n, self.shard)]


def vocab_sha256(tokenizer: Any) -> str:
    """The token id assignment: what the generated ids in conversations.jsonl mean."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def check_regenerated_input(dataset_path: str, tokenizer: Any, info: Any) -> None:
    """Extraction's check of a dataset eagle3-regenerate wrote (its manifest.json beside
    it): the generated ids it carries must be ids of this tokenizer. Another model with
    the same tokenizer is allowed (a quantized twin), and said."""
    path = Path(str(dataset_path)).expanduser()
    manifest = path.parent / MANIFEST
    if path.name != CONVERSATIONS or not manifest.is_file():
        return
    try:
        m = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise PreflightError(f"{manifest}: unreadable ({e}); rerun eagle3-regenerate there") \
            from e
    if m.get("kind") != KIND:
        return
    model = m.get("identity", {}).get("model", {})
    want = model.get("vocab_sha256")
    if want and want != vocab_sha256(tokenizer):
        raise PreflightError(
            f"dataset.path={str(path)!r} was regenerated by {model.get('path')!r} with another "
            "tokenizer: its generated token ids do not fit this model's; regenerate with this "
            "model (eagle3-regenerate model=...) or extract from the source dataset")
    if model.get("config_sha256") != info.config_sha256:
        log.info("dataset regenerated by %s (same tokenizer, another model config)",
                 model.get("path"))


def identity(cfg: Any, info: Any, template_sha256: str, vocab: str) -> dict[str, Any]:
    """What determines the generated data (resume only into the same identity)."""
    g = cfg.generate
    ident = {
        "kind": KIND,
        "model": {"path": str(cfg.model.path), "config_sha256": info.config_sha256,
                  "tiny_config": cfg.model.tiny_config if str(cfg.model.path) == "tiny"
                  else None,
                  "dtype": str(info.dtype).removeprefix("torch."),
                  "quantization": cfg.model.quantization, "tokenizer": cfg.model.tokenizer,
                  "chat_template_sha256": template_sha256, "vocab_sha256": vocab,
                  "max_model_len": int(cfg.model.max_model_len),
                  "reasoning_parser": cfg.model.reasoning_parser},
        "dataset": dataset_identity(cfg.dataset, int(cfg.model.max_model_len)),
        "generate": {k: g[k] for k in ("temperature", "top_p", "max_tokens", "seed", "turns",
                                       "reasoning", "on_max_tokens", "chunk_samples")},
    }
    ident["run_id"] = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return ident


def preflight(cfg: Any) -> Plan:
    from .engine import inspect_model
    from .engine.vllm import check_vllm_args
    from .job import _check_writable, _resolve

    validate_regenerate(cfg)
    _resolve(cfg)
    root = Path(os.path.abspath(os.path.expanduser(str(cfg.output.dir))))
    _check_writable(root)
    rows = read_nonempty(cfg.dataset)
    check_vllm_args(cfg, fixed={})
    try:
        info = inspect_model(cfg.model)
    except (ValueError, OSError) as e:
        raise PreflightError(f"model.path={str(cfg.model.path)!r}: {e}") from e
    if info.max_positions and int(cfg.model.max_model_len) > info.max_positions:
        raise PreflightError(
            f"model.max_model_len={cfg.model.max_model_len} is above the model's limit of "
            f"{info.max_positions} tokens; set model.max_model_len <= {info.max_positions}")
    tokenizer = load_tokenizer(info.tokenizer_path, bool(cfg.model.trust_remote_code))
    Renderer(tokenizer)  # raises if there is no chat template
    make_reasoning_parser(cfg.model.reasoning_parser, tokenizer)  # a wrong name fails here
    ident = identity(cfg, info, chat_template_sha256(tokenizer), vocab_sha256(tokenizer))
    resuming = check_run_json(root, ident)
    shard = (int(cfg.shard.index), int(cfg.shard.count))
    lock = ShardLock.acquire(root, shard)
    try:
        parts = root / PARTS
        parts.mkdir(exist_ok=True)
        other = [p.name for p in parts.glob("chunk-*.jsonl")
                 if not p.name.endswith(f"-of-{shard[1]}.jsonl")]
        if other:
            raise PreflightError(
                f"output.dir={str(root)!r} has part files of another shard.count ({other[0]}); "
                f"rerun with that shard.count or set output.dir to a new directory")
        if not resuming:
            write_run_json(root, ident)
    except BaseException:
        lock.release()
        raise
    order = seeded_order(len(rows), int(cfg.dataset.seed), bool(cfg.dataset.shuffle),
                         cfg.dataset.max_samples)
    return Plan(cfg, root, info, tokenizer, rows, order, ident, [], {}, 0, lock)


def scan_parts(plan: Plan) -> None:
    """Which chunks of this shard are done: part files are read, not trusted by name; one
    that is not whole is removed and its chunk redone."""
    parts = plan.root / PARTS
    clean_temps(plan.root, plan.shard)
    for c in plan.chunks():
        path = parts / part_name(c, plan.shard)
        recs = read_part(path, chunk_indices(c, plan.size, len(plan.order), plan.shard)) \
            if path.exists() else None
        if recs is not None:
            plan.done[c] = recs
            continue
        if path.exists():
            path.unlink()
            plan.redone += 1
        plan.todo.append(c)


def close_llm(llm: Any) -> None:
    """Stop the engine core process now, not at interpreter exit (where it logs errors)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - best effort, the job's result stands
        log.debug("engine shutdown: %s", e)


def build_llm(cfg: Any, info: Any) -> Any:
    """vLLM's own `LLM`, with our model and engine keys and the user's vllm_args."""
    from vllm import LLM

    from .engine.vllm import check_vllm_args, model_args, quiet_known_warnings, size_cpu_kv_cache

    quiet_known_warnings()
    args = model_args(cfg, info)
    args.update(check_vllm_args(cfg, fixed={}))
    size_cpu_kv_cache(info, args["max_num_batched_tokens"] + 2 * args["max_model_len"])
    return LLM(**args)


class Progress:
    """One line every PROGRESS_EVERY_S: samples, generated tok/s, ETA (log, not a bar: the
    rate is what matters and it is steady)."""

    def __init__(self, total: int, every_s: float = PROGRESS_EVERY_S):
        self.total, self.done, self.every = total, 0, every_s
        self.t0 = self.last = time.perf_counter()

    def tick(self, regen: Regenerator) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last < self.every and self.done < self.total:
            return
        self.last = now
        rate = regen.generated_tokens / max(now - self.t0, 1e-9)
        per = (now - self.t0) / self.done
        eta = per * (self.total - self.done)
        log.info("regenerate: %d/%d samples, %.1f generated tok/s, ETA %s", self.done,
                 self.total, rate, time.strftime("%H:%M:%S", time.gmtime(eta)))


def run(cfg: Any) -> dict[str, Any] | None:
    """One regeneration job (one shard); the final manifest once every shard is done."""
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, raise_interrupted) if main else None
    try:
        plan = preflight(cfg)
        try:
            return _run(plan)
        finally:
            if plan.lock is not None:
                plan.lock.release()
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)


def _run(plan: Plan) -> dict[str, Any] | None:
    scan_parts(plan)
    cfg, shard, n = plan.cfg, plan.shard, len(plan.order)
    mine = sum(len(chunk_indices(c, plan.size, n, shard)) for c in plan.chunks())
    todo = sum(len(chunk_indices(c, plan.size, n, shard)) for c in plan.todo)
    log.info("preflight ok: %d samples for this shard, %d to generate (%d from before, %d part "
             "files redone)", mine, todo, mine - todo, plan.redone)
    if bool(cfg.dry_run):
        log.info("dry_run: nothing generated")
        return None
    t0 = time.perf_counter()
    stats = {"prompt_tokens": 0, "generated_tokens": 0, "seconds": 0.0}
    if plan.todo:
        llm = build_llm(cfg, plan.info)
        t_gen = time.perf_counter()
        try:
            regen = Regenerator(llm, plan.tokenizer, cfg.generate, int(cfg.model.max_model_len),
                                cfg.model.reasoning_parser,
                                window=2 * int(cfg.engine.max_num_seqs))
        except BaseException:
            close_llm(llm)  # else its engine process keeps this one from exiting
            raise
        pending: dict[int, list[dict[str, Any]]] = {c: [] for c in plan.todo}
        want = {c: len(chunk_indices(c, plan.size, n, shard)) for c in plan.todo}
        progress = Progress(todo)

        def on_done(rec: dict[str, Any]) -> None:
            c = rec["index"] // plan.size
            pending[c].append(rec)
            progress.tick(regen)
            if len(pending[c]) == want[c]:
                write_part(plan.root / PARTS / part_name(c, shard), pending.pop(c))

        items = ((i, plan.order[i], plan.rows[plan.order[i]])
                 for c in plan.todo for i in chunk_indices(c, plan.size, n, shard))
        try:
            regen.run(items, on_done)
            stats = {"prompt_tokens": regen.prompt_tokens,
                     "generated_tokens": regen.generated_tokens,
                     "seconds": time.perf_counter() - t_gen}
        except (KeyboardInterrupt, Interrupted):
            log.error("interrupted: finished chunks are kept; rerun the same command to resume")
            raise
        finally:
            close_llm(llm)
        assert not pending, f"chunks left unwritten: {sorted(pending)}"
    log.info("shard %d/%d done: %d generated tokens in %.1fs (%.1f tok/s)", *shard,
             stats["generated_tokens"], stats["seconds"],
             stats["generated_tokens"] / max(stats["seconds"], 1e-9))
    write_json_atomic(plan.root / PARTS / f"stats.shard-{shard[0]}-of-{shard[1]}.json",
                      {"run_id": plan.ident["run_id"], **stats,
                       "wall_s": time.perf_counter() - t0})
    return assemble(plan)


def assemble(plan: Plan) -> dict[str, Any] | None:
    """conversations.jsonl + manifest.json from the part files of every shard, once all
    are there (None while another shard is still running)."""
    n, count = len(plan.order), plan.shard[1]
    parts = plan.root / PARTS
    records: list[dict[str, Any]] = []
    for s in range(count):
        shard = (s, count)
        for c in range(-(-n // plan.size)):
            want = chunk_indices(c, plan.size, n, shard)
            if not want:
                continue
            recs = read_part(parts / part_name(c, shard), want)
            if recs is None:
                log.info("shard %d/%d: its part files are not all there yet; the last shard "
                         "to finish writes %s", s, count, CONVERSATIONS)
                return None
            records += recs
    records.sort(key=lambda r: r["index"])
    outcomes = Counter({k: 0 for k in OUTCOMES})
    fidelity = {**{k: 0 for k in REGENERATED_TURNS}, "template_drift_examples": []}
    tokens = {"generated": 0, "prompt": 0, "turns": 0}
    tmp = plan.root / f".{CONVERSATIONS}.tmp-{os.getpid()}"
    keep_cut = str(plan.cfg.generate.on_max_tokens) == "keep"
    with open(tmp, "w") as f:
        for r in records:
            outcomes[r["status"]] += 1
            for t in r.get("turns", []):
                tokens["generated"] += t.get("generated_tokens", 0)
                tokens["prompt"] += t.get("prompt_tokens", 0)
                tokens["turns"] += 1
            if r["status"] not in WRITTEN or (r["status"] == "max_tokens" and not keep_cut):
                continue
            for k, t in enumerate(r["turns"]):
                fidelity[t["fidelity"]] += 1
                if t["fidelity"] == "template_drift" and \
                        len(fidelity["template_drift_examples"]) < 20:
                    fidelity["template_drift_examples"].append({"index": r["index"], "turn": k})
            meta = {"index": r["index"], "row": r["row"], "turns": r["turns"]}
            f.write(json.dumps({"messages": r["messages"], GENERATED_KEY: meta},
                               ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, plan.root / CONVERSATIONS)
    written = sum(1 for r in records if r["status"] == "finished"
                  or (r["status"] == "max_tokens" and keep_cut))
    stats = [json.loads(p.read_text()) for p in sorted(parts.glob("stats.shard-*.json"))]
    manifest = {
        "kind": KIND,
        "status": "complete",
        "run_id": plan.ident["run_id"],
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "identity": plan.ident,
        "model": {"path": str(plan.cfg.model.path), "resolved_path": plan.info.path,
                  "architecture": plan.info.architecture,
                  "config_sha256": plan.info.config_sha256},
        "config": OmegaConf.to_container(plan.cfg, resolve=True),
        "counts": {"selected": n, "written": written, "outcomes": dict(outcomes)},
        "tokens": tokens,
        # written turns by how extraction gets their ids back: exact (the template's
        # tokens are the generated ids), retokenized (same text, other ids: extraction
        # puts the generated ids back), template_drift (the template renders other text,
        # e.g. reasoning=drop or a template that drops earlier turns' reasoning: the
        # render stands)
        "fidelity": fidelity,
        "this_run": {"generated_tokens": sum(s.get("generated_tokens", 0) for s in stats),
                     "seconds": max((s.get("seconds", 0.0) for s in stats), default=0.0)},
        "produced_by": package_versions(),
        "conversations": CONVERSATIONS,
    }
    write_json_atomic(plan.root / MANIFEST, manifest)
    skipped = {k: v for k, v in outcomes.items()
               if v and (k not in WRITTEN or (k == "max_tokens" and not keep_cut))}
    log.info("done: %d of %d samples written to %s; %d generated tokens; not written: %s; "
             "turns exact/retokenized/template_drift: %d/%d/%d", written, n,
             plan.root / CONVERSATIONS, tokens["generated"], skipped or "none",
             *(fidelity[k] for k in REGENERATED_TURNS))
    return manifest


# --- command line ---------------------------------------------------------------------------


def _task(cfg: DictConfig) -> None:
    from .cli import quiet_engine_logs
    from .errors import JobError

    quiet_engine_logs(bool(cfg.verbose))
    try:
        if int(cfg.parallel.data_parallel_size) > 1:
            from . import parallel

            rc = parallel.launch_hydra_job(cfg, regenerate=True)
            if rc:
                sys.exit(rc)
            return
        from .parallel import die_with_launcher

        die_with_launcher()
        run(cfg)
    except PreflightError as e:
        log.error("preflight: %s", e)
        print(f"eagle3-regenerate: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (KeyboardInterrupt, Interrupted) as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"eagle3-regenerate: interrupted by {signal.Signals(signum).name}; rerun the "
              "same command to resume", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    except JobError as e:
        print(f"eagle3-regenerate: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def main() -> None:
    """Console script `eagle3-regenerate`."""
    from .cli import hydra_main

    hydra_main("regenerate", "eagle3-regenerate", _task)


if __name__ == "__main__":
    main()
