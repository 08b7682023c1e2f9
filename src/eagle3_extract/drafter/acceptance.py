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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.drafter.checkpoint import CONFIG, WEIGHTS, drafter_problem
from eagle3_extract.drafter.chart import acceptance_chart, report_series
from eagle3_extract.config import validate_acceptance
from eagle3_extract.errors import JobError, PreflightError
from eagle3_extract.layout import ACCEPTANCE_JSON, ACCEPTANCE_PNG, TRAIN_JSON
from eagle3_extract.manifest import write_json_atomic

log = logging.getLogger("eagle3_extract")

PROG = "eagle3-acceptance"
REPORT = ACCEPTANCE_JSON
TRAIN_RECORD = TRAIN_JSON


# --- the drafter, as vLLM 0.16's Eagle3LlamaForCausalLM computes it -----------------------


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
        if rope.get("rope_type", "default") != "default" or tl.get("rope_scaling"):
            raise PreflightError(f"{path}: rope {rope} is not implemented by the hf loop; "
                                 "measure with engine=vllm")
        w = {k: v.to(device) for k, v in load_file(str(path / WEIGHTS)).items()}
        self.w = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in w.items()}
        self.embed = self.w.get("embed_tokens.weight", target_embed.to(dtype))
        d2t = self.w.get("d2t")
        size = self.w["lm_head.weight"].shape[0]
        self.to_target = (torch.arange(size, device=device) + d2t) if d2t is not None else None
        theta = float(rope["rope_theta"])
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, device=device,
                                                     dtype=torch.float32) / self.head_dim)
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
        cos, sin = emb.cos().to(x.dtype)[None], emb.sin().to(x.dtype)[None]
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


# --- the loop ---------------------------------------------------------------------------


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


# --- the job ------------------------------------------------------------------------------


@dataclass
class Plan:
    cfg: Any
    info: Any
    drafter: Path
    out: Path
    prompts: list[list[int]]
    eos: set[int]
    aux_ids: list[int]
    record: dict[str, Any] | None
    ident: dict[str, Any]
    done: dict[str, Any] | None  # this run's own report, found whole in output.dir


def _prompts(cfg: Any, tokenizer: Any) -> list[list[int]]:
    """Each row's conversation up to its last user turn, with the generation prompt."""
    from eagle3_extract.dataset.render import Renderer
    from eagle3_extract.dataset.messages import SkipRow, to_messages
    from eagle3_extract.dataset.samples import seeded_order
    from eagle3_extract.dataset.rows import read_nonempty

    renderer = Renderer(tokenizer)
    rows = read_nonempty(cfg.dataset)
    order = seeded_order(len(rows), int(cfg.dataset.seed), bool(cfg.dataset.shuffle),
                         cfg.dataset.max_samples)
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
        raise PreflightError(f"dataset.path={cfg.dataset.path!r}: no usable prompt "
                             f"({skipped} rows skipped)")
    if skipped:
        log.warning("%d rows skipped (no usable prompt)", skipped)
    return prompts


def run_identity(cfg: Any, info: Any, drafter: Path) -> dict[str, Any]:
    """What determines the report: the target and the drafter by their bytes, the prompts,
    the measurement and the engine. The pass/fail thresholds are checks on a report, not
    part of it: a rerun with other thresholds reads the same report back."""
    from omegaconf import OmegaConf

    from eagle3_extract.manifest import file_sha256, with_run_id

    def plain(node: Any) -> Any:
        return OmegaConf.to_container(node, resolve=True)

    measure = {k: v for k, v in plain(cfg.acceptance).items()
               if k not in ("min_first_position", "max_first_position")}
    return with_run_id({
        "kind": PROG,
        "model": {"config_sha256": file_sha256(Path(info.path) / "config.json"),
                  "max_model_len": int(cfg.model.max_model_len)},
        "drafter": {"model_sha256": file_sha256(drafter / WEIGHTS),
                    "config_sha256": file_sha256(drafter / CONFIG)},
        "dataset": plain(cfg.dataset), "acceptance": measure, "engine": plain(cfg.engine)})


