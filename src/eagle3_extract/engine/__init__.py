"""Engines: prefill a batch of token ids and capture the residual stream.

Layer ids are resolved here once, in the vLLM / EAGLE-3 convention; every later
stage sees explicit integers. An engine is made by engine/start.py (`build_engine`,
or `EngineStart` beside preflight): this package's modules import from here, never
the other way round.
"""

from __future__ import annotations

from eagle3_extract.models.config import ModelInfo, inspect_model  # noqa: F401 - the engines' input


def default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers plus the final pre-norm state (id N)."""
    n = num_layers
    return sorted({2, n // 2, n - 3, n})


def resolve_layer_ids(ids: list[int] | None, num_layers: int) -> list[int]:
    """Validate ids in the vLLM convention: 1 <= k <= N, strictly increasing."""
    if ids is None:
        if num_layers < 4:
            raise ValueError(
                f"the default layers need >= 4 decoder layers, the model has {num_layers}; "
                "set layers.ids explicitly"
            )
        return default_layer_ids(num_layers)
    ids = [int(k) for k in ids]
    if not ids:
        raise ValueError("layers.ids is empty: give at least one layer id")
    bad = [k for k in ids if not 1 <= k <= num_layers]
    if bad:
        raise ValueError(
            f"layers.ids {bad} out of range for a model with {num_layers} decoder layers: "
            f"ids count boundaries (vLLM / EAGLE-3 convention), 1..{num_layers}, where k is "
            f"the residual stream entering layer k and {num_layers} the state before the "
            "final norm"
        )
    if any(b <= a for a, b in zip(ids, ids[1:])):
        raise ValueError(f"layers.ids {ids} must be strictly increasing (no duplicates)")
    return ids
