"""A dataset row -> chat-template messages, or the reason it is skipped.

Rows are ShareGPT-style (`conversations`: `from`/`value`) or OpenAI-style
(`messages`: `role`/`content`). A row that cannot be used raises SkipRow with one of
SKIP_REASONS: the job counts it, never raises it and never drops it silently.
"""

from __future__ import annotations

from typing import Any


from eagle3_extract.dataset.rows import Malformed

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
    # any other exception raised while reading, rendering or tokenizing one row (a
    # tokenizer's, a template's, ours): the row is skipped with it, never the job
    "row_error",
    # more bytes than dataset.max_row_bytes (default from max_length): skipped before it
    # is parsed (a .jsonl line) or rendered, whose memory grows with the row's length
    "row_too_large",
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
