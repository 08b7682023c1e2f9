"""`eagle3-verify DIR [key=value ...]`: recompute K samples independently and compare.

`eagle3-validate` proves the files are consistent; only a second computation
proves the numbers are the right ones (right layer, right sample, right rows).
K random samples (seeded) are re-extracted from the input ids on disk by:

- `hf`: the HF transformers reference engine (engine/hf.py: one sample per
  forward, hooks on the HF decoder layers), every layer id;
- `vllm-aux`: vLLM 0.16's own EAGLE-3 aux-hidden-state path
  (`set_aux_hidden_state_layers`, Llama / Qwen2 / Qwen3): the state a drafter
  receives when vLLM serves it. It appends `hidden_states + residual` before
  running layer idx, so it cannot give id N (the final pre-norm state): only
  ids < N are compared with it.

Per sample and layer id, the per-token relative error ||a - b|| / ||b|| of the
data against the reference must stay within the dtype's bounds on its median,
mean and max over tokens (`TOLERANCES`). The input ids are also re-derived from
the dataset (seeded order, chat template) when it is readable, so a file that
holds another sample's tokens is caught too. The cheap parts of
`eagle3-validate` run first (check/files.py: file tree, counts, and the per-file checks
of the K chosen files: metadata, run_id, rows, NaN); `eagle3-validate` checks them all.
The references themselves are check/reference.py.

The model and dataset come from the manifest's config; Hydra-style overrides
(`model.path=/new/place`, `engine.device=cpu`) apply on top when they moved.
Exit 0 only when every compared sample is within tolerance. The report also
goes to `DIR/verify_report.json` (atomic write).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from eagle3_extract.config import DatasetConfig, ModelConfig
from eagle3_extract.entry import command
from eagle3_extract.layout import Storage
from eagle3_extract.manifest import Manifest
from eagle3_extract.quant import states_of
from eagle3_extract.types import Sample
from eagle3_extract.check.run_dir import load_sample, run_state
from eagle3_extract.check.reference import REFERENCES, Reference, VerifyError, is_moe
from eagle3_extract.check.files import (
    check_counts,
    ChecksumTally,
    check_file,
    expectation,
    print_items,
    scan_tree,
    write_report,
)

REPORT_NAME = "verify_report.json"
DEFAULT_SAMPLES = 8


@dataclass(frozen=True)
class Tol:
    """Bounds on the per-token relative error of one sample at one layer id."""

    median: float
    mean: float
    max: float

    def ok(self, median: float, mean: float, mx: float) -> bool:
        return median <= self.median and mean <= self.mean and mx <= self.max


# float32 and bfloat16 dense: the measured vLLM-vs-HF bounds of tests/test_engine_vllm.py
# (tiny Llama / Qwen3, every layer id; observed bf16 mean <= 0.023). float16: bfloat16
# scaled by its 8x finer mantissa (not measured: the CPU build has no float16 path).
TOLERANCES = {
    "float32": Tol(1e-4, 1e-4, 1e-3),
    "float16": Tol(0.01, 0.01, 0.05),
    "bfloat16": Tol(0.04, 0.04, 0.16),
}
# MoE in 16-bit: a bf16 near-tie in the router sends some tokens to another expert
# and attention spreads that to later tokens, so the mean and max are loose (tiny
# random DeepseekV3: mean up to 0.14 per sample at id 8, max 1.3). Most tokens are
# untouched, so the median stays tight (<= 0.033 there) while a layer shifted by
# one is off at every token (median >= 0.40): the median is what catches it.
MOE_TOLERANCES = {
    "float32": TOLERANCES["float32"],
    "float16": Tol(0.05, 0.30, math.inf),
    "bfloat16": Tol(0.05, 0.30, math.inf),
}
# fp8-stored data (output.dtype=fp8): e4m3's rounding on top of the model dtype's bounds.
# Measured on the real SmolLM2-135M (bf16, ids 2/15/27/30, two chat samples): per-token
# relative error of the dequantized states median 0.023-0.026, max 0.045 (per token and
# layer scales: 0.021-0.023, max 0.031). A layer shifted by one stays >= 0.40 at the median.
FP8_ROUNDING = Tol(0.035, 0.035, 0.08)
# ... and lm_head(final_norm(dequantized id N)) agrees with the model's next token at
# 0.96-0.97 of positions there (0.27 for the pre-norm state without the norm).
FP8_ARGMAX = 0.90
# The final state through the model's own final norm and lm_head against its own logits:
# the least share of positions whose next token (argmax) must agree, per dtype. A wrong
# final layer, a missing or doubled norm, or a shifted row drops it far below (the real
# SmolLM2-135M: 0.99 right, 0.18 without the norm).
LOGITS_ARGMAX = {"float32": 0.999, "float16": 0.98, "bfloat16": 0.97, "fp8": FP8_ARGMAX}
# A position whose argmax differs still agrees when it is a near-tie: the reference's own
# logit for the token picked lies within TIE_BAND x the dtype's median state tolerance x
# the RMS of the reference's logits there. Random weights with a large vocabulary give flat
# logits: a Llama-3-8B shape (4 layers, 128k vocabulary, vLLM's CUDA kernels on the H200)
# flipped 4.6% of positions in bf16 with its states within 1.7% of HF's. A wrong state's
# flips lie far outside the band (tests/test_verify.py, tests/test_exports.py).
TIE_BAND = 3.0


# --- configuration --------------------------------------------------------------------


def build_config(manifest: Manifest, overrides: list[str]) -> Any:
    """The run's config from the manifest, typed by the job's schema, plus overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from eagle3_extract.config import Config

    bad = [o for o in overrides if "=" not in o or o.startswith(("+", "~"))]
    if bad:
        raise VerifyError(f"overrides must be key=value (e.g. model.path=/models/x): {bad}")
    try:
        if manifest.config is None:
            raise KeyError("config")
        return OmegaConf.merge(OmegaConf.structured(Config), manifest.config,
                               OmegaConf.from_dotlist(list(overrides)))
    except (KeyError, OmegaConfBaseException) as e:
        raise VerifyError(f"cannot build the run's config from the manifest: {e}") from e


