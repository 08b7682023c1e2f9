"""`eagle3-acceptance`: how many of a drafter's tokens the target accepts, greedy.

The check that the data is fit for its purpose: a layer off by one or a wrong final norm
in the training data raises no error anywhere and only shows here. Two engines measure
the same thing:

- engine=vllm: vLLM 0.16's own EAGLE-3 speculative decoding (GPU; its CPU backend has
  none), per-position counts from `llm.get_metrics()`;
- engine=hf: an exact greedy draft-and-verify loop over HF transformers, feeding the
  drafter what vLLM 0.16 feeds it at serving time: the target's residual stream entering
  each aux layer (`hidden_states[k]`, our and vLLM's id k) through the drafter's fc, the
  next token's embedding, the drafter's own pre-norm output for later draft positions,
  and the drafter's KV cache of the verified positions only (Drafter mirrors
  vLLM's llama_eagle3.py). Rejected draft positions are recomputed from the target's
  states, as vLLM does.

Per position i (1..k): the share of drafts whose first i tokens were all accepted; mean
acceptance length = 1 + accepted draft tokens / drafts (vLLM's definition).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.drafter.checkpoint import CONFIG, WEIGHTS, drafter_problem
from eagle3_extract.drafter.chart import acceptance_chart, report_series
from eagle3_extract.drafter.hf_loop import Counts, Drafter, HFLoop
from eagle3_extract.config import (AcceptanceSettings, DatasetConfig, EngineConfig, ModelConfig,
                                   validate_acceptance)
from eagle3_extract.errors import JobError, PreflightError
from eagle3_extract.layout import ACCEPTANCE_JSON, ACCEPTANCE_PNG, TRAIN_JSON
from eagle3_extract.manifest import write_json_atomic

log = logging.getLogger("eagle3_extract")

PROG = "eagle3-acceptance"
REPORT = ACCEPTANCE_JSON
TRAIN_RECORD = TRAIN_JSON


# --- the job ------------------------------------------------------------------------------


@dataclass
class Plan:
    """What preflight established: the config groups the measurement reads (not the job's
    whole config), the target, the drafter, the prompts."""

    acceptance: AcceptanceSettings
    engine: EngineConfig
    model: ModelConfig
    verbose: bool
    info: Any
    drafter: Path
    out: Path
    prompts: list[list[int]]
    eos: set[int]
    aux_ids: list[int]
    record: dict[str, Any] | None
    ident: dict[str, Any]
    done: dict[str, Any] | None  # this run's own report, found whole in output.dir
    serve_python: str = ""  # engine=vllm_serve: the serving engine's interpreter


def _prompts(dataset: DatasetConfig, tokenizer: Any) -> list[list[int]]:
    """Each row's conversation up to its last user turn, with the generation prompt."""
    from eagle3_extract.dataset.render import Renderer
    from eagle3_extract.dataset.messages import SkipRow, to_messages
    from eagle3_extract.dataset.samples import seeded_order
    from eagle3_extract.dataset.rows import read_nonempty

    renderer = Renderer(tokenizer)
    rows = read_nonempty(dataset)
    order = seeded_order(len(rows), int(dataset.seed), bool(dataset.shuffle),
                         dataset.max_samples)
    prompts, skipped = [], 0
    for i in order:
        try:
            msgs = to_messages(rows[i], need_assistant=False)
        except SkipRow:
            skipped += 1
            continue
        while msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs:
            skipped += 1
            continue
        try:
            prompts.append(renderer.prompt_ids(msgs))
        except SkipRow:
            skipped += 1
    if not prompts:
        raise PreflightError(f"dataset.path={dataset.path!r}: no usable prompt "
                             f"({skipped} rows skipped)")
    if skipped:
        log.warning("%d rows skipped (no usable prompt)", skipped)
    return prompts


def run_identity(acceptance: AcceptanceSettings, dataset: DatasetConfig, engine: EngineConfig,
                 model: ModelConfig, info: Any, drafter: Path) -> dict[str, Any]:
    """What determines the report: the target and the drafter by their bytes, the prompts,
    the measurement and the engine. The pass/fail thresholds are checks on a report, not
    part of it: a rerun with other thresholds reads the same report back."""
    from omegaconf import OmegaConf

    from eagle3_extract.manifest import file_sha256, with_run_id

    def plain(node: Any) -> Any:
        return OmegaConf.to_container(node, resolve=True)

    measure = {k: v for k, v in plain(acceptance).items()
               if k not in ("min_first_position", "max_first_position")}
    return with_run_id({
        "kind": PROG,
        "model": {"config_sha256": file_sha256(Path(info.path) / "config.json"),
                  "max_model_len": int(model.max_model_len)},
        "drafter": {"model_sha256": file_sha256(drafter / WEIGHTS),
                    "config_sha256": file_sha256(drafter / CONFIG)},
        "dataset": plain(dataset), "acceptance": measure, "engine": plain(engine)})


