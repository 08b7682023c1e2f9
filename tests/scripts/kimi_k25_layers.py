"""Build vLLM 0.16's real KimiK25ForConditionalGeneration from a tiny config (dummy
weights) and report where the capture finds its decoder layers. Run as a
subprocess: it initialises torch.distributed in-process."""

import inspect
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_MLA_DISABLE", "1")

from eagle3_extract.engine.layers import find_decoder_layers  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration  # noqa: E402

from eagle3_extract.models.tiny import tiny_config_path  # noqa: E402

ds = json.loads(tiny_config_path("deepseek_v3").read_text())
d = Path(tempfile.mkdtemp())
cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
       "text_config": ds,
       "vision_config": {"patch_size": 14, "num_attention_heads": 2, "num_hidden_layers": 1,
                         "hidden_size": 64, "intermediate_size": 128,
                         "init_pos_emb_height": 8, "init_pos_emb_width": 8},
       "media_placeholder_token_id": 1000, "torch_dtype": "float32"}
(d / "config.json").write_text(json.dumps(cfg))
vc = EngineArgs(model=str(d), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                load_format="dummy").create_engine_config()
init_distributed_environment(world_size=1, rank=0, local_rank=0,
                             distributed_init_method=f"file://{d}/dist", backend="gloo")
initialize_model_parallel(1, 1)
with set_current_vllm_config(vc):
    m = KimiK25ForConditionalGeneration(vllm_config=vc, prefix="")
path, layers = find_decoder_layers(m)
print(json.dumps({"path": path, "num_layers": len(layers),
                  "layer_class": type(layers[0]).__name__,
                  "language_model": type(m.language_model).__name__,
                  "llama_4_scaling_arg": "llama_4_scaling"
                  in inspect.signature(layers[0].forward).parameters}))