def own_report(out: Path, ident: dict[str, Any]) -> dict[str, Any] | None:
    """`out`'s report if it is this run's (a rerun: `make e2e` reruns every step); None
    if `out` holds no report yet. Refused in one line: a report of another run, or a
    folder that is not an acceptance output at all. The report names its own run id, so
    it is trusted by its content, never by its name or by what lies beside it."""
    from eagle3_extract.extract.job import check_writable
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
        from eagle3_extract.engine.vllm import check_vllm_args

        check_vllm_args(cfg, fixed={})
    tokenizer = load_tokenizer(info.tokenizer_path, bool(cfg.model.trust_remote_code),
                               info.vocab_size)
    prompts = _prompts(cfg, tokenizer)
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
    ident = run_identity(cfg, info, drafter)
    return Plan(cfg, info, drafter, out, prompts, {int(e) for e in eos_ids}, aux, record,
                ident, own_report(out, ident))


def _device(cfg: Any) -> torch.device:
    want = str(cfg.engine.device)
    if want in ("auto", ""):
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def run_hf(plan: Plan) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    cfg = plan.cfg
    device = _device(cfg)
    dtype = getattr(torch, str(cfg.acceptance.hf_dtype))
    target = AutoModelForCausalLM.from_pretrained(plan.info.path, dtype=dtype,
                                                  attn_implementation="sdpa").to(device).eval()
    embed = target.get_input_embeddings().weight.detach()
    drafter = Drafter(plan.drafter, embed, device, dtype)
    loop = HFLoop(target, drafter, int(cfg.acceptance.num_speculative_tokens), plan.eos)
    counts = Counts(int(cfg.acceptance.num_speculative_tokens))
    t0 = last = time.monotonic()
    for i, prompt in enumerate(plan.prompts):
        out = loop.generate(prompt, int(cfg.acceptance.max_tokens), counts)
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
    return rep


def run_vllm(plan: Plan) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3_extract.engine.vllm import check_vllm_args, model_args, quiet_known_warnings
    from eagle3_extract.regenerate.generation import close_llm

    cfg = plan.cfg
    quiet_known_warnings()
    args = model_args(cfg, plan.info)
    args.update(check_vllm_args(cfg, fixed={}))
    k = int(cfg.acceptance.num_speculative_tokens)
    args["speculative_config"] = {"method": "eagle3", "model": str(plan.drafter),
                                  "num_speculative_tokens": k}
    args["disable_log_stats"] = False
    llm = LLM(**args)
    try:
        t0 = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=int(cfg.acceptance.max_tokens))
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in plan.prompts], params,
                            use_tqdm=False)
        seconds = time.monotonic() - t0
        metrics = {m.name: m for m in llm.get_metrics()}
    finally:
        close_llm(llm)
    counts = Counts(k)
    counts.prompts = len(outs)
    counts.generated = sum(len(o.outputs[0].token_ids) for o in outs)
    counts.drafts = int(metrics["vllm:spec_decode_num_drafts"].value)
    counts.accepted = [int(v) for v in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values]
    rep = counts.report()
    rep["seconds"] = round(seconds, 1)
    rep["vllm"] = {"accepted_tokens": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
                   "draft_tokens": int(metrics["vllm:spec_decode_num_draft_tokens"].value)}
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
        return _verdict(cfg, plan.out, plan.done)
    from eagle3_extract.manifest import write_run_json

    write_run_json(plan.out, plan.ident)  # before the report: the folder is this run's
    rep = run_hf(plan) if engine == "hf" else run_vllm(plan)
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
    return _verdict(cfg, plan.out, rep)


def _verdict(cfg: Any, out: Path, rep: dict[str, Any]) -> dict[str, Any]:
    per = " / ".join(f"{a:.1%}" for a in rep["acceptance_per_position"])
    print(f"{PROG}: acceptance per position {per}; mean acceptance length "
          f"{rep['mean_acceptance_length']:.3f} over {rep['drafts']} drafts, "
          f"{rep['generated_tokens']} tokens in {rep['seconds']} s ({out / REPORT})",
          flush=True)
    first = rep["acceptance_per_position"][0]
    lo, hi = cfg.acceptance.min_first_position, cfg.acceptance.max_first_position
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