def own_report(out: Path, ident: dict[str, Any]) -> dict[str, Any] | None:
    """`out`'s report if it is this run's (a rerun: `make e2e` reruns every step); None
    if `out` holds no report yet. Refused in one line: a report of another run, or a
    folder that is not an acceptance output at all. The report names its own run id, so
    it is trusted by its content, never by its name or by what lies beside it."""
    from eagle3_extract.layout import check_writable
    from eagle3_extract.layout import RUN_JSON
    from eagle3_extract.manifest import check_run_json

    path = out / REPORT
    if path.is_file() and not path.is_symlink():
        try:
            rep = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise PreflightError(f"output.dir={str(out)!r}: unreadable {REPORT} ({e}); "
                                 "remove it, or set output.dir to a new directory") from e
        if rep.get("run_id") == ident["run_id"]:
            return rep
        raise PreflightError(
            f"output.dir={str(out)!r} holds the report of another measurement (run_id "
            f"{rep.get('run_id')} there, {ident['run_id']} now: another drafter, model, "
            "dataset or acceptance setting); set output.dir to a new directory")
    if (out / RUN_JSON).exists() or (out / RUN_JSON).is_symlink():
        check_run_json(out, ident)  # this run, cut off before its report: measured again
    check_writable(out)  # beside a run.json anything goes; without, only an empty folder
    return None


def preflight(cfg: Any) -> Plan:
    from eagle3_extract.dataset.samples import load_tokenizer
    from eagle3_extract.engine import inspect_model
    from eagle3_extract.manifest import file_sha256

    validate_acceptance(cfg)
    drafter = Path(str(cfg.drafter.dir)).expanduser().resolve()
    if not (drafter / CONFIG).is_file() or not (drafter / WEIGHTS).is_file():
        raise PreflightError(f"drafter.dir={str(drafter)!r} has no config.json and "
                             "model.safetensors (give eagle3-train's output.dir/drafter)")
    try:
        info = inspect_model(cfg.model)
    except (ValueError, OSError) as e:
        raise PreflightError(f"model.path={str(cfg.model.path)!r}: {e}") from e
    problem = drafter_problem(drafter, record=TRAIN_RECORD)
    if problem:
        raise PreflightError(f"drafter.dir: {problem}; give a whole drafter (rerun "
                             "eagle3-train into a new output.dir, or copy it again)")
    dcfg = json.loads((drafter / CONFIG).read_text())
    aux = [int(i) for i in dcfg.get("eagle_aux_hidden_state_layer_ids") or []]
    if len(aux) != 3 or not all(0 <= i < info.num_layers for i in aux):
        raise PreflightError(f"drafter.dir: aux layer ids {aux} are not 3 ids in "
                             f"0..{info.num_layers - 1} of the target")
    record = None
    if (drafter / TRAIN_RECORD).is_file():
        record = json.loads((drafter / TRAIN_RECORD).read_text())
        want = (record.get("verifier") or {}).get("config_sha256")
        have = file_sha256(Path(info.path) / "config.json")
        if want and want != have:
            raise PreflightError(f"model.path={str(cfg.model.path)!r} is not the model the "
                                 "drafter was trained for (config.json sha256 differs from "
                                 f"{TRAIN_RECORD}); set model= to that model")
    problem = drafter_problem(drafter, info.hidden_size)  # its fc takes this target's states
    if problem:
        raise PreflightError(f"drafter.dir: {problem}: a drafter of another target (hidden "
                             f"size {info.hidden_size}); set model= to its target")
    if str(cfg.engine.name) == "vllm":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            raise PreflightError("engine=vllm: vLLM 0.16's CPU backend has no speculative "
                                 "decoding; use engine=hf (the exact loop) or a GPU")
        from eagle3_extract.engine.vllm_args import check_vllm_args

        check_vllm_args(cfg.engine, fixed={})
    serving = str(cfg.engine.name) == "vllm_serve"
    serve_python = _serving_engine(cfg.acceptance) if serving else ""
    tokenizer = load_tokenizer(info.tokenizer_path, bool(cfg.model.trust_remote_code),
                               info.vocab_size)
    prompts = _prompts(cfg.dataset, tokenizer)
    limit = int(cfg.model.max_model_len)
    longest = max(len(p) for p in prompts) + int(cfg.acceptance.max_tokens) + \
        int(cfg.acceptance.num_speculative_tokens) + 1
    if longest > limit:
        raise PreflightError(f"the longest prompt plus acceptance.max_tokens needs {longest} "
                             f"tokens, above model.max_model_len={limit}; lower "
                             "acceptance.max_tokens or dataset.max_samples")
    eos = tokenizer.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    gen_cfg = Path(info.path) / "generation_config.json"
    if gen_cfg.is_file():  # what vLLM stops on too
        g = json.loads(gen_cfg.read_text()).get("eos_token_id")
        eos_ids |= set(g if isinstance(g, list) else [g]) - {None}
    out = Path(str(cfg.output.dir)).expanduser().resolve()
    ident = run_identity(cfg.acceptance, cfg.dataset, cfg.engine, cfg.model, info, drafter)
    return Plan(cfg.acceptance, cfg.engine, cfg.model, bool(cfg.verbose), info, drafter, out,
                prompts, {int(e) for e in eos_ids}, aux, record, ident, own_report(out, ident),
                serve_python)


