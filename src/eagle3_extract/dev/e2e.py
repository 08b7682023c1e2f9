"""`make e2e`: the drafter check, end to end, with a control that must fail it.
Development only (CI and `make e2e`): no user command imports it.

regenerate (the target's answers to dataset=prompts) -> extract -> eagle3-train ->
eagle3-acceptance on held-out prompts (dataset=heldout, other topics), then the same chain
on data broken the way users break it: the states a tool counting layer *outputs* gets
from HF transformers' `output_hidden_states` (`hidden_states[k + 1]` for "layer k", and
`hidden_states[-1]` for the last layer, which HF returns after the final norm), with the
drafter served by vLLM's convention (id k = the stream entering layer k). Each step is its
own command with its own output dir under --out (so a rerun resumes each); the verdict
compares the two first-position acceptances and goes to <out>/e2e.json. Exit 1 when the
real drafter is below --min-first or the control is not far below it. `--fp8` adds the
same chain on `output=fp8` data (acceptance parity: the fp8 drafter may not fall more than
--fp8-drop below the bf16 one). `--curve 480,2000` adds the learning curve: the real
chain again on the first N regenerated samples for each N (the extraction's seeded order,
so each set holds the smaller ones), measured on the same held-out prompts; the reports
go to e2e.json and a chart to <out>/learning-curve.png. `--prompts FILE` regenerates a
larger prompt set (tools/make_prompts.py --large), and `--model-arg` / `--engine-arg` /
`--acceptance-arg` / `--train-arg` pass overrides through, so that the same chain runs on
a GPU (bench/device/steps/e2e.sh, through bench/device/gpu.py). `--compare-engine hf`
measures the real drafter with a second acceptance engine too (the serving engine's figure
beside vLLM 0.16's drafter arithmetic): one drafter, served alike by both.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from eagle3_extract.drafter.chart import acceptance_chart, report_series
from eagle3_extract.layout import ACCEPTANCE_JSON, MANIFEST_JSON, STATES_KEY
from eagle3_extract.manifest import write_json_atomic

TIMES: list[dict[str, Any]] = []  # each step this run: its output dir and wall seconds
CONTROL_MARK = "e2e_control"  # sample metadata: the last layer was replaced by its post-norm


# the chain's steps: the command each runs
STEPS = {"regenerate": "eagle3_extract.regenerate.job", "cli": "eagle3_extract.cli",
         "train": "eagle3_extract.drafter.train", "acceptance": "eagle3_extract.drafter.acceptance"}


class Lane:
    """Where a chain's steps run: the environment (its cores) and, beside other chains,
    a log file for their output instead of the console."""

    def __init__(self, env: dict[str, str] | None = None, log: Path | None = None):
        self.env, self.log = env, log

    def step(self, module: str, *overrides: str) -> None:
        cmd = [sys.executable, "-m", STEPS[module], *overrides]
        t = time.monotonic()
        where = f" (log {self.log})" if self.log else ""
        print(f"e2e: {module} {' '.join(overrides)}{where}", flush=True)
        if self.log:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log, "a") as f:
                r = subprocess.run(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT)
        else:
            r = subprocess.run(cmd, env=self.env)
        if r.returncode:
            raise SystemExit(f"e2e: {module} exited {r.returncode}{where}; fix it and rerun "
                             "(each step resumes)")
        took = round(time.monotonic() - t, 1)
        TIMES.append({"step": module, "out": next((o.split("=", 1)[1] for o in overrides
                                                   if o.startswith("output.dir=")), ""),
                      "seconds": took})
        print(f"e2e: {module} done in {took} s", flush=True)


def core_groups(n: int) -> list[dict[str, str]]:
    """The environments of n chains at once, each pinned to its share of this process's
    cores (vLLM's VLLM_CPU_OMP_THREADS_BIND, OpenMP's thread count): two torch processes
    spinning on the same cores run many times slower than one after the other."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    groups = ([cores[k * len(cores) // n:(k + 1) * len(cores) // n] for k in range(n)]
              if len(cores) >= n else [[cores[k % len(cores)]] for k in range(n)])
    return [{**os.environ, "OMP_NUM_THREADS": str(len(g)),
             "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, g))} for g in groups]


def control_layer_ids(layer_ids: list[int]) -> tuple[list[int], list[int]]:
    """(ids to extract, ids to serve): each aux id read as 'the output of layer k', i.e.
    our id k + 1, while the drafter is served vLLM's id k; the final state stays id N."""
    aux, last = layer_ids[:-1], layer_ids[-1]
    shifted = [i + 1 for i in aux]
    if max(shifted) >= last:
        raise SystemExit(f"e2e: aux ids {aux} leave no room for a shifted control below {last}")
    return shifted + [last], aux


def post_norm_last_layer(root: Path) -> int:
    """Replace each sample's last layer (id N, before the final norm) by the final norm's
    output, as HF's `hidden_states[-1]` is; files already done are skipped (marked in
    their metadata), each rewritten whole through a temp file. Returns files rewritten."""
    import os

    import torch
    from safetensors import safe_open

    from eagle3_extract.layout import sample_temp
    from eagle3_extract.safetensors_file import save_safetensors

    manifest = json.loads((root / MANIFEST_JSON).read_text())
    model = Path(manifest["model"]["resolved_path"])
    eps = float(json.loads((model / "config.json").read_text()).get("rms_norm_eps", 1e-6))
    weight = None
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if "model.norm.weight" in st.keys():
                weight = st.get_tensor("model.norm.weight")
    if weight is None:
        raise SystemExit(f"e2e: {model} has no model.norm.weight (a Llama-style final norm)")
    done = 0
    for path in sorted((root / "data").rglob("*.safetensors")):
        with safe_open(str(path), "pt") as st:
            meta = st.metadata() or {}
            if meta.get(CONTROL_MARK):
                continue
            tensors = {k: st.get_tensor(k) for k in st.keys()}
        hs = tensors[STATES_KEY]
        last = hs[:, -1].float()
        normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps)
        hs[:, -1] = weight.to(hs.dtype) * normed.to(hs.dtype)  # HF LlamaRMSNorm's order
        tmp = sample_temp(path)
        save_safetensors(tensors, tmp, {**meta, CONTROL_MARK: "last layer after the final norm"})
        os.replace(tmp, path)
        done += 1
    return done


def use_regenerated(src: Path, sha256: str, samples: int, dest: Path) -> None:
    """An earlier regeneration as this chain's: its conversations.jsonl checked against the
    hash it is pinned by, then its first --samples rows (it must hold that many) copied with
    its manifest.json (the tokenizer identity extraction checks) into <out>/regenerated. The
    answers are the target's own either way; CI pins one set so that the drafter check
    does not regenerate on every landing (tests/test_regenerate.py checks regeneration
    against vLLM's generate)."""
    import hashlib
    import shutil

    from eagle3_extract.dataset.regenerated import CONVERSATIONS
    from eagle3_extract.layout import temp_path

    conv = src / CONVERSATIONS
    if not conv.is_file() or not (src / MANIFEST_JSON).is_file():
        raise SystemExit(f"e2e: --regenerated {src} needs {CONVERSATIONS} and {MANIFEST_JSON} "
                         "(an eagle3-regenerate output dir)")
    data = conv.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise SystemExit(f"e2e: {conv} has sha256 {got}, not the pinned {sha256}: restore it "
                         "(git checkout) or pin the new set's hash")
    lines = data.splitlines(keepends=True)
    if len(lines) < samples:
        raise SystemExit(f"e2e: {conv} holds {len(lines)} conversations, fewer than --samples "
                         f"{samples}")
    dest.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dest / CONVERSATIONS)
    tmp.write_bytes(b"".join(lines[:samples]))
    tmp.replace(dest / CONVERSATIONS)
    tmp = temp_path(dest / MANIFEST_JSON)
    shutil.copyfile(src / MANIFEST_JSON, tmp)
    tmp.replace(dest / MANIFEST_JSON)
    print(f"e2e: regenerated set {src} (its first {samples} of {len(lines)} conversations, "
          f"sha256 {got[:12]}...)", flush=True)
    TIMES.append({"step": "regenerated", "out": str(dest), "seconds": 0.0})


