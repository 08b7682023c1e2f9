"""Small models of an architecture no package registry has a small pretrained model of,
trained here for a few minutes on the committed text so that their answers carry signal.

Why: a drafter learns to predict the target's next token from its hidden states; a random
target's greedy answers are near-ties of flat logits, so a drafter trained on them says
little about whether the served drafter gets what it was trained on. `kimi_mini` is
Kimi-K2.5's text backbone in shape (DeepseekV3: the first layer dense, then MoE with a
shared expert and sigmoid `noaux_tc` routing, MLA's low-rank q/kv projections with a
rope/nope split, yarn rope over a 4k original context), 8 layers of width 128, trained on
committed chats (SmolLM2's answers to training prompts, the sample conversations) rendered by
the committed chat template.

Built once and cached by the hash of everything that determines it (config, text,
tokenizer, this module, the torch and transformers versions); the folder carries
`trained.json` (the loss at each logged step, the seconds it took). Training is seeded but
float reductions follow the machine's thread count, so two machines may cache weights that
differ in the last bits: each run records its model's config sha256, and the chain's checks
compare runs on one machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

from eagle3_extract.models.tiny import ASSETS, SEED, TOKENIZER_DIR, build_once, cache_root

CONFIGS = {p.stem: p for p in sorted((ASSETS / "trained").glob("*.json"))}  # not *.jsonl
# the committed text: SmolLM2-135M-Instruct's answers to 160 of the training prompts (not
# the held-out ones acceptance is measured on) and the sample conversations, each rendered
# whole by the chat template (assets/trained/README.md)
TEXT = (ASSETS / "trained" / "smollm2_answers.jsonl", ASSETS / "sample" / "conversations.jsonl")
STEPS, BATCH, SEQ_LEN, LR = 600, 8, 256, 3e-3
NAMES = tuple(CONFIGS)


def _fingerprint(config: Path) -> str:
    from importlib.metadata import version

    h = hashlib.sha256()
    for f in (config, *TEXT, *sorted(TOKENIZER_DIR.iterdir()), Path(__file__)):
        h.update(f.name.encode() + f.read_bytes())
    h.update(f"seed={SEED} steps={STEPS} batch={BATCH} seq={SEQ_LEN} lr={LR} "
             f"torch={version('torch')} transformers={version('transformers')}".encode())
    return h.hexdigest()[:16]


def corpus_ids(tokenizer) -> list[int]:
    """Every committed conversation rendered by the chat template, one token stream."""
    ids: list[int] = []
    for path in TEXT:
        for line in path.read_text().splitlines():
            if line.strip():
                messages = json.loads(line)["messages"]
                ids += tokenizer.apply_chat_template(messages, tokenize=True)
    return ids


def train_model(config: Path, out: Path) -> None:
    """The model of `config`, trained STEPS steps of BATCH random windows of SEQ_LEN tokens
    from the corpus (AdamW, cosine decay), saved with the tokenizer into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    raw = json.loads(config.read_text())
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    data = torch.tensor(corpus_ids(tokenizer), dtype=torch.long)
    gen = torch.Generator().manual_seed(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS,
                                                pct_start=0.05)
    losses, t0 = [], time.monotonic()
    model.train()
    for step in range(STEPS):
        starts = torch.randint(0, len(data) - SEQ_LEN, (BATCH,), generator=gen)
        batch = torch.stack([data[s:s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == STEPS - 1:
            losses.append([step, round(float(loss.detach()), 4)])
    model.eval()
    model.to(getattr(torch, raw.get("torch_dtype", "bfloat16"))).save_pretrained(
        out, safe_serialization=True)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy(f, out / f.name)
    (out / "trained.json").write_text(json.dumps({
        "config": config.name, "text": [str(p.relative_to(ASSETS)) for p in TEXT],
        "corpus_tokens": len(data), "steps": STEPS, "batch": BATCH, "seq_len": SEQ_LEN,
        "lr": LR, "seed": SEED, "loss": losses,
        "seconds": round(time.monotonic() - t0, 1), "threads": torch.get_num_threads()},
        indent=1) + "\n")


def build_trained(name: str, root: Path | None = None) -> Path:
    """The cached checkpoint of a trained small model, trained on first use (minutes)."""
    config = CONFIGS[name]
    root = Path(root) if root else cache_root() / "trained"
    out = root / f"{name}-{_fingerprint(config)}"
    if not (out / "model.safetensors").exists():
        print(f"eagle3-extract: training the small model {name!r} on the committed text "
              f"({STEPS} steps, minutes; once, cached in {root})", flush=True)
    return build_once(out, lambda tmp: train_model(config, tmp))
