"""Dataset rows -> tokenized samples with an exact assistant loss mask.

Rows are ShareGPT-style (`conversations`: `from`/`value`) or OpenAI-style
(`messages`: `role`/`content`). Each is rendered with the tokenizer's own chat
template; the loss mask covers exactly the tokens of every assistant turn (its
content and its end-of-turn token, not the role header), found by rendering
prefixes of the conversation and mapping character spans to tokens.

A row that cannot be used is skipped and counted by reason, never raised and
never dropped silently. A sample's identity is its position in the seeded
dataset order (shuffle with `dataset.seed`, then take `dataset.max_samples`), so
resume, sharding and file names stay stable whatever rows turn out unusable.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from eagle3_extract.config import PreflightError
from eagle3_extract.dataset.rows import Malformed, read_nonempty
from eagle3_extract.types import Sample

log = logging.getLogger(__name__)

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",  # tool results (OpenAI), fed back to the model
    "function": "tool",
    "ipython": "tool",  # Llama 3.1's tool-result role
    "observation": "tool",  # glaive / ShareGPT-style tool results
}
# Assistant-turn fields chat templates render besides `content`, kept as they are.
# (`reasoning` and `thinking` are other datasets' names for `reasoning_content`.)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")
# OpenAI fine-tuning's per-message `weight`: an assistant turn with weight 0 is context,
# rendered but not in the loss mask (eagle3-regenerate marks turns the target did not write).
WEIGHT_KEY = "weight"

# Every reason a row can be skipped for (the manifest lists each, zeros included).
SKIP_REASONS = (
    "malformed_json",  # a .jsonl line that is not valid JSON
    "invalid_utf8",  # bytes that are not UTF-8 (never replaced by U+FFFD and kept)
    "bad_row",  # not an object, or no `messages` / `conversations` list
    "empty_conversation",
    "unknown_role",
    "bad_content",  # a turn whose content is not text (an image part, a number, ...)
    "no_assistant_turn",
    "template_error",  # the chat template raised on this conversation
    "mask_alignment",  # assistant spans could not be mapped to tokens exactly
    "overlong",  # longer than max_length under dataset.overlong=skip
    "no_loss_tokens",  # nothing left to train on (e.g. truncated before any assistant token)
    # message text spelling a special token where it cannot be kept as text (a slow
    # tokenizer; text the template changed so that it cannot be found in the render)
    "special_token_in_text",
)
# A used row whose message text spells one of the tokenizer's special tokens: tokenized
# as the text it is, never as the control token (report "special_token_text").
SPECIAL_TEXT = "special_token_text"


class SkipRow(Exception):
    def __init__(self, reason: str, detail: str = ""):
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def seeded_order(num_rows: int, seed: int, shuffle: bool, max_samples: int | None) -> list[int]:
    """Row number for each sample index: shuffle with `seed`, then keep `max_samples`."""
    order = list(range(num_rows))
    if shuffle:
        random.Random(seed).shuffle(order)
    return order[:max_samples] if max_samples is not None else order


# --- rows -> messages -----------------------------------------------------------------


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text only
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                raise SkipRow("bad_content", f"non-text content part {str(part)[:60]!r}")
        return "".join(parts)
    raise SkipRow("bad_content", f"content of type {type(content).__name__}")


def to_messages(row: Any, need_assistant: bool = True) -> list[dict[str, Any]]:
    """Normalise one row to chat-template messages: roles system/user/assistant/tool.

    Besides `content`, what a chat template renders is kept as it is: an assistant
    turn's `reasoning_content` (also read from `reasoning` / `thinking`) and
    `tool_calls`, a tool message's `tool_call_id` and `name`. Whether the template
    renders them is counted per row (`Renderer.tokenize_with_notes`).
    """
    if isinstance(row, Malformed):
        raise SkipRow(row.reason, f"line {row.line}: {row.error}")
    if not isinstance(row, dict):
        raise SkipRow("bad_row", f"row is a {type(row).__name__}, not an object")
    if isinstance(row.get("messages"), list):
        turns, role_key, text_key = row["messages"], "role", "content"
    elif isinstance(row.get("conversations"), list):
        turns, role_key, text_key = row["conversations"], "from", "value"
    else:
        raise SkipRow("bad_row", "no 'messages' or 'conversations' list")
    if not turns:
        raise SkipRow("empty_conversation")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise SkipRow("bad_row", f"turn is a {type(turn).__name__}")
        raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
        role = ROLES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise SkipRow("unknown_role", repr(raw_role))
        content = turn.get(text_key, turn.get("content", turn.get("value")))
        message: dict[str, Any] = {"role": role}
        if role == "assistant":
            reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k)), None)
            if reasoning is not None:
                message["reasoning_content"] = _text(reasoning)
        for key in TOOL_KEYS:
            if turn.get(key) is not None:
                message[key] = turn[key]
        if role == "assistant" and turn.get(WEIGHT_KEY) is not None:
            if turn[WEIGHT_KEY] not in (0, 1):
                raise SkipRow("bad_row", f"weight {turn[WEIGHT_KEY]!r} is not 0 or 1")
            message[WEIGHT_KEY] = int(turn[WEIGHT_KEY])
        if content is None and not message.get("tool_calls"):
            raise SkipRow("bad_content", "turn without content")
        message["content"] = "" if content is None else _text(content)
        messages.append(message)
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise SkipRow("no_assistant_turn")
    return messages


# Where eagle3-regenerate records, per row, what the model generated (regenerate/job.py).
GENERATED_KEY = "eagle3_regenerate"
# How a generated turn comes back through the chat template (Renderer.splice_generated).
REGENERATED_TURNS = ("exact", "retokenized", "template_drift")


def generated_turns(row: Any) -> dict[int, tuple[list[int], bool]] | None:
    """message position -> (generated ids, cut by max_tokens) of a regenerated row."""
    meta = row.get(GENERATED_KEY) if isinstance(row, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("turns"), list):
        return None
    out = {}
    for t in meta["turns"]:
        if isinstance(t, dict) and isinstance(t.get("token_ids"), list) and "position" in t:
            out[int(t["position"])] = ([int(i) for i in t["token_ids"]],
                                       t.get("finish") == "length")
    return out or None


def trained(message: dict[str, Any]) -> bool:
    """An assistant turn that is in the loss mask (not one marked weight 0)."""
    return message["role"] == "assistant" and message.get(WEIGHT_KEY, 1) != 0


# --- messages -> tokens + loss mask ---------------------------------------------------


def _special_tokens(tokenizer: Any) -> list[str]:
    specials = set(tokenizer.all_special_tokens)
    for tok in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(tok, "special", False):
            specials.add(str(tok))
    return sorted((s for s in specials if s), key=len, reverse=True)


class Renderer:
    """Chat template rendering and exact assistant masks for one tokenizer."""

    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise PreflightError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; "
                "set model.tokenizer to a tokenizer that has one"
            )
        self.tok = tokenizer
        self.specials = _special_tokens(tokenizer)
        self._special_re = re.compile("|".join(map(re.escape, self.specials))) \
            if self.specials else None
        self.fast = bool(getattr(tokenizer, "is_fast", False))

    def render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def as_text(self, messages: list[dict[str, Any]], full: str) -> list[tuple[int, int]]:
        """Character ranges of `full` where message text spells a special token.

        A user turn holding `<|eot_id|><|start_header_id|>assistant...` would otherwise
        tokenize as an injected assistant turn, and an answer quoting `<|eot_id|>` as an
        end of turn in its middle (scraped chat data has both). Each text that spells one
        is found in the render, in message order; one that cannot be (the template
        changed it) skips the row ("special_token_in_text").
        """
        if self._special_re is None:
            return []
        out: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(messages):
            for key in ("content", "reasoning_content"):
                text = m.get(key)
                if not isinstance(text, str) or not self._special_re.search(text):
                    continue
                text = text.strip()
                pos = full.find(text, cursor)
                if pos < 0:
                    raise SkipRow("special_token_in_text",
                                  f"turn {i} {key} spells a special token and is not in the "
                                  "render as written")
                out += [hit.span() for hit in self._special_re.finditer(full, pos, pos + len(text))]
                cursor = pos + len(text)
        if out and not self.fast:
            raise SkipRow("special_token_in_text", "a slow tokenizer cannot keep it as text")
        return out

    def encode(self, full: str, as_text: list[tuple[int, int]] = ()
               ) -> tuple[list[int], np.ndarray | None]:
        """(ids of `full`, start char of each token or None for a slow tokenizer); the
        `as_text` ranges tokenized as plain text, the rest as the template meant it."""
        if not as_text:
            if not self.fast:
                return self.tok(full, add_special_tokens=False)["input_ids"], None
            enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
            return list(enc["input_ids"]), np.array(
                [a for a, _ in enc["offset_mapping"]], dtype=np.int64)
        ids: list[int] = []
        starts: list[int] = []
        cuts = [0] + [c for span in as_text for c in span] + [len(full)]
        for k in range(len(cuts) - 1):
            a, b = cuts[k], cuts[k + 1]
            if a == b:
                continue
            enc = self.tok(full[a:b], add_special_tokens=False, return_offsets_mapping=True,
                           split_special_tokens=bool(k % 2))
            ids += enc["input_ids"]
            starts += [a + o for o, _ in enc["offset_mapping"]]
        return ids, np.array(starts, dtype=np.int64)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The ids a server is fed to generate the next assistant turn."""
        text = self.render(messages, True)
        return self.encode(text, self.as_text(messages, text))[0]

    def assistant_spans(self, messages: list[dict[str, str]], full: str) -> list[tuple[int, int]]:
        """Character spans of each trained assistant turn in `full`: content + end-of-turn.

        Start: the length of the conversation before the turn rendered with the
        generation prompt (what a server feeds the model before it generates).
        End: the length of the conversation rendered up to and including the turn,
        less trailing whitespace, when that is a prefix of `full`; otherwise (templates
        that render the last turn differently, e.g. Qwen3's think block) the end of
        the content plus the special token that closes it.
        """
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if not trained(m):
                continue
            start = self._turn_start(messages, i, full)
            upto = self.render(messages[: i + 1], False)
            if full.startswith(upto):
                end = len(upto.rstrip())
            else:
                content = m["content"].strip()
                pos = full.find(content, start)
                if pos < 0:
                    raise SkipRow("mask_alignment", f"turn {i}: content not found in render")
                end = pos + len(content)
                for sp in self.specials:
                    if full.startswith(sp, end):
                        end += len(sp)
                        break
            if end <= start or (spans and start < spans[-1][1]):
                raise SkipRow("mask_alignment", f"turn {i}: span {start}..{end} not increasing")
            spans.append((start, end))
        return spans

    def _turn_start(self, messages: list[dict[str, Any]], i: int, full: str) -> int:
        """Where assistant turn i's own text starts: after the conversation before it
        rendered with the generation prompt. A conversation that opens with an assistant
        turn has nothing before it, which many templates cannot render on its own: then
        the turn starts where its content does."""
        try:
            pre = self.render(messages[:i], True)
        except Exception:  # noqa: BLE001 - jinja on an empty list, ...
            if i:
                raise
            pre = None
        if pre is not None and full.startswith(pre):
            return len(pre)
        content = messages[i]["content"].strip()
        pos = full.find(content) if i == 0 and content else -1
        if pos < 0:
            raise SkipRow("mask_alignment", f"turn {i}: prefix render is not a prefix")
        return pos

    def tokenize(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
        """Token ids of the rendered conversation and its assistant loss mask."""
        ids, mask, _ = self.tokenize_with_notes(messages)
        return ids, mask

    @staticmethod
    def not_rendered(messages: list[dict[str, Any]], full: str) -> list[str]:
        """What the template left out of `full`: the row is used as the template renders
        it, and these are counted (report "not_rendered")."""
        notes = []
        for m in messages:
            reasoning = (m.get("reasoning_content") or "").strip()
            if reasoning and reasoning not in full:
                notes.append("reasoning_content")
            for call in m.get("tool_calls") or []:
                fn = call.get("function", call) if isinstance(call, dict) else {}
                name = fn.get("name") if isinstance(fn, dict) else None
                if not name or str(name) not in full:
                    notes.append("tool_calls")
                    break
        return notes

    def tokenize_with_notes(self, messages: list[dict[str, Any]],
                            generated: dict[int, tuple[list[int], bool]] | None = None,
                            ) -> tuple[list[int], list[int], list[str]]:
        """Ids, loss mask, and what the template left out (`not_rendered`). With
        `generated` (message position -> (ids the model generated, cut by max_tokens)),
        those turns carry the generated ids (`splice_generated`); the notes then also
        say how each such turn came back: "exact", "retokenized" or "template_drift"."""
        try:
            full = self.render(messages, False)
            spans = self.assistant_spans(messages, full)
        except SkipRow:
            raise
        except Exception as e:  # noqa: BLE001 - a template may raise anything (jinja, ...)
            raise SkipRow("template_error", f"{type(e).__name__}: {e}") from e
        notes = self.not_rendered(messages, full)
        as_text = self.as_text(messages, full)
        if as_text:
            notes.append(SPECIAL_TEXT)
        ids, ranges = self._ids_and_ranges(full, spans, as_text)
        if generated:
            positions = [i for i, m in enumerate(messages) if trained(m)]
            ids, ranges, kinds = self.splice_generated(ids, ranges, positions, generated)
            notes += kinds
        mask = [0] * len(ids)
        for a, b in ranges:
            mask[a:b] = [1] * (b - a)
        return ids, mask, notes

    def splice_generated(self, ids: list[int], ranges: list[tuple[int, int]],
                         positions: list[int], generated: dict[int, tuple[list[int], bool]]
                         ) -> tuple[list[int], list[tuple[int, int]], list[str]]:
        """Put back the ids the model generated where re-tokenizing its text gave other
        ids for the same text ("retokenized": byte-level tokens, non-canonical merges).
        Where the template renders other text than was generated ("template_drift",
        e.g. a template that drops the reasoning of earlier turns), the render stands:
        the row is used as its chat template renders it. A turn cut by max_tokens keeps
        the template's end-of-turn token after the generated ids, outside the mask: the
        mask is what the model generated."""
        out: list[int] = []
        new_ranges: list[tuple[int, int]] = []
        kinds: list[str] = []
        last = 0
        for (a, b), pos in zip(ranges, positions):
            out += ids[last:a]
            rendered = ids[a:b]
            turn, cut = rendered, False
            if pos in generated:
                gen, cut = generated[pos]
                want = list(gen) + (rendered[-1:] if cut and rendered else [])
                if want == rendered:
                    kinds.append("exact")
                elif self._text(want) == self._text(rendered):
                    kinds.append("retokenized")
                    turn = want
                else:
                    kinds.append("template_drift")
                    cut = False  # the render stands, mask and all
            new_ranges.append((len(out), len(out) + len(turn) - (1 if cut and turn else 0)))
            out += turn
            last = b
        return out + ids[last:], new_ranges, kinds

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _ids_and_ranges(self, full: str, spans: list[tuple[int, int]],
                        as_text: list[tuple[int, int]] = ()
                        ) -> tuple[list[int], list[tuple[int, int]]]:
        if self.fast:
            ids, starts = self.encode(full, as_text)
            ranges = []
            for s, e in spans:
                inside = np.flatnonzero((starts >= s) & (starts < e))
                a = int(inside[0]) if len(inside) else int(np.searchsorted(starts, s))
                ranges.append((a, int(inside[-1]) + 1 if len(inside) else a))
            return ids, ranges
        # Slow tokenizers have no offsets: tokenize each prefix. Its last pre-token can
        # merge differently at the end of a string ("\n\n" vs "\n", "\n" before text), so
        # after the common prefix, take the tokens of the whole whose text is exactly the
        # prefix's remaining text; if there are none, the boundary is inside a token.
        ids = self.tok(full, add_special_tokens=False)["input_ids"]

        def boundary(pos: int) -> int:
            head = self.tok(full[:pos], add_special_tokens=False)["input_ids"]
            k = 0
            while k < min(len(head), len(ids)) and head[k] == ids[k]:
                k += 1
            if k == len(head):
                return k
            want = self.tok.decode(head[k:])
            for m in range(1, len(ids) - k + 1):
                got = self.tok.decode(ids[k : k + m])
                if got == want:
                    return k + m
                if len(got) > len(want):
                    break
            raise SkipRow("mask_alignment", f"char {pos} is not a token boundary")

        return ids, [(boundary(s), boundary(e)) for s, e in spans]


# --- the whole dataset ----------------------------------------------------------------


NOTE_BITS = {"reasoning_content": 1, "tool_calls": 2, SPECIAL_TEXT: 4}  # Tokenized.flags


@dataclass
class Tokenized:
    """Usable samples, stored flat (numpy) so a large dataset stays small in memory.

    `sample(j)` builds the j-th usable sample as a `Sample` when a batch needs it. What
    the report counts is kept per sample too (the skipped ones by index and reason, the
    used ones' notes), so that the report of any shard of it is exact (`shard`).
    """

    indices: np.ndarray  # int64 [n]: sample index (position in the seeded order)
    offsets: np.ndarray  # int64 [n+1]: token range of sample j is offsets[j]:offsets[j+1]
    ids: np.ndarray  # int32 [total] (token ids; 4 bytes a token in memory and in the cache)
    mask: np.ndarray  # uint8 [total]
    truncated: np.ndarray  # bool [n]
    report: dict[str, Any] = field(default_factory=dict)
    flags: np.ndarray | None = None  # uint8 [n]: NOTE_BITS of each used sample
    regen: np.ndarray | None = None  # int32 [n, 3]: REGENERATED_TURNS counts per sample
    skip_index: np.ndarray | None = None  # int64 [k]: skipped sample indices
    skip_code: np.ndarray | None = None  # uint8 [k]: their reasons (SKIP_REASONS position)
    skip_row: np.ndarray | None = None  # int64 [k]: their row numbers

    def __post_init__(self) -> None:  # samples built without records: none noted, none skipped
        n = len(self.indices)
        if self.flags is None:
            self.flags = np.zeros(n, dtype=np.uint8)
        if self.regen is None:
            self.regen = np.zeros((n, len(REGENERATED_TURNS)), dtype=np.int32)
        for name, dtype in (("skip_index", np.int64), ("skip_code", np.uint8),
                            ("skip_row", np.int64)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(0, dtype=dtype))

    def __len__(self) -> int:
        return len(self.indices)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, j: int) -> Sample:
        a, b = int(self.offsets[j]), int(self.offsets[j + 1])
        return Sample(
            index=int(self.indices[j]),
            input_ids=self.ids[a:b].tolist(),
            loss_mask=self.mask[a:b].tolist(),
            truncated=bool(self.truncated[j]),
        )

    _ARRAYS = ("indices", "offsets", "ids", "mask", "truncated", "flags", "regen",
               "skip_index", "skip_code", "skip_row")

    def save(self, path: Path, meta: dict[str, Any]) -> None:
        """Write to directory `path` (one .npy per array, token ids as int32), `meta`
        (the run identity it was made under) beside them; complete or absent."""
        import shutil

        from eagle3_extract.layout import temp_path

        tmp = temp_path(path)  # pid and a random tag: pods of a k8s Job are often all pid 1
        tmp.mkdir(parents=True)
        try:
            for name in self._ARRAYS:
                a = getattr(self, name)
                np.save(tmp / f"{name}.npy", a.astype(np.int32) if name == "ids" else a)
            (tmp / "meta.json").write_text(json.dumps({**meta, "report": self.report}))
            os.replace(tmp, path)  # refused when `path` is there already (a dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @classmethod
    def load(cls, path: Path) -> tuple["Tokenized", dict[str, Any]]:
        """(samples, meta) as `save` wrote them; the arrays are memory-mapped, so a
        replica reads only the pages of the samples it selects."""
        meta = json.loads((path / "meta.json").read_text())
        arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r") for name in cls._ARRAYS}
        return cls(**arrays, report=meta.pop("report")), meta

    def select(self, keep: np.ndarray) -> "Tokenized":
        """The samples at positions `keep` (a boolean mask over usable samples); the
        report and the skipped records stay as they are (`shard` recounts them)."""
        keep = np.asarray(keep, dtype=bool)
        if keep.all():  # a fresh run's to-do set: the same arrays, no copy
            return Tokenized(
                self.indices, self.offsets, self.ids, self.mask, self.truncated, self.report,
                self.flags, self.regen, self.skip_index, self.skip_code, self.skip_row,
            )
        pos = np.flatnonzero(keep)
        lengths = self.lengths[pos]
        offsets = np.zeros(len(pos) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.repeat(keep, self.lengths)  # 1 byte a token, not an index array
        return Tokenized(
            self.indices[pos], offsets, self.ids[tokens], self.mask[tokens],
            self.truncated[pos], self.report, self.flags[pos], self.regen[pos],
            self.skip_index, self.skip_code, self.skip_row,
        )

    def shard(self, index: int, count: int) -> "Tokenized":
        """Shard `index` of `count` (sample index % count == index), its report recounted
        from the per-sample records: exact per shard, and the shards' counts add up."""
        mine = self.select(self.indices % count == index)
        keep = self.skip_index % count == index
        mine.skip_index, mine.skip_code = self.skip_index[keep], self.skip_code[keep]
        mine.skip_row = self.skip_row[keep]
        mine.report = mine.recount(self.report, (index, count))
        return mine

    def recount(self, base: dict[str, Any], shard: tuple[int, int]) -> dict[str, Any]:
        """The report of these samples: `base` gives what is not per sample (rows,
        selected, max_length, overlong, the skip details)."""
        codes = np.bincount(self.skip_code, minlength=len(SKIP_REASONS))
        skipped = {r: int(codes[i]) for i, r in enumerate(SKIP_REASONS)}
        details = {e["index"]: e.get("detail", "") for e in base.get("skipped_examples", [])}
        examples = [{"index": int(i), "row": int(r), "reason": SKIP_REASONS[int(c)],
                     "detail": details.get(int(i), "")}
                    for i, r, c in zip(self.skip_index[:20], self.skip_row[:20],
                                       self.skip_code[:20])]
        regen = self.regen.sum(axis=0)
        return {
            "rows": base["rows"],
            "selected": base["selected"],
            # this report covers the samples with index % count == index
            "shard": {"index": int(shard[0]), "count": int(shard[1])},
            "usable": len(self),
            "skipped": skipped,
            "skipped_total": int(codes.sum()),
            "skipped_examples": examples,
            # used rows whose reasoning or tool calls the chat template does not render
            "not_rendered": {k: int(((self.flags & b) > 0).sum())
                             for k, b in NOTE_BITS.items() if k != SPECIAL_TEXT},
            # turns of eagle3-regenerate rows: how their generated ids came back (this module)
            "regenerated_turns": {k: int(regen[i]) for i, k in enumerate(REGENERATED_TURNS)},
            # used rows whose message text spells a special token, kept as text (as_text)
            SPECIAL_TEXT: int(((self.flags & NOTE_BITS[SPECIAL_TEXT]) > 0).sum()),
            "truncated": int(self.truncated.sum()),
            "tokens": int(self.offsets[-1]),
            "loss_tokens": int(self.mask.sum()),
            "max_length": base["max_length"],
            "overlong": base["overlong"],
        }


def _tokenize_span(rows: list[Any], order: list[int], positions: Any,
                   renderer: Renderer, max_length: int, overlong: str) -> dict[str, Any]:
    """The samples at `positions` of the order: arrays of the usable ones, a record of
    each skipped one (index, row, reason, detail)."""
    skips: list[tuple[int, int, int, str]] = []
    indices, lengths, truncated, flags, regen = [], [], [], [], []
    id_chunks, mask_chunks = [], []
    for index in positions:
        row_no = order[index]
        try:
            row = rows[row_no]
            ids, mask, notes = renderer.tokenize_with_notes(to_messages(row), generated_turns(row))
            cut = len(ids) > max_length
            if cut:
                if overlong == "skip":
                    raise SkipRow("overlong", f"{len(ids)} > max_length {max_length} tokens")
                ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                raise SkipRow("no_loss_tokens", "truncated" if cut else "empty assistant turns")
        except SkipRow as e:
            skips.append((index, row_no, SKIP_REASONS.index(e.reason), e.detail[:200]))
            continue
        flags.append(sum(b for k, b in NOTE_BITS.items() if k in notes))
        regen.append([notes.count(k) for k in REGENERATED_TURNS])
        indices.append(index)
        lengths.append(len(ids))
        truncated.append(cut)
        id_chunks.append(np.asarray(ids, dtype=np.int32))
        mask_chunks.append(np.asarray(mask, dtype=np.uint8))
    return {
        "indices": np.asarray(indices, dtype=np.int64),
        "lengths": np.asarray(lengths, dtype=np.int64),
        "truncated": np.asarray(truncated, dtype=bool),
        "ids": np.concatenate(id_chunks) if id_chunks else np.zeros(0, dtype=np.int32),
        "mask": np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, dtype=np.uint8),
        "flags": np.asarray(flags, dtype=np.uint8),
        "regen": np.asarray(regen, dtype=np.int32).reshape(-1, len(REGENERATED_TURNS)),
        "skips": skips,
    }


