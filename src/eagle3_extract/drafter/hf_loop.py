"""eagle3-acceptance's exact HF engine: a greedy draft-and-verify loop over HF
transformers, feeding the drafter what vLLM 0.16 feeds it at serving time (Drafter mirrors
vLLM's llama_eagle3.py; HFLoop the proposer's steps), and the per-position counts both
engines report (Counts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.drafter.checkpoint import CONFIG, WEIGHTS
from eagle3_extract.errors import PreflightError


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Drafter:
    """A speculators-format EAGLE-3 drafter (Llama layers), with a KV cache of its own."""

    def __init__(self, path: Path, target_embed: torch.Tensor, device: torch.device,
                 dtype: torch.dtype):
        from safetensors.torch import load_file

        cfg = json.loads((path / CONFIG).read_text())
        tl = cfg["transformer_layer_config"]
        self.aux_ids = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
        self.hidden = int(tl["hidden_size"])
        self.heads, self.kv_heads = int(tl["num_attention_heads"]), int(tl["num_key_value_heads"])
        self.head_dim = int(tl.get("head_dim") or self.hidden // self.heads)
        self.eps = float(tl["rms_norm_eps"])
        self.num_layers = int(tl["num_hidden_layers"])
        # vLLM 0.16 reads norm_before_residual with a default of True
        self.norm_before_residual = bool(cfg.get("norm_before_residual", True))
        for flag in ("norm_before_fc", "norm_output", "fc_norm"):
            if cfg.get(flag):
                raise PreflightError(f"{path}: {flag}=true, which vLLM 0.16 does not implement; "
                                     "retrain with it off (eagle3-train does)")
        rope = tl.get("rope_parameters") or {"rope_type": "default",
                                             "rope_theta": tl.get("rope_theta", 10000.0)}
        if tl.get("rope_scaling"):
            rope = {**rope, **tl["rope_scaling"]}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise PreflightError(f"{path}: rope {rope} is not implemented by the hf loop; "
                                 "measure with engine=vllm or engine=vllm_serve")
        w = {k: v.to(device) for k, v in load_file(str(path / WEIGHTS)).items()}
        self.w = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in w.items()}
        self.embed = self.w.get("embed_tokens.weight", target_embed.to(dtype))
        d2t = self.w.get("d2t")
        size = self.w["lm_head.weight"].shape[0]
        self.to_target = (torch.arange(size, device=device) + d2t) if d2t is not None else None
        theta = float(rope["rope_theta"])
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, device=device,
                                                     dtype=torch.float32) / self.head_dim)
        self.rope_scale = 1.0
        if rope_type == "yarn":  # a DeepseekV3 / Kimi-K2.5 target's rope, which the drafter
            # inherits: transformers' yarn, as the trainer's Llama layer computes it
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")}
            llama = LlamaConfig(hidden_size=self.hidden, num_attention_heads=self.heads,
                                head_dim=self.head_dim, rope_theta=theta,
                                max_position_embeddings=int(tl["max_position_embeddings"]),
                                rope_scaling={**scaling, "rope_type": "yarn"})
            inv_freq, self.rope_scale = ROPE_INIT_FUNCTIONS["yarn"](llama, device)
            self.inv_freq = inv_freq.float()
        self.dtype, self.device = dtype, device
        self.reset()

    def reset(self) -> None:
        empty = torch.zeros(self.kv_heads, 0, self.head_dim, dtype=self.dtype, device=self.device)
        self.k = [empty] * self.num_layers
        self.v = [empty] * self.num_layers

    @property
    def length(self) -> int:
        return int(self.k[0].shape[1])

    def crop(self, n: int) -> None:
        self.k = [k[:, :n] for k in self.k]
        self.v = [v[:, :n] for v in self.v]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3 x H] target states -> [n, H] (vLLM: combine_hidden_states, the fc)."""
        return aux.to(self.dtype) @ self.w["fc.weight"].T

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        f = pos.float()[:, None] * self.inv_freq[None]
        emb = torch.cat((f, f), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(x.dtype)[None]
        sin = (emb.sin() * self.rope_scale).to(x.dtype)[None]
        return x * cos + _rotate_half(x) * sin

    def _attn(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        p = f"layers.{layer}.self_attn."
        n = x.shape[0]
        q = (x @ self.w[p + "q_proj.weight"].T).view(n, self.heads, self.head_dim).transpose(0, 1)
        k = (x @ self.w[p + "k_proj.weight"].T).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        v = (x @ self.w[p + "v_proj.weight"].T).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = self._rope(q, pos), self._rope(k, pos)
        past = self.k[layer].shape[1]
        self.k[layer] = torch.cat([self.k[layer], k], dim=1)
        self.v[layer] = torch.cat([self.v[layer], v], dim=1)
        rep = self.heads // self.kv_heads
        keys = self.k[layer].repeat_interleave(rep, dim=0)
        vals = self.v[layer].repeat_interleave(rep, dim=0)
        mask = torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(past)
        o = torch.nn.functional.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return o.transpose(0, 1).reshape(n, -1) @ self.w[p + "o_proj.weight"].T

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"layers.{layer}.mlp."
        gate = torch.nn.functional.silu(x @ self.w[p + "gate_proj.weight"].T)
        return (gate * (x @ self.w[p + "up_proj.weight"].T)) @ self.w[p + "down_proj.weight"].T

    def step(self, ids: torch.Tensor, hidden: torch.Tensor,
             pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens at `pos` with their hidden inputs -> (target-vocab argmax ids, pre-norm
        outputs, which vLLM feeds back as the next draft position's hidden input)."""
        w, eps = self.w, self.eps
        residual = None
        h = hidden
        for layer in range(self.num_layers):
            p = f"layers.{layer}."
            if layer == 0:
                embeds = _rms(self.embed[ids], w[p + "input_layernorm.weight"], eps)
                normed = _rms(h, w[p + "hidden_norm.weight"], eps)
                residual = normed if self.norm_before_residual else h
                x = torch.cat([embeds, normed], dim=-1)
            else:
                residual = h + residual
                x = _rms(residual, w[p + "input_layernorm.weight"], eps)
            a = self._attn(layer, x, pos)
            residual = a + residual
            h = self._mlp(layer, _rms(residual, w[p + "post_attention_layernorm.weight"], eps))
        prenorm = h + residual
        logits = _rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T
        best = logits.float().argmax(-1)
        return (self.to_target[best] if self.to_target is not None else best), prenorm


@dataclass
class Counts:
    k: int
    drafts: int = 0
    accepted: list[int] = field(default_factory=list)
    generated: int = 0
    prompts: int = 0

    def __post_init__(self) -> None:
        self.accepted = self.accepted or [0] * self.k

    def add(self, n_accepted: int) -> None:
        self.drafts += 1
        for i in range(n_accepted):
            self.accepted[i] += 1

    def report(self) -> dict[str, Any]:
        d = max(self.drafts, 1)
        return {"num_speculative_tokens": self.k, "prompts": self.prompts,
                "generated_tokens": self.generated, "drafts": self.drafts,
                "draft_tokens": self.drafts * self.k,
                "accepted_per_position": self.accepted,
                "acceptance_per_position": [round(a / d, 4) for a in self.accepted],
                "mean_acceptance_length": round(1 + sum(self.accepted) / d, 4)}


class HFLoop:
    """Greedy speculative decoding, one prompt at a time, exact (see the module doc)."""

    def __init__(self, target: Any, drafter: Drafter, k: int, eos: set[int]):
        self.target, self.drafter, self.k, self.eos = target, drafter, k, eos
        self.aux = drafter.aux_ids

    def _target(self, ids: list[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([ids], device=self.drafter.device)
        out = self.target(input_ids=x, past_key_values=cache, use_cache=True,
                          output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i][0] for i in self.aux], dim=-1)
        return out.logits[0].float().argmax(-1), feats

    @torch.no_grad()
    def generate(self, prompt: list[int], max_tokens: int, counts: Counts) -> list[int]:
        from transformers import DynamicCache

        d = self.drafter
        d.reset()
        cache = DynamicCache()
        best, feats = self._target(prompt, cache)
        nxt = int(best[-1])
        out = [nxt]
        seq_len = len(prompt)  # positions the target has processed
        # the drafter's inputs for positions not yet in its cache: token i+1, state i
        todo_ids, todo_feats = prompt[1:] + [nxt], feats
        while len(out) < max_tokens and nxt not in self.eos:
            start = d.length
            pos = torch.arange(start, start + len(todo_ids), device=d.device)
            tok, pre = d.step(torch.tensor(todo_ids, device=d.device), d.combine(todo_feats), pos)
            drafts = [int(tok[-1])]
            h, p = pre[-1:], int(pos[-1])
            verified = d.length
            for j in range(1, self.k):
                tok, h = d.step(torch.tensor([drafts[-1]], device=d.device), h,
                                torch.tensor([p + j], device=d.device))
                drafts.append(int(tok[-1]))
            d.crop(verified)  # draft positions are recomputed from the target's states
            best, feats = self._target([nxt] + drafts, cache)
            a = 0
            while a < self.k and drafts[a] == int(best[a]):
                a += 1
            counts.add(a)
            new = drafts[:a] + [int(best[a])]
            cache.crop(seq_len + a + 1)
            todo_ids, todo_feats = new, feats[: a + 1]
            seq_len += a + 1
            nxt = new[-1]
            for t in new:
                out.append(t)
                if t in self.eos or len(out) >= max_tokens:
                    return out
        return out