def tolerance(dtype: str, moe: bool, storage: Storage = Storage()) -> Tol:
    """The model dtype's bounds; fp8-stored data adds e4m3's rounding (FP8_ROUNDING)."""
    table = MOE_TOLERANCES if moe else TOLERANCES
    if dtype not in table:
        raise VerifyError(f"no tolerance for dtype {dtype!r} (known: {sorted(table)})")
    t = table[dtype]
    if storage.fp8:
        f = FP8_ROUNDING
        t = Tol(t.median + f.median, t.mean + f.mean, t.max + f.max)
    return t


# --- references -----------------------------------------------------------------------


# --- comparison -----------------------------------------------------------------------


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T, L] per-token relative error of `got` against `ref`; NaN/Inf count as inf."""
    a, b = got.float(), ref.float()
    err = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)
    return torch.nan_to_num(err, nan=math.inf, posinf=math.inf)


def compare(index: int, disk: torch.Tensor, ref: torch.Tensor, cols: list[int],
            ids: list[int], tol: Tol, source: str) -> tuple[dict, list[str]]:
    """Per-layer errors of one sample against one reference; failure messages."""
    sub = disk[:, cols]
    if sub.shape != ref.shape:
        return {}, [f"sample {index}: {source}: data {tuple(sub.shape)} vs reference "
                    f"{tuple(ref.shape)} (rows must equal tokens)"]
    err = rel_err(sub, ref)
    per_layer, fails = {}, []
    for j, k in enumerate(ids):
        e = err[:, j]
        med, mean, mx = float(e.median()), float(e.mean()), float(e.max())
        per_layer[str(k)] = {"median": _r(med), "mean": _r(mean), "max": _r(mx)}
        if not tol.ok(med, mean, mx):
            fails.append(f"sample {index}: layer {k}: {source} rel err median {med:.3g} mean "
                         f"{mean:.3g} max {mx:.3g} > tolerance ({tol.median:g}, {tol.mean:g}, "
                         f"{tol.max:g})")
    return per_layer, fails


def _r(x: float) -> float | str:
    return round(x, 6) if math.isfinite(x) else "inf"


def dataset_check(ds: DatasetConfig, model: ModelConfig, info: Any,
                  samples: dict[int, Sample]) -> dict[str, Any]:
    """Re-derive the chosen samples' tokens and loss masks from the dataset itself.

    Catches a file that holds another sample's tokens (index mix-up). Skipped,
    with the reason, when the dataset or tokenizer cannot be read here.
    """
    try:
        from eagle3_extract.config import max_length
        from eagle3_extract.dataset.render import Renderer
        from eagle3_extract.dataset.samples import load_tokenizer, seeded_order, tokenize_rows
        from eagle3_extract.dataset.rows import read_nonempty

        rows = read_nonempty(ds)
        order = seeded_order(len(rows), int(ds.seed), bool(ds.shuffle), ds.max_samples)
        renderer = Renderer(load_tokenizer(info.tokenizer_path, bool(model.trust_remote_code)))
    except Exception as e:  # noqa: BLE001 - reported, not fatal: the states still compare
        return {"checked": 0, "skipped": f"{type(e).__name__}: {str(e)[:300]}", "failures": []}
    fails = []
    for index, s in samples.items():
        if index >= len(order):
            fails.append(f"sample {index}: beyond the dataset's {len(order)} selected rows")
            continue
        t = tokenize_rows(rows, [order[index]], renderer, max_length(ds, model), str(ds.overlong),
                          max_row_bytes=getattr(ds, "max_row_bytes", None))
        if len(t) != 1:
            fails.append(f"sample {index}: the dataset row is now skipped ({t.report['skipped']})")
            continue
        want = t.sample(0)
        if list(want.input_ids) != list(s.input_ids):
            fails.append(f"sample {index}: input_ids differ from dataset row {order[index]} "
                         f"({len(s)} vs {len(want)} tokens): another sample, or the dataset "
                         "or chat template changed")
        elif list(want.loss_mask) != list(s.loss_mask):
            fails.append(f"sample {index}: loss_mask differs from the dataset's")
    return {"checked": len(samples), "failures": fails}


# --- driver ---------------------------------------------------------------------------


def _load(path: Path, fmt: str, index: int, num_layers: int) -> tuple[Sample, torch.Tensor]:
    """The sample as stored (tokens, mask) and its states [T, L, H]; ValueError if misshapen."""
    t, _ = load_sample(path, fmt)
    sample = Sample(index, t["input_ids"].tolist(), t["loss_mask"].tolist())
    states = states_of(t)  # fp8: dequantized, float32
    if states.dim() != 3 or states.shape[0] != len(sample) or states.shape[1] != num_layers:
        raise ValueError(f"hidden_states {tuple(states.shape)} for {len(sample)} tokens and "
                         f"{num_layers} layers (rows must equal tokens)")
    return sample, states


def _model(model: ModelConfig, man: Manifest) -> tuple[Any, list[str]]:
    """The model the overrides point at, checked against the one the data came from."""
    from eagle3_extract.engine import inspect_model

    try:
        info = inspect_model(model)
    except (ValueError, OSError) as e:
        msg = str(e) if "model.path" in str(e) else f"model.path={model.path!r}: {e}"
        raise VerifyError(f"{msg} (override model.path=... if the model moved)") from e
    want = man.model
    if (info.num_layers, info.hidden_size) != (want["num_layers"], want["hidden_size"]):
        raise VerifyError(f"{info.path} has {info.num_layers} layers x {info.hidden_size}, the "
                          f"data was made with {want['num_layers']} x {want['hidden_size']}")
    warnings = []
    if want.get("config_sha256") and info.config_sha256 != want["config_sha256"]:
        warnings.append(f"{info.path}/config.json differs from the one recorded in the manifest")
    dtype = str(info.dtype).removeprefix("torch.")
    if dtype != want["dtype"]:
        warnings.append(f"reference dtype {dtype}, data dtype {want['dtype']}")
    return info, warnings


def _choose(root: Path, manifests: list[Manifest], samples: int, seed: int
            ) -> tuple[dict[int, tuple[Sample, torch.Tensor]], list[int], list[str]]:
    """Pick K files (seeded); run validate's tree, count and per-file checks on them."""
    exp, problems = expectation(manifests)
    if exp is None:
        raise VerifyError(f"{root}: {problems[-1].message if problems else 'bad manifest'}")
    found, tree = scan_tree(root, exp.fmt, exp.files_per_dir)
    if not found:
        raise VerifyError(f"{root}: no sample files")
    chosen = sorted(random.Random(seed).sample(sorted(found), min(samples, len(found))))
    problems += tree + check_counts(root, manifests, exp, found)
    for i in chosen:
        problems += check_file(root, i, found[i], exp, ChecksumTally())[1]
    failures = [f"{p.where}: {p.code}: {p.message}" for p in problems]
    loaded: dict[int, tuple[Sample, torch.Tensor]] = {}
    for i in chosen:
        try:
            loaded[i] = _load(found[i], exp.fmt, i, len(exp.layer_ids))
        except Exception as e:  # noqa: BLE001 - an unreadable file is a finding
            failures.append(f"sample {i}: {found[i].relative_to(root)}: not compared: "
                            f"{type(e).__name__}: {str(e)[:200]}")
    return loaded, chosen, failures


