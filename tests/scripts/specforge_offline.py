"""Run inside .venv-specforge: SpecForge 0.2.0's own offline path over an eagle3-export.

argv: EXPORT VERIFIER STEPS. Reads the export with its OfflineManifestReader, its
LocalFeatureStore, its FeatureDataLoader with the eagle3 normalizer and collator; turns
the stored final state into targets with its TargetHead (the lm_head, loaded by its own
from_pretrained); then trains its EAGLE-3 model (LlamaForCausalLMEagle3 in
OnlineEagle3Model, stepped by Eagle3TrainStrategy) with AdamW for STEPS steps on the
first batch. Prints one JSON line: per sample the ids and loss mask the trainer sees, the
targets' argmax agreement with the verifier's own next-token logits, and the losses.

The one substitution: SpecForge's KL loss is a Triton kernel (GPU only). On the CPU its
module's own reference formula (`_compute_loss`, -sum(mask * p * log_softmax)) takes its
place; the error the kernel raises on a CPU tensor is printed as `kernel_error`.
"""

import json
import sys

import torch

export, verifier, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])

from specforge.algorithms.eagle3 import data as sf_data  # noqa: E402
from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader  # noqa: E402
from specforge.runtime.data_plane.feature_store import LocalFeatureStore  # noqa: E402
from specforge.modeling.target.target_head import TargetHead  # noqa: E402

MAX_LEN = 2048
refs = sf_data.build_offline_reader(export, run_id="check", ttt_length=3, max_len=MAX_LEN).read()
store = LocalFeatureStore("check")
loader = FeatureDataLoader(store, refs=refs, batch_size=1,
                           collate_fn=sf_data.build_offline_collator(),
                           per_sample_transform=sf_data.build_offline_normalizer(MAX_LEN),
                           gc_interval_s=None)
batches = list(loader)

cfg = json.load(open(f"{verifier}/config.json"))
key = "lm_head.weight" if not cfg.get("tie_word_embeddings") else "model.embed_tokens.weight"
head = TargetHead.from_pretrained(verifier, lm_head_key=key)

from transformers import AutoModelForCausalLM  # noqa: E402

model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
samples, agree, total = [], 0, 0
with torch.no_grad():
    for b in batches:
        ids, target, mask = head.preprocess(b.tensors["input_ids"], b.tensors["target"],
                                            b.tensors["loss_mask"])
        got = head(target).float()[0]  # position t: the target's state at t + 1
        raw = b.tensors["input_ids"]
        want = model(raw).logits[0]
        n = raw.shape[1] - 1
        agree += int((got[:n].argmax(-1) == want[1:].argmax(-1)).sum())
        total += n
        samples.append({"input_ids": raw[0].tolist(), "loss_mask": b.tensors["loss_mask"][0].tolist(),
                        "aux_width": int(b.tensors["hidden_state"].shape[-1])})

# The trainer's EAGLE-3 model and one training step, as build_eagle3_draft makes it.
from specforge.algorithms.eagle3 import model as sf_model  # noqa: E402
from specforge.core import loss as sf_loss  # noqa: E402
from specforge.modeling.auto import AutoDraftModel  # noqa: E402
from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

text = cfg.get("text_config") or cfg
draft_config = LlamaConfig(
    architectures=["LlamaForCausalLMEagle3"], hidden_size=text["hidden_size"],
    intermediate_size=text["intermediate_size"], num_attention_heads=text["num_attention_heads"],
    num_key_value_heads=text.get("num_key_value_heads", text["num_attention_heads"]),
    num_hidden_layers=1, vocab_size=text["vocab_size"], draft_vocab_size=text["vocab_size"],
    max_position_embeddings=MAX_LEN, rms_norm_eps=text["rms_norm_eps"],
    rope_theta=text.get("rope_theta", 10000.0), hidden_act="silu", tie_word_embeddings=False)
torch.manual_seed(0)
# A CPU without native bf16 GEMMs (AVX2) runs bf16 backward through torch's scalar
# fallback (minutes a step under CI's load): there the same step in float32.
TRAIN_DTYPE = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
if TRAIN_DTYPE == torch.float32:
    head.float()
    for b in batches:
        b.tensors.update({k: v.float() for k, v in b.tensors.items()
                          if torch.is_tensor(v) and v.is_floating_point()})
draft = AutoDraftModel.from_config(draft_config, attention_backend="sdpa",
                                   torch_dtype=TRAIN_DTYPE)
draft.load_embedding(verifier, embedding_key="model.embed_tokens.weight")
draft.freeze_embedding()
eagle = sf_model.OnlineEagle3Model(draft, length=3, attention_backend="sdpa")
strategy = Eagle3TrainStrategy(eagle, target_head=head)

kernel_error = None
try:
    sf_loss.LogSoftmaxLoss.apply(torch.zeros(1, 2, 8), torch.full((1, 2, 8), 1 / 8),
                                 torch.ones(1, 2, 1))
except Exception as e:  # noqa: BLE001 - the finding is the message
    kernel_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    reference = getattr(sf_loss._compute_loss, "_torchdynamo_orig_callable",
                        getattr(sf_loss._compute_loss, "__wrapped__", None))

    class ReferenceLoss:
        apply = staticmethod(reference)

    sf_model.LogSoftmaxLoss = ReferenceLoss

opt = torch.optim.AdamW([p for p in eagle.parameters() if p.requires_grad], lr=1e-3)
losses = []
for _ in range(steps):
    out = strategy.forward_loss(batches[0])
    opt.zero_grad()
    out.loss.backward()
    opt.step()
    losses.append(float(out.loss))
print("RESULT " + json.dumps({"agree": agree, "total": total, "samples": samples,
                              "losses": losses, "kernel_error": kernel_error,
                              "files": len(refs)}))
