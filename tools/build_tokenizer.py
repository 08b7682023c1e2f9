"""Rebuild the committed tiny tokenizer (src/eagle3_extract/assets/tokenizer).

A byte-level BPE trained on this repository's own text and a Llama-3-style chat
template, so tests and the embedded default run with no network. Run once; the
output is committed and tests never retrain it.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|eot_id|>"
    "{% endgeneration %}{% else %}{{ message['content'] }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)


def main(out: Path, corpus: list[Path]) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [p.read_text(errors="ignore") for p in corpus]
    tok.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "pad_token": "<|pad|>", "model_max_length": 4096,
        "chat_template": TEMPLATE,
    }, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|pad|>",
    }, indent=2) + "\n")
    print(f"vocab size {tok.get_vocab_size()} -> {out}")


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1]
    files = sorted(Path(sys.prefix).glob("lib/python3*/site-packages/vllm/entrypoints/**/*.py"))[:200]
    main(root / "src/eagle3_extract/assets/tokenizer", files + [root / "docs/CONTRACTS.md"])