def _serving_engine(acceptance: AcceptanceSettings) -> str:
    """acceptance.serve_python, resolved, when it has a vLLM >= SERVE_FLOOR (checked from
    the package metadata: seconds); raises PreflightError."""
    from eagle3_extract.drafter.serving import FLOOR, find_serving_python

    python, why = find_serving_python(str(acceptance.serve_python))
    if why is not None:
        raise PreflightError(f"acceptance.serve_python={python!r}: {why}; engine=vllm_serve "
                             f"needs vLLM >= {FLOOR} there (make venv-train venv-peer, or "
                             "point acceptance.serve_python at one)")
    return python


def _device(engine: EngineConfig) -> torch.device:
    want = str(engine.device)
    if want in ("auto", ""):
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def run_hf(plan: Plan) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    a = plan.acceptance
    device = _device(plan.engine)
    dtype = getattr(torch, str(a.hf_dtype))
    target = AutoModelForCausalLM.from_pretrained(plan.info.path, dtype=dtype,
                                                  attn_implementation="sdpa").to(device).eval()
    embed = target.get_input_embeddings().weight.detach()
    drafter = Drafter(plan.drafter, embed, device, dtype)
    loop = HFLoop(target, drafter, int(a.num_speculative_tokens), plan.eos)
    counts = Counts(int(a.num_speculative_tokens))
    t0 = last = time.monotonic()
    outputs = []
    for i, prompt in enumerate(plan.prompts):
        out = loop.generate(prompt, int(a.max_tokens), counts)
        outputs.append([int(t) for t in out])
        counts.generated += len(out)
        counts.prompts += 1
        if time.monotonic() - last > 30:
            last = time.monotonic()
            print(f"{PROG}: {i + 1}/{len(plan.prompts)} prompts, "
                  f"{counts.report()['mean_acceptance_length']:.3f} mean acceptance length",
                  flush=True)
    rep = counts.report()
    rep["seconds"] = round(time.monotonic() - t0, 1)
    rep["hf"] = {"device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    rep["outputs"] = outputs  # the greedy tokens: the loop is lossless
    return rep


def run_vllm(plan: Plan) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3_extract.drafter.serve_run import measured
    from eagle3_extract.engine.vllm_args import check_vllm_args, model_args, quiet_known_warnings
    from eagle3_extract.regenerate.generation import close_llm

    quiet_known_warnings()
    args = model_args(plan.engine, plan.model, plan.info, plan.verbose)
    args.update(check_vllm_args(plan.engine, fixed={}))
    k = int(plan.acceptance.num_speculative_tokens)
    args["speculative_config"] = {"method": "eagle3", "model": str(plan.drafter),
                                  "num_speculative_tokens": k}
    args["disable_log_stats"] = False
    llm = LLM(**args)
    try:
        t0 = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=int(plan.acceptance.max_tokens))
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in plan.prompts], params,
                            use_tqdm=False)
        out = measured(llm, outs, time.monotonic() - t0)
    finally:
        close_llm(llm)
    rep = _engine_report(k, out)
    rep["vllm"] = {"accepted_tokens": out["accepted_tokens"], "draft_tokens": out["draft_tokens"]}
    return rep


def _engine_report(k: int, out: dict[str, Any]) -> dict[str, Any]:
    """The report of a vLLM that ran the speculative decoding (serve_run.measured's dict):
    its own counts, per position."""
    counts = Counts(k)
    counts.prompts = len(out["outputs"])
    counts.generated = sum(len(o) for o in out["outputs"])
    counts.drafts = out["drafts"]
    counts.accepted = list(out["accepted_per_position"])
    rep = counts.report()
    rep["seconds"] = round(out["seconds"], 1)
    return rep


