"""The device memory the capture adds, and the preflight check that it fits beside vLLM.

vLLM sizes its KV cache so that weights, peak activations, non-torch memory and the
cache fill `gpu_memory_utilization` x the card (vllm/v1/worker/gpu_worker.py,
`determine_available_memory`). The capture's buffers are allocated before that profile
(docs/engine.md, start-up step 3) and are not part of it: they live in the card's other
`1 - gpu_memory_utilization`, beside the CUDA context the worker held before vLLM
measured and whatever other processes hold. Only TP rank 0 of each pipeline stage
captures, and it holds the full hidden size (the all-reduced stream) whatever the TP size.
A plan that cannot fit is refused before the model loads, with the two settings that fix it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from eagle3_extract.quant import FP8_CHUNK_ROWS

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)

# Rows beyond max_num_batched_tokens in the capture buffers (step padding).
CAPTURE_SLACK_ROWS = 1024
# What a worker's process holds on its card before vLLM's first snapshot (CUDA context,
# cuBLAS workspace): 0.5 GiB measured on the H200 (docs/engine.md); kept at 1 GiB.
CONTEXT_BYTES = 1 << 30
GIB = float(1 << 30)


@dataclass(frozen=True)
class CapturePlan:
    """The buffers engine/worker.py allocates on a capturing rank."""

    rows: int
    layers: int
    hidden: int
    itemsize: int  # the model dtype's
    buffers: int = 2  # CUDA: the copy of call i overlaps the prefill of call i+1
    scale_cols: int = 0  # fp8 output: float32 scales per row (0: states in the model dtype)

    @property
    def states_bytes(self) -> int:
        return self.buffers * self.rows * self.layers * self.hidden * self.itemsize

    @property
    def fp8_bytes(self) -> int:
        if not self.scale_cols:
            return 0
        return self.rows * self.layers * self.hidden + self.rows * self.scale_cols * 4

    @property
    def small_bytes(self) -> int:  # positions (int64), finite flags (uint8), the ticket
        return self.rows * 9 + 8

    @property
    def transient_bytes(self) -> int:
        """The peak a flush adds: fp8's float32 quotient per chunk of rows (quant.py);
        the model-dtype path reduces without a temporary."""
        if not self.scale_cols:
            return 0
        return min(self.rows, FP8_CHUNK_ROWS) * self.layers * self.hidden * 4

    @property
    def held_bytes(self) -> int:
        return self.states_bytes + self.fp8_bytes + self.small_bytes

    @property
    def peak_bytes(self) -> int:
        return self.held_bytes + self.transient_bytes


def capture_plan(token_budget: int, layers: int, hidden: int, itemsize: int,
                 scale_cols: int = 0, buffers: int = 2) -> CapturePlan:
    return CapturePlan(int(token_budget) + CAPTURE_SLACK_ROWS, int(layers), int(hidden),
                       int(itemsize), int(buffers), int(scale_cols))


@dataclass(frozen=True)
class Card:
    index: int  # NVML's
    total: int
    free: int


def visible_cards() -> list[Card] | None:
    """Memory of the GPUs this process may use, from NVML (no CUDA context is made: a
    context in the driver process would take memory the workers need); None where there
    is no NVIDIA driver or the visible devices cannot be mapped (MIG)."""
    try:
        from vllm.utils.import_utils import import_pynvml

        nvml = import_pynvml()
        nvml.nvmlInit()
    except Exception:  # no driver, no GPU, a CPU build: nothing to check
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
        spec = os.environ.get("CUDA_VISIBLE_DEVICES")
        handles = []
        for item in ([s.strip() for s in spec.split(",") if s.strip()]
                     if spec is not None else [str(i) for i in range(count)]):
            if item.isdigit() and int(item) < count:
                handles.append((int(item), nvml.nvmlDeviceGetHandleByIndex(int(item))))
            elif item.startswith("GPU-"):
                h = nvml.nvmlDeviceGetHandleByUUID(item)
                handles.append((nvml.nvmlDeviceGetIndex(h), h))
            else:  # MIG instances, or an invalid entry CUDA stops at
                return None
        cards = []
        for index, h in handles:
            info = nvml.nvmlDeviceGetMemoryInfo(h)
            cards.append(Card(index, int(info.total), int(info.free)))
        return cards
    except Exception as e:  # NVML answers partly (permissions, a lost GPU): do not guess
        log.debug("NVML: %s", e)
        return None
    finally:
        nvml.nvmlShutdown()


def check_fits(plan: CapturePlan, cards: list[Card], utilization: float, tp: int,
               pp: int) -> str | None:
    """Why the engine plus the capture cannot fit on `cards` (one line naming the fix),
    or None. Card k of the engine's tp x pp holds vLLM's share; k % tp == 0 captures."""
    need_cards = tp * pp
    if len(cards) < need_cards:
        return (f"model.tensor_parallel_size x pipeline_parallel_size = {need_cards} GPUs, "
                f"{len(cards)} visible; set CUDA_VISIBLE_DEVICES or the sizes")
    for k, card in enumerate(cards[:need_cards]):
        vllm_share = int(card.total * utilization) + 1
        room = card.free - vllm_share - CONTEXT_BYTES
        captures = k % tp == 0
        need = plan.peak_bytes if captures else 0
        if room >= need:
            continue
        what = (f"GPU {card.index}: {card.free / GIB:.1f} of {card.total / GIB:.1f} GiB free; "
                f"vLLM takes model.gpu_memory_utilization={utilization} "
                f"({vllm_share / GIB:.1f} GiB) plus {CONTEXT_BYTES / GIB:.0f} GiB of CUDA context")
        max_util = (card.free - CONTEXT_BYTES - need) / card.total
        fix = f"lower model.gpu_memory_utilization to {max(0.0, max_util - 0.005):.2f}"
        if not captures:
            return f"{what}: it does not fit; {fix} or free the GPU"
        fixed = plan.transient_bytes + 8  # the rest grows with the rows
        rows_fit = (room - fixed) // ((plan.peak_bytes - fixed) // plan.rows)
        budget = (rows_fit - CAPTURE_SLACK_ROWS) // 1024 * 1024
        budget_fix = f"engine.token_budget to {budget}" if budget >= 1024 else \
            "engine.token_budget"
        return (f"{what}; the capture needs {plan.peak_bytes / GIB:.2f} GiB more on this "
                f"rank ({plan.rows} rows x {plan.layers} layers x {plan.hidden}, "
                f"engine.token_budget={plan.rows - CAPTURE_SLACK_ROWS}) and {max(room, 0) / GIB:.2f} GiB are "
                f"left: {fix} or lower {budget_fix}")
    return None


def check_capture_memory(engine: EngineConfig, model: ModelConfig, info: Any,
                         layer_ids: list[int], scale_cols: int,
                         cards: list[Card] | None = None) -> CapturePlan | None:
    """Preflight: refuse (ValueError, one line) a vLLM engine on GPUs whose capture cannot
    fit beside vLLM's share; the plan where it was checked, else None (no NVIDIA GPU)."""
    if engine.name != "vllm" or str(engine.device) == "cpu":
        return None
    cards = visible_cards() if cards is None else cards
    if not cards:
        return None
    # engine/vllm.py's max_num_batched_tokens: a step fits a whole prompt
    budget = max(int(engine.token_budget), int(model.max_model_len))
    plan = capture_plan(budget, len(layer_ids), int(info.hidden_size),
                        info.dtype.itemsize, scale_cols)
    why = check_fits(plan, cards, float(model.gpu_memory_utilization),
                     int(model.tensor_parallel_size), int(model.pipeline_parallel_size))
    if why:
        raise ValueError(why)
    return plan
