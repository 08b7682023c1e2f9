"""Is a drafter checkpoint whole and what its config says, before anything loads it.

A drafter directory (eagle3-train's drafter/, or one of its epoch checkpoints) is a
speculators-format EAGLE-3 model: config.json and model.safetensors. A file cut short,
a header that is not JSON, a tensor missing or of another shape, or a drafter made for
another target failed inside torch or vLLM after the target had loaded, in a traceback;
read here from the config and the safetensors header alone (no tensor is loaded), it is
one line before any engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_extract.layout import file_problem, safetensors_header

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def _config_numbers(config: dict[str, Any]) -> dict[str, int]:
    tl = config["transformer_layer_config"]
    h, heads = int(tl["hidden_size"]), int(tl["num_attention_heads"])
    return {"hidden": h, "heads": heads, "kv_heads": int(tl["num_key_value_heads"]),
            "head_dim": int(tl.get("head_dim") or h // heads),
            "inter": int(tl["intermediate_size"]), "layers": int(tl["num_hidden_layers"]),
            "vocab": int(config["draft_vocab_size"])}


def expected_shapes(config: dict[str, Any], target_hidden: int | None) -> dict[str, list]:
    """The tensors vLLM 0.16's Eagle3LlamaForCausalLM loads, with the shapes the config
    implies (None: a dimension the config does not fix)."""
    n = _config_numbers(config)
    h, q, kv = n["hidden"], n["heads"] * n["head_dim"], n["kv_heads"] * n["head_dim"]
    want: dict[str, list] = {
        "fc.weight": [h, 3 * target_hidden if target_hidden else None],
        "norm.weight": [h], "lm_head.weight": [n["vocab"], h]}
    for i in range(n["layers"]):
        p = f"layers.{i}."
        want.update({p + "self_attn.q_proj.weight": [q, None],
                     p + "self_attn.k_proj.weight": [kv, None],
                     p + "self_attn.v_proj.weight": [kv, None],
                     p + "self_attn.o_proj.weight": [h, q],
                     p + "mlp.gate_proj.weight": [n["inter"], h],
                     p + "mlp.up_proj.weight": [n["inter"], h],
                     p + "mlp.down_proj.weight": [h, n["inter"]],
                     p + "input_layernorm.weight": [h],
                     p + "post_attention_layernorm.weight": [h]})
    return want


def drafter_problem(path: Path, target_hidden: int | None = None,
                    record: str | None = None) -> str | None:
    """Why the drafter at `path` cannot be loaded as it says, or None. `target_hidden`:
    the target's hidden size (the drafter's fc takes three of its states); `record`: a
    JSON file beside it that must parse too (eagle3-train's record)."""
    cfg_path, weights = path / CONFIG, path / WEIGHTS
    if not cfg_path.is_file() or not weights.is_file():
        return f"{path} has no {CONFIG} and {WEIGHTS}"
    try:
        cfg = json.loads(cfg_path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return f"{cfg_path} is not a config ({type(e).__name__}: {str(e)[:120]})"
    if cfg.get("speculators_model_type") != "eagle3":
        return (f"{path} is not a speculators EAGLE-3 drafter (speculators_model_type="
                f"{cfg.get('speculators_model_type')!r})")
    try:
        want = expected_shapes(cfg, target_hidden)
        aux = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    except (KeyError, TypeError, ValueError) as e:
        return f"{cfg_path}: {type(e).__name__} {e} (a key missing or not a number)"
    if len(aux) != 3:
        return f"{cfg_path}: eagle_aux_hidden_state_layer_ids={aux}, not 3 ids"
    why = file_problem(weights, "safetensors")
    if why:
        return f"{weights}: {why}"
    try:
        with open(weights, "rb") as f:
            head = f.read(8)
            head += f.read(int.from_bytes(head, "little"))
        _, header = safetensors_header(head)
    except (OSError, ValueError) as e:
        return f"{weights}: unreadable header ({e})"
    for name, shape in want.items():
        have = (header.get(name) or {}).get("shape")
        if have is None:
            return f"{weights}: no tensor {name}"
        if len(have) != len(shape) or any(w is not None and w != d for w, d in zip(shape, have)):
            shown = [d if d is not None else "*" for d in shape]
            return f"{weights}: {name} is {have}, the config says {shown}"
    if record is not None and (path / record).exists():
        try:
            rec = json.loads((path / record).read_text())
            if not isinstance(rec, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            return f"{path / record} is not a record ({type(e).__name__}: {str(e)[:120]})"
    return None
