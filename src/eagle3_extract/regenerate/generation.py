"""The target's answers from vLLM 0.16's own `LLM`: which turns, prompts, the step loop.

`Regenerator` drives one `LLM` over many conversations and knows nothing of files:
it steps `llm.llm_engine` itself so that a conversation's next turn joins the running
batch the moment its previous turn ends (continuous batching over conversations and
turns), renders each prompt with the chat template as extraction will, splits a
thinking block with vLLM's own reasoning parser, and records per turn the ids the
model generated. regenerate/job.py is the job around it (files, resume, manifest).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from eagle3_extract.config import ConfigError, EngineConfig, ModelConfig, PreflightError
from eagle3_extract.dataset.messages import (REGENERATED_TURNS, SKIP_REASONS, WEIGHT_KEY, SkipRow,
                                             to_messages)
from eagle3_extract.dataset.render import Renderer

log = logging.getLogger("eagle3_extract")

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
        self.reset_counts()

    def reset_counts(self) -> None:
        self.prompt_tokens = self.generated_tokens = 0
        # requests in flight at each engine step: their sum, the steps, and the steps that
        # started below the window while the source still had samples (a tail per chunk
        # or a slow feed would show here; 0 is the invariant)
        self.in_flight_sum = self.steps = self.steps_short = 0

    # prompts and params
    def prompt(self, p: Pending) -> list[int]:
        return self.renderer.prompt_ids(p.messages[: p.position])

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
        except SkipRow as e:
            return p.end(e.reason, e.detail)
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

    def concurrency(self) -> dict[str, Any]:
        return {"window": self.window, "steps": self.steps,
                "mean_in_flight": round(self.in_flight_sum / max(self.steps, 1), 1),
                "steps_short_of_window": self.steps_short}

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
        drained = False

        def feed() -> None:
            # Render every new prompt first, then add them together: the engine's first
            # steps then see the whole window, as with LLM.generate, not a trickle.
            nonlocal drained
            ready: list[tuple[Pending, list[int]]] = []
            while len(inflight) + len(ready) < self.window:
                item = next(source, None)
                if item is None:
                    drained = True
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
                self.steps += 1
                self.in_flight_sum += len(inflight)
                self.steps_short += not drained and len(inflight) < self.window
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


def close_llm(llm: Any) -> None:
    """Stop the engine core process now, not at interpreter exit (where it logs errors)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001 - best effort, the job's result stands
        log.debug("engine shutdown: %s", e)


def build_llm(engine: EngineConfig, model: ModelConfig, info: Any, verbose: bool = False) -> Any:
    """vLLM's own `LLM`, with our model and engine keys and the user's vllm_args."""
    from vllm import LLM

    from eagle3_extract.engine.worker import QUALNAME
    from eagle3_extract.engine.vllm_args import check_vllm_args, model_args, quiet_known_warnings, size_cpu_kv_cache

    quiet_known_warnings()
    args = {k: v for k, v in model_args(engine, model, info, verbose).items()
            if v is not None}  # None: vLLM's
    args.update(check_vllm_args(engine, fixed={}))
    # the CPU build's KV cache as before this default changed (8,192 tokens a step assumed):
    # vLLM's scheduler admits what fits, and a laptop keeps its memory
    size_cpu_kv_cache(info, args.get("max_num_batched_tokens", 8192) + 2 * args["max_model_len"])
    ours = args.setdefault("worker_extension_cls", QUALNAME) == QUALNAME
    llm = LLM(**args)
    if ours:  # bf16 linears in float32 where the CPU build lacks oneDNN (engine/cpu_gemm.py)
        llm.collective_rpc("cpu_gemm_upcast")
    return llm


def engine_limits(llm: Any) -> dict[str, Any]:
    """What vLLM resolved the batch limits to (our null keys are its defaults)."""
    c = llm.llm_engine.vllm_config
    return {"max_num_seqs": int(c.scheduler_config.max_num_seqs),
            "max_num_batched_tokens": int(c.scheduler_config.max_num_batched_tokens),
            "enforce_eager": bool(c.model_config.enforce_eager),
            "cudagraph_mode": str(c.compilation_config.cudagraph_mode)}
