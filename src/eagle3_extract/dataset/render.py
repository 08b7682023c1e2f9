"""Messages -> token ids and an exact assistant loss mask, with the tokenizer's own chat
template: the mask covers exactly the tokens of every assistant turn (its content and its
end-of-turn token, not the role header), found by rendering prefixes of the conversation
and mapping character spans to tokens.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from eagle3_extract.config import PreflightError
from eagle3_extract.dataset.messages import SPECIAL_TEXT, SkipRow, trained


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