def verify(root: str | Path, overrides: list[str] | None = None, samples: int = DEFAULT_SAMPLES,
           seed: int = 0, references: list[str] | None = None,
           built: list[Reference] | None = None,
           tol: dict[str, float] | None = None) -> dict[str, Any]:
    """Verify `root`; return the report.

    `references`: names to run ("hf", "vllm-aux"; None = each that supports the
    model); or `built`: reference objects to use (reused across calls, not closed).
    `tol`: bounds that replace the dtype's defaults, e.g. {"mean": 0.05}.
    """
    t0 = time.perf_counter()
    root = Path(root).resolve()
    state = run_state(root, check_links=False)
    manifests, problems = state.manifests, state.problems
    if not manifests:
        raise VerifyError(f"{root}: {problems[0].message if problems else 'no manifest'}")
    # (stale manifests of an earlier shard layout are eagle3-validate's to report)
    man = manifests[0]
    cfg = build_config(man, list(overrides or []))
    layer_ids = [int(k) for k in man.layer_ids]
    info, warnings = _model(cfg.model, man)
    moe = is_moe(info.path)
    storage = man.storage
    tols = replace(tolerance(man.model["dtype"], moe, storage),
                   **{k: v for k, v in (tol or {}).items() if v is not None})
    loaded, chosen, failures = _choose(root, manifests, samples, seed)
    report: dict[str, Any] = {
        "tool": "eagle3-verify", "dir": str(root), "run_id": man.run_id,
        "model": info.path, "architecture": info.architecture, "moe": moe,
        "dtype": man.model["dtype"], "layer_ids": layer_ids, "samples": chosen,
        "seed": seed, "tolerance": {"median": tols.median, "mean": tols.mean, "max": _r(tols.max)},
        "data_engine": (man.engine or {}).get("name"), "references": {},
    }
    report["dataset"] = dataset_check(cfg.dataset, cfg.model, info, {i: s for i, (s, _) in loaded.items()})
    failures += report["dataset"]["failures"]

    if references and sorted(set(references) - set(REFERENCES)):
        raise VerifyError(f"unknown reference in {references}: choose from {sorted(REFERENCES)}")
    for ref in built if built is not None else (references or list(REFERENCES)):
        name = ref if isinstance(ref, str) else ref.name
        if name == report["data_engine"]:
            warnings.append(f"reference {name} is the engine that wrote this data: not an "
                            "independent check")
        if isinstance(ref, str):
            try:
                ref = REFERENCES[name](cfg.engine, cfg.model, info, layer_ids)
            except (VerifyError, ImportError) as e:
                if references:  # asked for by name: it must run
                    raise VerifyError(f"reference {name}: {e}") from e
                report["references"][name] = {"skipped": str(e)}
                continue
            owned = True
        else:
            owned = False
        try:
            report["references"][name] = _run_reference(ref, loaded, layer_ids, tols, failures)
            if name == "hf":
                report["logits"] = logits_check(
                    ref.engine.model, loaded, layer_ids, info.num_layers,
                    "fp8" if storage.fp8 else man.model["dtype"], failures, tols.median)
        finally:
            if owned:
                ref.close()
    if not any("per_layer" in r for r in report["references"].values()):
        failures.append("no reference could run: nothing was compared")
    report.update(warnings=warnings, failures=failures, ok=not failures,
                  seconds=round(time.perf_counter() - t0, 3))
    return report