_FORKED: tuple | None = None  # what forked tokenizer workers inherit (never pickled)


def _forked_worker_init() -> None:
    """A worker takes the default SIGTERM (the pool's terminate() must end it quietly, not
    raise the job's Interrupted in it) and ignores SIGINT (Ctrl-C is the parent's to act on)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _forked_span(bounds: tuple[int, int]) -> dict[str, Any]:
    rows, order, positions, renderer, max_length, overlong = _FORKED
    return _tokenize_span(rows, order, positions[bounds[0]:bounds[1]], renderer, max_length,
                          overlong)


def auto_num_proc(num_proc: int | None, num_rows: int) -> int:
    """`dataset.num_proc`, or by default one process per core (<= 32) for big datasets."""
    if num_proc is not None:
        return max(1, int(num_proc))
    return min(os.cpu_count() or 1, 32) if num_rows >= 5000 else 1


def _threads_beside() -> list[str]:
    import threading

    me = threading.current_thread()
    return [t.name for t in threading.enumerate() if t is not me and t.is_alive()]


def tokenize_rows(
    rows: list[Any], order: list[int], renderer: Renderer, max_length: int, overlong: str,
    num_proc: int = 1, shard: tuple[int, int] = (0, 1),
    on_workers: Callable[[], None] | None = None,
) -> Tokenized:
    """Tokenize the rows of shard `shard` (sample index % count == index) in seeded
    order; skip and count what cannot be used. Only the shard's rows are rendered and
    tokenized; its report counts them (`Tokenized.recount`).

    With `num_proc > 1` contiguous spans of the shard's positions go to forked worker
    processes (they inherit rows and tokenizer, nothing is pickled but results);
    the result is identical to the serial one.

    `on_workers` is called once the workers exist (at once when there are none), before
    any row is tokenized: what starts a thread (the engine start) goes there. A fork
    beside a running thread copies the locks that thread holds, held forever: a worker
    that then needs one (a module the thread was importing) hangs, and the job with it
    (seen on the H200: 16 workers forked while vLLM's engine started).
    """
    index, count = shard
    positions = range(index, len(order), count)
    n = len(positions)
    if num_proc <= 1 or n < 2 * num_proc:
        if on_workers is not None:
            on_workers()
        parts = [_tokenize_span(rows, order, positions, renderer, max_length, overlong)]
    else:
        import multiprocessing as mp

        global _FORKED
        step = -(-n // (num_proc * 4))
        spans = [(a, min(a + step, n)) for a in range(0, n, step)]
        beside = _threads_beside()
        if beside:
            log.warning("forking %d tokenizer workers beside running threads %s: a worker "
                        "may hang on a lock one of them held", num_proc, beside)
        _FORKED = (rows, order, positions, renderer, max_length, overlong)
        pool = mp.get_context("fork").Pool(num_proc, initializer=_forked_worker_init)
        try:
            if on_workers is not None:
                on_workers()
            parts = pool.map(_forked_span, spans, chunksize=1)
            pool.close()  # the workers exit on their own; nothing is killed on success
        except BaseException:
            pool.terminate()
            raise
        finally:
            pool.join()
            _FORKED = None
    lengths = np.concatenate([p["lengths"] for p in parts])
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    skips = [sk for p in parts for sk in p["skips"]]
    data = Tokenized(
        np.concatenate([p["indices"] for p in parts]), offsets,
        np.concatenate([p["ids"] for p in parts]), np.concatenate([p["mask"] for p in parts]),
        np.concatenate([p["truncated"] for p in parts]),
        flags=np.concatenate([p["flags"] for p in parts]),
        regen=np.concatenate([p["regen"] for p in parts]),
        skip_index=np.asarray([sk[0] for sk in skips], dtype=np.int64),
        skip_row=np.asarray([sk[1] for sk in skips], dtype=np.int64),
        skip_code=np.asarray([sk[2] for sk in skips], dtype=np.uint8),
    )
    base = {"rows": len(rows), "selected": len(order), "max_length": max_length,
            "overlong": overlong,
            "skipped_examples": [{"index": sk[0], "detail": sk[3]} for sk in skips[:20]]}
    data.report = data.recount(base, shard)
    return data


def load_tokenizer(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise PreflightError(
            f"tokenizer {path!r} could not be loaded ({type(e).__name__}: {e}); set "
            "model.tokenizer (or model.path) to a directory or hub id with a tokenizer"
        ) from e


def build_dataset(ds: Any, tokenizer: Any, max_length: int,
                  rows: list[Any] | None = None, shard: tuple[int, int] = (0, 1),
                  on_workers: Callable[[], None] | None = None) -> Tokenized:
    """dataset config + tokenizer -> usable samples of shard `shard` (only its rows are
    rendered and tokenized). Raises PreflightError if it has rows and none is usable.
    `on_workers`: tokenize_rows's."""
    rows = read_nonempty(ds) if rows is None else rows
    order = seeded_order(len(rows), int(ds.seed), bool(ds.shuffle), ds.max_samples)
    mine = len(range(shard[0], len(order), shard[1]))
    procs = auto_num_proc(getattr(ds, "num_proc", None), mine)
    data = tokenize_rows(rows, order, Renderer(tokenizer), max_length, str(ds.overlong), procs,
                         shard, on_workers)
    if len(data) == 0 and mine:
        where = "" if shard[1] == 1 else f" (shard {shard[0]} of {shard[1]})"
        raise PreflightError(
            f"dataset.path={str(ds.path)!r}: none of {mine} rows{where} is usable "
            f"(skipped by reason: { {k: v for k, v in data.report['skipped'].items() if v} }); "
            "check the row format (ShareGPT `conversations` or OpenAI `messages`)"
        )
    return data
