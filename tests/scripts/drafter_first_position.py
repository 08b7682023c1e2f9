"""In the trainer's environment (.venv-train): speculators 0.9.0's own Eagle3DraftModel
forward, one TTT step, over given inputs; prints its draft tokens (target vocabulary).

argv: drafter dir, a .pt file with `input_ids` [T] and `aux` [T, 3H] (what the drafter
sees at each position: the next token and the target's aux states).
"""

import json
import sys

import torch
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

path, inputs = sys.argv[1], torch.load(sys.argv[2])
config = Eagle3SpeculatorConfig.from_pretrained(path)
config.transformer_layer_config._attn_implementation = "sdpa"
model = Eagle3DraftModel.from_pretrained(path, config=config).float().eval()
ids = inputs["input_ids"][None]
with torch.no_grad():
    draft = model(hidden_states=inputs["aux"][None].float(), input_ids=ids,
                  document_ids=torch.zeros_like(ids), ttt_steps=1)[0][0]
print(json.dumps((draft + model.d2t[draft]).tolist()))