def logits_check(model: torch.nn.Module, loaded: dict[int, tuple[Sample, torch.Tensor]],
                 layer_ids: list[int], num_layers: int, dtype: str,
                 failures: list[str], tie_rel: float = 0.0) -> dict[str, Any]:
    """Does the stored final state (id N, pre-norm) reproduce the model's own logits?

    What every trainer computes its targets with: lm_head(final_norm(state N)). Compared
    with the model's logits on the same token ids: argmax agreement, near-ties within
    TIE_BAND x `tie_rel` counted as agreeing (>= LOGITS_ARGMAX of the dtype), and the
    relative logit error.
    """
    if num_layers not in layer_ids:
        return {"skipped": f"layer id {num_layers} (the final state) was not extracted"}
    col = layer_ids.index(num_layers)
    norm = getattr(model.get_decoder(), "norm", None)
    head = model.get_output_embeddings()
    if norm is None or head is None:
        return {"skipped": f"{type(model).__name__} has no final norm / lm_head to apply"}
    device = next(model.parameters()).device
    agree = ties = total = 0
    errs = []
    with torch.no_grad():
        for index, (sample, disk) in loaded.items():
            ids = torch.tensor([sample.input_ids], device=device)
            want = model(input_ids=ids, use_cache=False).logits[0].float()
            state = disk[:, col].to(device=device, dtype=head.weight.dtype)
            got = head(norm(state)).float()
            picked, best = got.argmax(-1, keepdim=True), want.argmax(-1, keepdim=True)
            same = (picked == best)[:, 0]
            gap = (want.gather(-1, best) - want.gather(-1, picked))[:, 0]
            band = TIE_BAND * tie_rel * want.pow(2).mean(-1).sqrt()
            agree += int(same.sum())
            ties += int((~same & (gap <= band)).sum())
            total += len(want)
            errs.append(((got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-6)).mean())
    share = (agree + ties) / total if total else 0.0
    need = LOGITS_ARGMAX.get(dtype, LOGITS_ARGMAX["bfloat16"])
    if share < need:
        failures.append(f"logits: lm_head(final_norm(layer {num_layers})) agrees with the "
                        f"model's own next token at {share:.3f} of positions (near-ties "
                        f"included), < {need} (wrong final layer, a missing or doubled norm, "
                        "or shifted rows)")
    return {"agreement": round(share, 4), "argmax_agreement": round(agree / max(total, 1), 4),
            "near_ties": ties, "tie_band": round(TIE_BAND * tie_rel, 4), "required": need,
            "tokens": total,
            "relative_error_mean": _r(float(torch.stack(errs).mean())) if errs else None}


