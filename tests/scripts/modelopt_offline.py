"""Run inside .venv-modelopt: ModelOpt 0.47.0's own offline EAGLE-3 path over an eagle3-export.

argv: EXPORT VERIFIER STEPS. Reads every `*.pt` under the export with its
OfflineSupervisedDataset (answer_only_loss: the stored loss masks) and its
EagleOfflineDataCollator; builds its offline EAGLE-3 model the way its recipe does
(load_vlm_or_llm with the fake base: lm_head, embeddings and final norm only, then
mtsp.convert with EAGLE3_DEFAULT_CFG, eagle_offline, the export's aux layer ids in its
own count); turns the stored final state into targets with the converted model's own
lm_head; then runs STEPS AdamW steps of the model's training forward (its EAGLE loss) on
the first batch. Prints one JSON line.
"""

import copy
import glob
import json
import sys

import torch

export, verifier, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])

import modelopt.torch.speculative as mtsp  # noqa: E402
from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG  # noqa: E402
from modelopt.torch.speculative.eagle.utils import (EagleOfflineDataCollator,  # noqa: E402
                                                    OfflineSupervisedDataset)
from modelopt.torch.speculative.utils import load_vlm_or_llm  # noqa: E402

record = json.load(open(f"{export}/export.json"))
files = sorted(glob.glob(f"{export}/**/*.pt", recursive=True))
ds = OfflineSupervisedDataset(files, answer_only_loss=True)
max_len = max(int(torch.load(f, weights_only=True)["input_ids"].numel()) for f in files)
collate = EagleOfflineDataCollator(train_len=max_len)

model = load_vlm_or_llm(verifier, use_fake_base=True, use_offline_training=True)
cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
cfg["eagle_offline"] = True
cfg["eagle_decoder_type"] = "llama"
cfg["eagle_use_torch_compile"] = False  # inductor autotuning on a CPU: minutes, same math
cfg["eagle_architecture_config"] = dict(cfg["eagle_architecture_config"],
                                        eagle_aux_hidden_state_layer_ids=record[
                                            "trainer_aux_layer_ids"])
torch.manual_seed(0)
mtsp.convert(model, [("eagle", cfg)])

from transformers import AutoModelForCausalLM  # noqa: E402

ref = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
samples, agree, total = [], 0, 0
with torch.no_grad():
    for i in range(len(ds)):
        item = ds[i]
        got = model._base_model_lm_head(item["base_model_hidden_states"]).float()
        want = ref(item["input_ids"][None]).logits[0]
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        total += len(want)
        samples.append({"input_ids": item["input_ids"].tolist(),
                        "loss_mask": item["loss_mask"].tolist(),
                        "aux_width": int(item["aux_hidden_states"].shape[-1])})

batch = collate([ds[0]])
if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
    # A CPU without native bf16 GEMMs (AVX2) runs bf16 backward through torch's scalar
    # fallback: 90 s a step here, past the test's 900 s for four under CI's load. float32
    # is the same training step (the test checks that it reads and trains, not its dtype).
    model.float()
    model._base_llm_config.dtype = torch.float32  # its TTT attention mask's dtype

    def _float(v):  # the collator's batch: tensors, and base_model_outputs, a dict of them
        if isinstance(v, dict):
            return {k: _float(x) for k, x in v.items()}
        return v.float() if torch.is_tensor(v) and v.is_floating_point() else v

    batch = _float(batch)
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
losses = []
for _ in range(steps):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                loss_mask=batch["loss_mask"], labels=batch["labels"],
                base_model_outputs=batch["base_model_outputs"])
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    losses.append(float(out.loss.detach()))
print("RESULT " + json.dumps({"agree": agree, "total": total, "samples": samples,
                              "losses": losses, "files": len(files),
                              "aux_layer_ids": record["trainer_aux_layer_ids"]}))
