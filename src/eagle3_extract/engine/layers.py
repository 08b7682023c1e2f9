"""Find a model's decoder layers and capture the residual stream with hooks.

Hooks instead of a copied layer loop: a copy of each architecture's loop drops
arguments that only some layers take (DeepseekV2's `llama_4_scaling`); a hook on
the layer's output works with any signature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# Attribute paths from a CausalLM (HF or vLLM) to its decoder layer list, tried in order.
_LAYER_PATHS = (
    "model.layers",  # Llama, Qwen2/3, DeepseekV2/V3 (HF and vLLM)
    "language_model.model.layers",  # vLLM multimodal wrappers (Kimi-K2.5, ...)
    "model.language_model.layers",  # HF multimodal wrappers (transformers >= 4.52)
    "language_model.layers",
    "transformer.h",
)


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for path in _LAYER_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return path, obj
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}: tried {_LAYER_PATHS}"
    )


def residual_stream(output: object) -> torch.Tensor:
    """The full residual stream after a decoder layer.

    vLLM layers return `(hidden_states, residual)` with the add deferred to the
    next layer's fused norm; HF layers return the summed stream (or a tuple
    whose first element is it).
    """
    if isinstance(output, tuple):
        if len(output) >= 2 and isinstance(output[1], torch.Tensor) and (
            output[1].shape == output[0].shape
        ):
            return output[0] + output[1]
        return output[0]
    return output


def attach_capture(
    layers: nn.ModuleList,
    layer_ids: list[int],
    sink: Callable[[int, torch.Tensor], None],
    owned: Callable[[nn.Module], bool] = lambda m: True,
) -> list[torch.utils.hooks.RemovableHandle]:
    """Call `sink(column, state)` with the stream at each layer id.

    Id k (vLLM / EAGLE-3 convention) is the stream entering layer k, i.e. the
    output of layer k-1; id N is the output of the last layer, before the
    final norm. `owned` filters layers that live on another pipeline stage.
    """
    handles = []
    for column, k in enumerate(layer_ids):
        layer = layers[k - 1]
        if not owned(layer):
            continue

        def hook(_mod, _args, output, column=column):
            sink(column, residual_stream(output))

        handles.append(layer.register_forward_hook(hook))
    return handles