def model_args(args: argparse.Namespace) -> list[str]:
    """The target model and engine overrides every step that runs the target takes."""
    return [f"model={args.model}", *args.model_args, *args.engine_args]


def extract(out: Path, args: argparse.Namespace, kind: str, layers: list[str],
            lane: Lane) -> Path:
    conv = out / "regenerated" / "conversations.jsonl"
    ext = out / f"extract-{kind}"
    lane.step("cli", *model_args(args), "dataset=local", f"dataset.path={conv}",
              f"output.dir={ext}", *layers, *args.extract_args)
    if kind == "control":
        n = post_norm_last_layer(ext)
        print(f"e2e: control: the last layer of {n} sample files replaced by its post-norm "
              "state (HF hidden_states[-1])", flush=True)
    return ext


def train_and_measure(out: Path, args: argparse.Namespace, kind: str, served: list[str],
                      lane: Lane) -> dict[str, Any]:
    ext, drafter = out / f"extract-{kind}", out / f"drafter-{kind}"
    lane.step("train", f"data.dir={ext}", f"train={args.train}", f"output.dir={drafter}",
              *served, *args.train_args)
    return measure(out, args, kind, lane)


def measure(out: Path, args: argparse.Namespace, kind: str, lane: Lane,
            engine: str | None = None) -> dict[str, Any]:
    """eagle3-acceptance of a chain's drafter on the held-out prompts: with the
    --acceptance-arg engine, or with `engine` in its place (into acceptance-<kind>-<engine>)."""
    acc = out / (f"acceptance-{kind}-{engine}" if engine else f"acceptance-{kind}")
    overrides = [a for a in args.acceptance_args if not (engine and a.startswith("engine="))]
    lane.step("acceptance", *model_args(args), f"drafter.dir={out / f'drafter-{kind}' / 'drafter'}",
              f"dataset.max_samples={args.heldout}",
              f"acceptance.max_tokens={args.acceptance_tokens or args.max_tokens}",
              f"output.dir={acc}", *overrides, *([f"engine={engine}"] if engine else []))
    return json.loads((acc / ACCEPTANCE_JSON).read_text())