def run_serve(plan: Plan) -> dict[str, Any]:
    """The serving engine in its own environment (serve_run.py), greedy, on the same
    prompts; its own metrics are the counts."""
    from eagle3_extract.drafter.serving import run_serve_script

    k = int(plan.acceptance.num_speculative_tokens)
    request = {"target": plan.info.path, "drafter": str(plan.drafter), "k": k,
               "prompts": plan.prompts, "max_tokens": int(plan.acceptance.max_tokens),
               "dtype": str(plan.info.dtype).removeprefix("torch."),
               "max_model_len": int(plan.model.max_model_len),
               "trust_remote_code": bool(plan.model.trust_remote_code),
               "vllm_args": dict(plan.engine.get("vllm_args") or {}),
               # on a CPU: the KV cache these prompts need (target and drafter), twice over
               "kv_cache_bytes": max(2**30, 2 * (plan.info.kv_bytes_per_token or 2**16) * sum(
                   len(p) + int(plan.acceptance.max_tokens) + k + 1 for p in plan.prompts))}
    out = run_serve_script(plan.serve_python, request, plan.verbose)
    rep = _engine_report(k, out)
    rep["vllm_serve"] = {"vllm": out["vllm_version"], "python": plan.serve_python,
                         "accepted_tokens": out["accepted_tokens"],
                         "draft_tokens": out["draft_tokens"]}
    rep["outputs"] = out["outputs"]  # the greedy tokens: speculative decoding is lossless
    return rep


def run(cfg: Any) -> dict[str, Any]:
    plan = preflight(cfg)
    engine = str(cfg.engine.name)
    print(f"{PROG}: {len(plan.prompts)} prompts, {cfg.acceptance.num_speculative_tokens} "
          f"speculative tokens, engine={engine}, drafter {plan.drafter} (aux layers "
          f"{plan.aux_ids})", flush=True)
    if cfg.dry_run:
        print(f"{PROG}: dry run: preflight ok, nothing generated", flush=True)
        return {}
    if plan.done is not None:
        print(f"{PROG}: {plan.out / REPORT} is this measurement's report, made before: "
              "nothing generated", flush=True)
        return _verdict(cfg.acceptance, plan.out, plan.done)
    from eagle3_extract.manifest import write_run_json

    write_run_json(plan.out, plan.ident)  # before the report: the folder is this run's
    rep = {"hf": run_hf, "vllm": run_vllm, "vllm_serve": run_serve}[engine](plan)
    rep.update({"run_id": plan.ident["run_id"], "kind": PROG, "engine": engine, "drafter": str(plan.drafter),
                "aux_layer_ids": plan.aux_ids, "model": plan.info.path,
                "dataset": {"path": str(cfg.dataset.path), "max_samples": cfg.dataset.max_samples,
                            "seed": int(cfg.dataset.seed)},
                "max_tokens": int(cfg.acceptance.max_tokens),
                "train_record": plan.record})
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan.out / REPORT, rep)
    acceptance_chart([report_series(rep, engine)], plan.out / ACCEPTANCE_PNG,
                     f"{PROG}: {Path(str(plan.drafter)).name} on {Path(plan.info.path).name}",
                     f"{rep['prompts']} prompts, {rep['drafts']} drafts of "
                     f"{rep['num_speculative_tokens']} tokens, engine {engine}")
    return _verdict(cfg.acceptance, plan.out, rep)


def _verdict(acceptance: AcceptanceSettings, out: Path, rep: dict[str, Any]) -> dict[str, Any]:
    per = " / ".join(f"{a:.1%}" for a in rep["acceptance_per_position"])
    print(f"{PROG}: acceptance per position {per}; mean acceptance length "
          f"{rep['mean_acceptance_length']:.3f} over {rep['drafts']} drafts, "
          f"{rep['generated_tokens']} tokens in {rep['seconds']} s ({out / REPORT})",
          flush=True)
    first = rep["acceptance_per_position"][0]
    lo, hi = acceptance.min_first_position, acceptance.max_first_position
    if lo is not None and not first >= float(lo):
        raise JobError(f"first-position acceptance {first:.1%} is below "
                       f"acceptance.min_first_position={float(lo):.1%}", exit_code=1)
    if hi is not None and not first <= float(hi):
        raise JobError(f"first-position acceptance {first:.1%} is above "
                       f"acceptance.max_first_position={float(hi):.1%}", exit_code=1)
    assert not math.isnan(first)
    return rep


def _task(cfg: Any) -> None:
    from eagle3_extract.hydra_app import run_guarded

    run_guarded(PROG, run, cfg, "")


def main() -> None:
    from eagle3_extract.hydra_app import hydra_main

    hydra_main("acceptance", PROG, _task)


if __name__ == "__main__":
    main()