def _run_reference(ref: Reference, loaded: dict[int, tuple[Sample, torch.Tensor]],
                   layer_ids: list[int], tol: Tol,
                   failures: list[str]) -> dict[str, Any]:
    """Compare every loaded sample with one reference; per-layer mean/max over all."""
    cols = [layer_ids.index(k) for k in ref.layer_ids]
    t0 = time.perf_counter()
    per_sample: dict[str, Any] = {}
    errs: list[torch.Tensor] = []
    for index, (sample, disk) in loaded.items():
        ref_states = ref.states([sample])[0]
        per_layer, fails = compare(index, disk, ref_states, cols, ref.layer_ids, tol, ref.name)
        per_sample[str(index)] = per_layer
        failures += fails
        if per_layer:
            errs.append(rel_err(disk[:, cols], ref_states))
    summary: dict[str, Any] = {"layer_ids": ref.layer_ids, "per_sample": per_sample,
                               "seconds": round(time.perf_counter() - t0, 3)}
    if errs:
        e = torch.cat(errs)
        summary["per_layer"] = {str(k): {"median": _r(float(e[:, j].median())),
                                         "mean": _r(float(e[:, j].mean())),
                                         "max": _r(float(e[:, j].max()))}
                                for j, k in enumerate(ref.layer_ids)}
    else:
        summary["per_layer"] = {}
    return summary


