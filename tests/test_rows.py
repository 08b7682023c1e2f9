"""Every row kind real chat data has: rendered as its chat template renders it, or counted.

Reasoning content, tool calls and tool messages, a leading assistant turn, BOMs, CRLF,
compressed files, bytes that are not UTF-8. With the committed tokenizer; the reasoning /
tool template is a stand-in written in the shape of Kimi's and Qwen3's (think block and
tool calls inside the assistant turn, a `tool` role for results).
"""

from __future__ import annotations

import copy
import gzip
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from eagle3_extract.config import ASSETS
from eagle3_extract.dataset.render import Renderer
from eagle3_extract.dataset.samples import build_dataset
from eagle3_extract.dataset.messages import to_messages
from eagle3_extract.dataset.rows import read_rows

THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{% if m['role'] == 'assistant' %}{% if m.get('reasoning_content') %}<think>"
    "{{ m['reasoning_content'] }}</think>{% endif %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments'] }})</tool_call>{% endfor %}<|eot_id|>"
    "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

REASONING = {"messages": [
    {"role": "user", "content": "What is 6 x 7?"},
    {"role": "assistant", "reasoning_content": "Six sevens are forty-two.", "content": "42"}]}
TOOLS = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    {"role": "assistant", "content": "It is 18 C and sunny in Paris."}]}
LEADING_ASSISTANT = {"messages": [
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi."}]}
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))


@pytest.fixture(scope="module")
def thinking(tok):
    t = copy.deepcopy(tok)
    t.chat_template = THINKING_TEMPLATE
    return t


def ds(path: Path, **kw):
    base = dict(name="t", path=str(path), split="train", hub_config=None, data_files=None,
                format="auto", max_samples=None, seed=0, shuffle=False, max_length=None,
                overlong="truncate")
    return OmegaConf.create({**base, **kw})


def masked_text(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_reasoning_is_rendered_and_in_the_loss_mask(thinking):
    msgs = to_messages(REASONING)
    assert msgs[1]["reasoning_content"] == "Six sevens are forty-two."
    ids, mask, notes = Renderer(thinking).tokenize_with_notes(msgs)
    assert notes == []
    text = masked_text(thinking, ids, mask)
    assert "<think>Six sevens are forty-two.</think>42" in text
    assert "What is" not in text


def test_other_names_for_reasoning_are_read():
    row = copy.deepcopy(REASONING)
    row["messages"][1]["reasoning"] = row["messages"][1].pop("reasoning_content")
    assert to_messages(row)[1]["reasoning_content"] == "Six sevens are forty-two."


def test_reasoning_the_template_drops_is_counted_not_hidden(tok, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(REASONING) + "\n" + json.dumps(GOOD) + "\n")
    data = build_dataset(ds(path), tok, 2047)  # the plain template has no think block
    assert len(data) == 2  # used as the template renders it
    assert data.report["not_rendered"] == {"reasoning_content": 1, "tool_calls": 0}


def test_tool_calls_and_tool_messages(thinking, tok, tmp_path):
    msgs = to_messages(TOOLS)
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"]
    assert msgs[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert msgs[2]["tool_call_id"] == "c1"
    ids, mask, notes = Renderer(thinking).tokenize_with_notes(msgs)
    assert notes == []
    text = masked_text(thinking, ids, mask)
    assert "<tool_call>get_weather" in text and "It is 18 C" in text
    assert "18 C, sunny" not in text  # the tool's result is input, not a target
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(TOOLS) + "\n")
    data = build_dataset(ds(path), tok, 2047)
    assert data.report["not_rendered"]["tool_calls"] == 1


def test_a_conversation_opening_with_the_assistant_is_used(tok):
    ids, mask = Renderer(tok).tokenize(to_messages(LEADING_ASSISTANT))
    text = masked_text(tok, ids, mask)
    assert "Hello! How can I help?" in text and "Hi." in text and "Say hi" not in text


def test_bom_crlf_and_compressed_files_read_like_the_plain_file(tmp_path):
    lines = [json.dumps(r) for r in (GOOD, REASONING, TOOLS)]
    plain = tmp_path / "p.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    want = list(read_rows(ds(plain)))
    body = ("\r\n".join(lines) + "\r\n").encode()
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + body)
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(body))
    import zstandard

    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(want).encode())
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(json.dumps(want).encode()))
    for name in ("bom.jsonl", "c.jsonl.gz", "c.jsonl.zst", "bom.json", "c.json.gz"):
        assert list(read_rows(ds(tmp_path / name))) == want, name


def test_bytes_that_are_not_utf8_skip_only_their_row(tok, tmp_path):
    bad = json.dumps({"messages": [{"role": "user", "content": "caf\u00e9"},
                                   {"role": "assistant", "content": "ok"}]}).encode()
    bad = bad.replace("caf\\u00e9".encode(), b"caf\xe9")  # latin-1 byte, not UTF-8
    path = tmp_path / "u.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + bad + b"\n" + json.dumps(GOOD).encode())
    data = build_dataset(ds(path), tok, 2047)
    assert len(data) == 2 and data.report["skipped"]["invalid_utf8"] == 1
    assert "\ufffd" not in tok.decode(data.ids.tolist())
    as_json = tmp_path / "u.json"
    as_json.write_bytes(b"[" + json.dumps(GOOD).encode() + b"," + bad + b"]")
    data = build_dataset(ds(as_json), tok, 2047)
    assert len(data) == 1 and data.report["skipped"]["invalid_utf8"] == 1


def test_a_plain_jsonl_file_is_read_lazily_and_exactly_as_a_compressed_one(tmp_path):
    """JsonlRows (offsets over a mapping, parsed when read) against the reader that parses
    everything (a .gz file): same rows, same Malformed line numbers, blank lines of every
    kind left out, a BOM and CRLF handled, a last line without its newline kept."""
    import pickle

    from eagle3_extract.dataset.rows import JsonlRows, Malformed

    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    body = (b"\xef\xbb\xbf" + json.dumps(row).encode() + b"\r\n" + b"\n" + b"   \t\r\n"
            + "\u00a0\u2028\n".encode() + b'{"messages": [\n' + b"\xff\xfe{}\n"
            + b'["a list"]\n' + json.dumps({**row, "n": 2}).encode())
    plain, packed = tmp_path / "rows.jsonl", tmp_path / "rows.jsonl.gz"
    plain.write_bytes(body)
    packed.write_bytes(gzip.compress(body))
    lazy = read_rows(OmegaConf.create({"path": str(plain), "format": "auto"}))
    full = read_rows(OmegaConf.create({"path": str(packed), "format": "auto"}))
    assert isinstance(lazy, JsonlRows) and isinstance(full, list)
    assert len(lazy) == len(full) == 5
    assert [lazy[i] for i in range(len(lazy))] == full == lazy[:]
    assert lazy[0] == row and lazy[-1] == {**row, "n": 2}
    assert isinstance(lazy[1], Malformed) and lazy[1].line == 5
    assert lazy[2] == Malformed(6, "not UTF-8 at byte 0", "invalid_utf8")
    again = pickle.loads(pickle.dumps(lazy))
    assert again[:] == full
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n \n")
    assert len(JsonlRows(empty)) == 0