def run_chains(out: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The real chain, the control and fp8 (as asked), `args.jobs` of them at once once the
    real extraction (whose layer ids the control shifts) is done."""
    from concurrent.futures import ThreadPoolExecutor

    extract(out, args, "real", [], Lane())  # on every core, before the others
    plans: dict[str, tuple[list[str], list[str]]] = {"real": ([], [])}
    if not args.no_control:
        manifest = json.loads((out / "extract-real" / MANIFEST_JSON).read_text())
        extract_ids, served_ids = control_layer_ids(manifest["layer_ids"])
        plans["control"] = (
            ["layers=explicit", f"layers.ids=[{','.join(map(str, extract_ids))}]"],
            [f"train.served_layer_ids=[{','.join(map(str, served_ids))}]"])
    if args.fp8:  # same answers, seeds and trainer settings: only the stored dtype differs
        plans["fp8"] = (["output=fp8"], [])
    for n in args.curve:  # the first n of the same regenerated set, same trainer settings
        plans[f"curve-{n}"] = ([f"dataset.max_samples={n}"], [])
    names = list(plans)
    jobs = max(1, min(args.jobs, len(names)))
    slots: queue.Queue = queue.Queue()
    for env in (core_groups(jobs) if jobs > 1 else [None]):
        slots.put(env)

    def one(name: str) -> dict[str, Any]:
        layers, served = plans[name]
        env = slots.get()  # a free core group: a chain never shares its cores
        try:
            lane = Lane(env, out / "logs" / f"{name}.log") if env else Lane()
            if name != "real":
                extract(out, args, name, layers, lane)
            report = train_and_measure(out, args, name, served, lane)
            if name == "real" and args.compare_engine:  # the same drafter, another engine
                report = {**report, "compared": measure(out, args, name, lane,
                                                        args.compare_engine)}
            return report
        finally:
            slots.put(env)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {name: pool.submit(one, name) for name in names}
        try:
            return {name: f.result() for name, f in futures.items()}
        except BaseException:  # a failed chain: the ones not started yet never start
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="a model config group (tiny, smollm2, ...)")
    ap.add_argument("--samples", type=int, default=480, help="prompts to regenerate and train on")
    ap.add_argument("--heldout", type=int, default=160, help="held-out prompts to measure on")
    ap.add_argument("--max-tokens", type=int, default=128, help="per answer and per measured prompt")
    ap.add_argument("--acceptance-tokens", type=int, default=None, metavar="N",
                    help="tokens generated per held-out prompt when measuring (default "
                         "--max-tokens): the first N of each answer")
    ap.add_argument("--train", default="small", help="a train config group")
    ap.add_argument("--min-first", type=float, default=None,
                    help="fail when the real drafter's first-position acceptance is below")
    ap.add_argument("--control-ratio", type=float, default=0.5,
                    help="with --min-first: fail when the control's first-position acceptance "
                         "is above this fraction of the real one's")
    ap.add_argument("--no-control", action="store_true")
    ap.add_argument("--fp8", action="store_true",
                    help="also extract with output=fp8, train and measure the same way")
    ap.add_argument("--fp8-drop", type=float, default=0.03,
                    help="with --fp8 and --min-first: fail when the fp8 drafter's "
                         "first-position acceptance is more than this below the real one's")
    ap.add_argument("--jobs", type=int, default=1,
                    help="chains (real, control, fp8) run at once after the real extraction, "
                         "each pinned to its share of the cores; their output goes to "
                         "<out>/logs/<chain>.log")
    ap.add_argument("--out", type=Path, default=None, help="default outputs/e2e/<model>")
    ap.add_argument("--curve", type=lambda v: sorted({int(x) for x in v.split(",")}),
                    default=[], metavar="N,N,...",
                    help="also train and measure on the first N regenerated samples, each N")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="a .jsonl of prompts to regenerate (default: dataset=prompts)")
    ap.add_argument("--regenerated", type=Path, default=None, metavar="DIR",
                    help="train on this earlier regeneration (DIR/conversations.jsonl with "
                         "its manifest.json) instead of regenerating; needs "
                         "--regenerated-sha256")
    ap.add_argument("--regenerated-sha256", default=None, metavar="HEX",
                    help="the sha256 --regenerated's conversations.jsonl must have")
    ap.add_argument("--compare-engine", default=None, metavar="ENGINE",
                    help="also measure the real drafter with this acceptance engine (e.g. hf "
                         "beside engine=vllm_serve); fail when the first-position acceptances "
                         "differ by more than --compare-tolerance")
    ap.add_argument("--compare-tolerance", type=float, default=0.05)
    ap.add_argument("--extract-arg", dest="extract_args", action="append", default=[])
    ap.add_argument("--train-arg", dest="train_args", action="append", default=[])
    ap.add_argument("--model-arg", dest="model_args", action="append", default=[],
                    help="to regenerate, extract and acceptance (e.g. model.path=DIR)")
    ap.add_argument("--engine-arg", dest="engine_args", action="append", default=[],
                    help="to regenerate, extract and acceptance (engine settings)")
    ap.add_argument("--acceptance-arg", dest="acceptance_args", action="append", default=[],
                    help="to eagle3-acceptance only (e.g. engine=vllm)")
    args = ap.parse_args(argv)
    if any(n >= args.samples or n < 1 for n in args.curve):
        ap.error(f"--curve sizes must be between 1 and --samples ({args.samples}) exclusive")
    if (args.regenerated is None) != (args.regenerated_sha256 is None):
        ap.error("--regenerated and --regenerated-sha256 go together (a set is trusted by "
                 "its hash, not its name)")
    if args.regenerated is not None and args.prompts is not None:
        ap.error("--regenerated replaces the regeneration: leave out --prompts")
    out = (args.out or Path("outputs/e2e") / args.model).resolve()
    t0 = time.monotonic()
    prompts = (["dataset=local", f"dataset.path={args.prompts.resolve()}"] if args.prompts
               else ["dataset=prompts"])
    if args.regenerated is not None:
        use_regenerated(args.regenerated, args.regenerated_sha256, args.samples,
                        out / "regenerated")
    else:
        Lane().step("regenerate", *model_args(args), *prompts,
                    f"dataset.max_samples={args.samples}",
                    f"generate.max_tokens={args.max_tokens}", f"output.dir={out / 'regenerated'}")
    reports = run_chains(out, args)
    real = reports["real"]
    result: dict[str, Any] = {"model": args.model, "samples": args.samples,
                              "heldout": args.heldout, "max_tokens": args.max_tokens,
                              "acceptance_tokens": args.acceptance_tokens or args.max_tokens,
                              "train": args.train, "real": real,
                              "jobs": args.jobs}
    problems = []
    first = real["acceptance_per_position"][0]
    if args.min_first is not None and first < args.min_first:
        problems.append(f"real drafter: first-position acceptance {first:.1%} < {args.min_first:.1%}")
    compared = real.pop("compared", None)
    if compared is not None:  # one drafter, two engines: the same acceptance within noise
        result["compared"] = {"engine": args.compare_engine, "real": compared}
        other = compared["acceptance_per_position"][0]
        if abs(other - first) > args.compare_tolerance:
            problems.append(f"real drafter: first-position acceptance {first:.1%} served by "
                            f"{real.get('engine')}, {other:.1%} by {args.compare_engine}: more "
                            f"than {args.compare_tolerance:.1%} apart")
    if "control" in reports:
        manifest = json.loads((out / "extract-real" / MANIFEST_JSON).read_text())
        extract_ids, served_ids = control_layer_ids(manifest["layer_ids"])
        control = reports["control"]
        result["control"] = control
        result["control_layers"] = {"extracted": extract_ids, "served": served_ids}
        c_first = control["acceptance_per_position"][0]
        if args.min_first is not None and c_first > args.control_ratio * first:
            problems.append(f"control: first-position acceptance {c_first:.1%} is not below "
                            f"{args.control_ratio:g} x the real {first:.1%}")
    if "fp8" in reports:
        fp8 = reports["fp8"]
        result["fp8"] = fp8
        f_first = fp8["acceptance_per_position"][0]
        if args.min_first is not None and f_first < first - args.fp8_drop:
            problems.append(f"fp8: first-position acceptance {f_first:.1%} is more than "
                            f"{args.fp8_drop:.1%} below the bf16 drafter's {first:.1%}")
    if args.curve:
        result["curve"] = {str(n): reports[f"curve-{n}"] for n in args.curve}
        result["curve"][str(args.samples)] = real
        series = [report_series(r, f"{n} samples") for n, r in result["curve"].items()]
        if "fp8" in reports:
            series.append(report_series(reports["fp8"], f"{args.samples} samples, fp8"))
        acceptance_chart(series, out / "learning-curve.png",
                         f"acceptance by training-set size: {args.model}",
                         f"{args.heldout} held-out prompts, train={args.train}")
    result["problems"] = problems
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["steps"] = TIMES  # this run's (a resumed step counts only what was left)
    write_json_atomic(out / "e2e.json", result)
    if compared is not None:
        reports[f"real ({args.compare_engine})"] = compared
    for name in ("real", f"real ({args.compare_engine})", "control", "fp8",
                 *(f"curve-{n}" for n in args.curve)):
        if name in reports:
            r = reports[name]
            per = " / ".join(f"{a:.1%}" for a in r["acceptance_per_position"])
            print(f"e2e: {name:7s} acceptance per position {per}, mean acceptance length "
                  f"{r['mean_acceptance_length']:.3f} ({r['drafts']} drafts)", flush=True)
    for p in problems:
        print(f"e2e: FAIL: {p}", file=sys.stderr, flush=True)
    print(f"e2e: {'failed' if problems else 'passed'} in {result['seconds']} s ({out / 'e2e.json'})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