def print_report(report: dict[str, Any], out=None, limit: int = 40) -> None:
    out = out or sys.stdout
    print(f"eagle3-verify {report['dir']}: {'OK' if report['ok'] else 'FAIL'}", file=out)
    print(f"  {len(report['samples'])} samples {report['samples']} (seed {report['seed']}), "
          f"{report['architecture']}{' (MoE)' if report['moe'] else ''}, {report['dtype']}, "
          "tolerance: " + ", ".join(f"{k} {v}" for k, v in report["tolerance"].items()),
          file=out)
    ds = report["dataset"]
    print("  dataset tokens: " + (f"skipped ({ds['skipped']})" if "skipped" in ds else
                                  f"{ds['checked']} samples re-tokenized"), file=out)
    for name, r in report["references"].items():
        if "skipped" in r:
            print(f"  {name}: skipped: {r['skipped']}", file=out)
            continue
        print(f"  {name}: per-token relative error by layer id (median / mean / max):",
              file=out)
        for k, v in r["per_layer"].items():
            print(f"    {k:>4}: {v['median']} / {v['mean']} / {v['max']}", file=out)
    lg = report.get("logits")
    if lg:
        print("  logits of the final state: " + (f"skipped ({lg['skipped']})" if "skipped" in lg
              else f"agreement {lg['agreement']} (>= {lg['required']}; argmax "
                   f"{lg['argmax_agreement']} and {lg['near_ties']} near-ties within "
                   f"{lg['tie_band']} x the logits' RMS), relative error "
                   f"{lg['relative_error_mean']}"), file=out)
    for kind in ("warnings", "failures"):
        print_items(kind, [str(f) for f in report[kind]], limit, out)


@command("eagle3-verify")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="eagle3-verify",
        description="Re-extract K random samples of an extraction with independent code "
                    "(HF transformers; vLLM's EAGLE-3 aux path) and compare per layer; "
                    "exit 0 only when all are within the dtype's tolerance.")
    ap.add_argument("dir", help="the extraction directory (output.dir)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. "
                                                 "model.path=/models/llama engine.device=cpu")
    ap.add_argument("--samples", "-k", type=int, default=DEFAULT_SAMPLES,
                    help=f"samples to recompute (default {DEFAULT_SAMPLES})")
    ap.add_argument("--seed", type=int, default=0, help="which samples (default 0)")
    ap.add_argument("--reference", action="append", choices=sorted(REFERENCES),
                    help="run only this reference (repeatable); default: every one that "
                         "supports the model")
    for stat in ("median", "mean", "max"):
        ap.add_argument(f"--tol-{stat}", type=float, default=None,
                        help=f"override the bound on the {stat} per-token relative error")
    ap.add_argument("--no-report", action="store_true", help=f"do not write DIR/{REPORT_NAME}")
    args = ap.parse_intermixed_args(argv)  # options before or after the overrides
    report = verify(args.dir, args.overrides, args.samples, args.seed, args.reference,
                    tol={"median": args.tol_median, "mean": args.tol_mean, "max": args.tol_max})
    print_report(report)
    if not args.no_report:
        path = write_report(Path(args.dir), REPORT_NAME, report)
        if path:
            print(f"  report: {path}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
