"""`eagle3-train`: a drafter vLLM 0.16 serves, trained on an extraction by speculators 0.9.0.

A thin entry over a real trainer: our extraction is exported to speculators 0.9.0's layout
(export.py), its `speculators train` runs in its own environment (transformers 5, no vLLM;
`make venv-train`) through trainer_launch.py, and the checkpoint it saves is checked
against what vLLM 0.16's `Eagle3LlamaForCausalLM` loads before it is called a drafter.

What must hold for vLLM 0.16 to serve the drafter as it was trained:
- the aux layer ids in its config are the extraction's (our ids are vLLM's convention,
  so they go in as they are); exactly three of them (vLLM 0.16's fc takes 3 x hidden);
- the trainer's `norm_before_fc` and `norm_output` (speculators 0.9.0 defaults for
  EAGLE-3) are off: vLLM 0.16's llama_eagle3.py has neither, so a drafter trained with
  them would be served other features than it learned on;
- the draft layer attends to the whole sequence (vLLM 0.16 has no sliding window in it);
- every tensor name is one vLLM's loader knows (an unknown one is a KeyError at load).

Layout of output.dir: export/ (the trainer's input), checkpoints/ (the trainer's, which it
resumes from after a kill), drafter/ (config.json, model.safetensors, eagle3-train.json:
what produced it), train.log, run.json.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_extract.config import ConfigError, TrainSettings, project_python, validate_train
from eagle3_extract.errors import JobError, PreflightError
from eagle3_extract.drafter.checkpoint import CONFIG, WEIGHTS, drafter_problem
from eagle3_extract.drafter.export import ExportError, export, export_problem
from eagle3_extract.drafter.serving import check_servable, check_served_by, serving_engine
from eagle3_extract.layout import (D2T_NPY, EXPORT_JSON, T2D_NPY, TOKEN_FREQ_JSON, TRAIN_JSON, VOCAB_DIR,
                     atomic_write, remove_temps, temp_path)
from eagle3_extract.lock import ShardLock
from eagle3_extract.manifest import (check_run_json, file_sha256, with_run_id, write_json_atomic,
                       write_run_json)
from eagle3_extract.dataset.token_freq import draft_vocab
from eagle3_extract.check.run_dir import run_state

log = logging.getLogger("eagle3_extract")

PROG = "eagle3-train"
SPECULATORS_VERSION = "0.9.0"
EXPORT_DIR, CKPT_DIR, DRAFTER_DIR = "export", "checkpoints", "drafter"
RECORD = TRAIN_JSON
NUM_AUX = 3  # vLLM 0.16 llama_eagle3: fc input = 3 x target hidden size


@dataclass
class Plan:
    """What preflight established: the train group (not the job's whole config), the
    extraction it reads, the trainer it runs."""

    train: TrainSettings
    verbose: bool
    data: Path
    out: Path
    manifest: Any
    layer_ids: list[int]  # the extraction's, last = N
    served: list[int]  # into the drafter's config
    verifier: Path
    device: str
    trainer_versions: dict[str, str]
    identity: dict[str, Any]
    lock: ShardLock | None = None
    python: str = ""  # train.python, resolved (trainer_python)
    serve_python: str = ""  # train.serve_python, resolved, when it has a vLLM >= 0.18


def _trainer_versions(python: str) -> dict[str, str]:
    """Versions in the trainer's environment; one line when it is not there."""
    if not Path(python).exists() and not shutil.which(python):
        raise PreflightError(f"train.python={python!r} does not exist: build the trainer's "
                             "environment with `make venv-train` (or set EAGLE3_TRAIN_PYTHON)")
    probe = ("import importlib.metadata, json, torch, transformers, speculators; print(json.dumps({"
             "'speculators': importlib.metadata.version('speculators'), 'transformers': transformers.__version__,"
             " 'torch': torch.__version__, 'accelerator': torch.accelerator.is_available()}))")
    try:
        r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PreflightError(f"train.python={python!r} does not run: {e}") from None
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise PreflightError(f"train.python={python!r} cannot import speculators ({last}); "
                             "rebuild it with `make venv-train`")
    versions = json.loads(r.stdout.strip().splitlines()[-1])
    if versions["speculators"] != SPECULATORS_VERSION:
        raise PreflightError(f"train.python has speculators {versions['speculators']}; "
                             f"eagle3-train drives {SPECULATORS_VERSION} (make venv-train)")
    return versions


def _verifier_dir(m: Any) -> Path:
    """The target model the extraction ran, checked by its config hash, not by its name."""
    path = Path(str(m.model.get("resolved_path") or m.model.get("path")))
    if not (path / "config.json").is_file():
        raise PreflightError(f"the extraction's model {path} is not a local model dir; the "
                             "trainer loads the verifier's embeddings, norm and lm_head from it")
    want = m.model.get("config_sha256")
    if want and file_sha256(path / "config.json") != want:
        raise PreflightError(f"{path}/config.json is not the config the extraction ran "
                             "(sha256 differs): the data belongs to another model")
    return path


def preflight(cfg: Any) -> Plan:
    validate_train(cfg)
    data = Path(str(cfg.data.dir)).expanduser().resolve()
    out = Path(str(cfg.output.dir)).expanduser().resolve()
    if not data.is_dir():
        raise ConfigError(f"data.dir={str(data)!r} does not exist: give an extraction's output.dir")
    state = run_state(data)
    if state.why:
        raise PreflightError(f"data.dir={str(data)!r}: {state.why}; finish the extraction first")
    m = state.manifests[0]
    fmt = str(m.config["output"]["format"])
    if fmt != "safetensors":
        raise PreflightError(f"data.dir: output.format={fmt}; eagle3-train exports "
                             "output=safetensors extractions (extract again with it)")
    layer_ids = [int(i) for i in m.layer_ids]
    n = int(m.model["num_layers"])
    aux = layer_ids[:-1]
    if layer_ids[-1] != n:
        raise PreflightError(f"data.dir: layer ids {layer_ids} do not end with id {n} (the "
                             "final state): the trainer's targets come from it; extract again")
    if len(aux) != NUM_AUX:
        raise PreflightError(f"data.dir: {len(aux)} aux layers {aux}; vLLM 0.16 serves "
                             f"EAGLE-3 drafters with {NUM_AUX} (extract with 3 ids plus {n})")
    served = aux if cfg.train.served_layer_ids is None else [int(i) for i in cfg.train.served_layer_ids]
    if len(served) != NUM_AUX or not all(0 <= i < n for i in served):
        raise ConfigError(f"train.served_layer_ids={served} must be {NUM_AUX} ids in 0..{n - 1}")
    if served != aux:
        log.warning("train.served_layer_ids=%s differ from the extracted ids %s: the drafter "
                    "will be served other features than it is trained on", served, aux)
    verifier = _verifier_dir(m)
    python = project_python(str(cfg.train.python))
    versions = _trainer_versions(python)
    device = str(cfg.train.device)
    if device == "auto":
        device = "cuda" if versions["accelerator"] else "cpu"
    elif device == "cuda" and not versions["accelerator"]:
        raise PreflightError("train.device=cuda but the trainer's torch sees no GPU; "
                             "use train.device=cpu or auto")
    vocab = cfg.train.draft_vocab_size
    if vocab is not None and not (data / TOKEN_FREQ_JSON).is_file():
        raise PreflightError(f"train.draft_vocab_size={vocab}: {data}/token_freq.json is "
                             "missing (needed to rebuild the draft vocabulary)")
    if vocab is None and not (data / VOCAB_DIR / D2T_NPY).is_file():
        raise PreflightError(f"{data}/{VOCAB_DIR}/{D2T_NPY} is missing: set "
                             "train.draft_vocab_size to build it from token_freq.json")
    from omegaconf import OmegaConf

    settings = OmegaConf.to_container(cfg.train, resolve=True)
    for key in ("python", "device", "name"):
        settings.pop(key, None)
    identity = with_run_id({"kind": PROG, "data_run_id": m.run_id, "layer_ids": layer_ids,
                            "served_layer_ids": served, "train": settings})
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise ConfigError(f"output.dir={str(out)!r} is not writable")
    plan = Plan(cfg.train, bool(cfg.verbose), data, out, m, layer_ids, served, verifier, device, versions, identity,
                python=python, serve_python=serving_engine(cfg.train.serve_python,
                                                            m.model["architecture"]))
    plan.lock = ShardLock.acquire(out, (0, 1))
    try:
        check_run_json(out, identity)  # another run's drafter there: refused, one line
    except PreflightError:
        plan.lock.release()
        raise
    return plan


def _export(plan: Plan) -> Path:
    """The trainer's input: reused when it is this extraction's and every file re-hashes
    to export.json's record, else written anew."""
    dst = plan.out / EXPORT_DIR
    rec = dst / EXPORT_JSON
    if rec.is_file():
        try:
            old = json.loads(rec.read_text())
        except ValueError:
            old = {}
        if old.get("run_id") == plan.manifest.run_id and old.get("layer_ids") == plan.layer_ids:
            problem = export_problem(dst)
            if problem is None:
                return dst
            log.warning("the kept export is not whole (%s): exporting again", problem)
        shutil.rmtree(dst)
    elif dst.exists():
        shutil.rmtree(dst)  # a crash before export.json: not trusted
    try:
        export(plan.data, dst)
    except ExportError as e:
        raise PreflightError(str(e)) from None
    return dst


def _vocab(plan: Plan) -> tuple[Path, Path, int]:
    size = plan.train.draft_vocab_size
    src = plan.data / VOCAB_DIR
    if size is None:
        d2t = np.load(src / D2T_NPY)
        return src / D2T_NPY, src / T2D_NPY, len(d2t)
    freq = json.loads((plan.data / TOKEN_FREQ_JSON).read_text())
    target_vocab = int(json.loads((plan.verifier / "config.json").read_text())["vocab_size"])
    d2t, t2d = draft_vocab({int(k): v for k, v in freq["loss"].items()}, int(size), target_vocab)
    dst = plan.out / VOCAB_DIR
    dst.mkdir(exist_ok=True)
    for name, arr in ((D2T_NPY, d2t), (T2D_NPY, t2d)):
        with atomic_write(dst / name) as f:
            np.save(f, arr)
    return dst / D2T_NPY, dst / T2D_NPY, len(d2t)


def trainer_args(plan: Plan, export_dir: Path, d2t: Path, t2d: Path) -> list[str]:
    """`speculators train` flags, spelled as its CLI spells them."""
    t = plan.train
    args = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(plan.verifier),
            "--data-path", str(export_dir), "--save-path", str(plan.out / CKPT_DIR),
            "--log-dir", str(plan.out / "logs" / "trainer"),
            "--target-layer-ids", *map(str, plan.served),
            "--d2t-path", str(d2t), "--t2d-path", str(t2d),
            "--draft-arch", "llama", "--num-layers", str(t.num_layers),
            "--no-norm-before-fc", "--no-norm-output",
            "--full-attention-indices", *map(str, range(int(t.num_layers))),
            "--epochs", str(t.epochs), "--lr", str(t.lr), "--total-seq-len", str(t.total_seq_len),
            "--ttt-steps", str(t.ttt_steps), "--seed", str(t.seed),
            "--train-data-ratio", str(t.train_data_ratio)]
    if t.max_steps is not None:
        args += ["--max-steps", str(t.max_steps)]
    if json.loads((export_dir / EXPORT_JSON).read_text()).get("hidden_states") == "fp8":
        args += ["--hidden-states-backend", "fp8"]  # hs_connectors' FP8Transfer dequantizes
    if plan.device == "cpu":
        # no autocast on CPU: the bf16 states are read as float32, the dtype of the weights
        args += ["--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
                 "--hidden-states-dtype", "float32",
                 "--num-workers", "0"]
    return args + [str(a) for a in t.extra_args]


def _term_with_parent() -> None:
    """In the trainer (Linux): SIGTERM when eagle3-train dies, even by SIGKILL, so no
    trainer outlives it (speculators saves and stops on SIGTERM; a rerun resumes)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_trainer(plan: Plan, args: list[str]) -> None:
    launcher = Path(__file__).with_name("trainer_launch.py")
    logf = plan.out / "train.log"
    # -P: the launcher's own dir (this package, whose types.py would shadow the stdlib's)
    # stays off sys.path
    cmd = [plan.python or project_python(str(plan.train.python)), "-P", str(launcher), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # nothing of the vLLM environment leaks into the trainer's
    verbose = plan.verbose
    t0, last = time.monotonic(), 0.0
    with open(logf, "a") as f:
        f.write(f"\n# {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, start_new_session=True,
                                preexec_fn=_term_with_parent)
        try:
            for line in proc.stdout:
                f.write(line)
                if verbose:
                    sys.stdout.write(line)
                elif time.monotonic() - last > 30:
                    last = time.monotonic()
                    print(f"{PROG}: training ({_epochs_done(plan)}/{plan.train.epochs} "
                          f"epochs saved, {last - t0:.0f} s)", flush=True)
            rc = proc.wait()
        except BaseException:  # a signal (SIGTERM raises Interrupted, see run) or an error
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
    if rc:
        tail = [ln for ln in logf.read_text().splitlines() if ln.strip()][-1:]
        raise JobError(f"the trainer exited {rc}: {tail[0][:300] if tail else ''} "
                       f"(full log: {logf})", exit_code=1)


def _drop_damaged_checkpoints(plan: Plan) -> None:
    """An epoch checkpoint cut short (a kill, a full disk) and every later one are removed
    before the trainer resumes from the last: it redoes them, and nothing is published or
    resumed from a file that is not whole."""
    epochs = _epoch_dirs(plan)
    hidden = int(plan.manifest.model["hidden_size"])
    for k, epoch in enumerate(epochs):
        problem = drafter_problem(epoch, hidden)
        if problem:
            for later in epochs[k:]:
                shutil.rmtree(later)
            log.warning("epoch checkpoint %s is not whole (%s): removed with %d later; "
                        "the trainer redoes it", epoch.name, problem, len(epochs) - k - 1)
            return


def _epoch_dirs(plan: Plan) -> list[Path]:
    """The trainer's epoch checkpoints (checkpoints/<epoch>/), in epoch order."""
    ckpt = plan.out / CKPT_DIR
    return sorted((p for p in ckpt.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)) \
        if ckpt.is_dir() else []


def _epochs_done(plan: Plan) -> int:
    return len(_epoch_dirs(plan))


def _last_checkpoint(plan: Plan) -> Path:
    ckpt = plan.out / CKPT_DIR
    epochs = _epoch_dirs(plan)
    if not epochs or not (epochs[-1] / WEIGHTS).is_file():
        raise JobError(f"the trainer saved no checkpoint in {ckpt} (see {plan.out}/train.log)")
    return epochs[-1]


def _publish(plan: Plan, ckpt: Path, versions: dict[str, str], seconds: float) -> dict[str, Any]:
    """drafter/: the checkpoint checked, plus what produced it; written to a temp, renamed."""
    from safetensors import safe_open

    config = json.loads((ckpt / CONFIG).read_text())
    with safe_open(str(ckpt / WEIGHTS), "pt") as f:
        names = list(f.keys())
    check_servable(config, names, plan.served)
    dst = plan.out / DRAFTER_DIR
    remove_temps(dst)  # a killed run's (this job holds the directory's lock)
    tmp = temp_path(dst)  # a directory, renamed into place when whole
    tmp.mkdir()
    for name in (CONFIG, WEIGHTS):
        shutil.copy2(ckpt / name, tmp / name)
    served_by = check_served_by(plan.serve_python, tmp, config, plan.served)
    record = {
        "kind": PROG, "format": "speculators eagle3 (vLLM serves it as Eagle3LlamaForCausalLM)",
        "data": {"dir": str(plan.data), "run_id": plan.manifest.run_id,
                 "layer_ids": plan.layer_ids, "samples": (plan.manifest.counts or {}).get("written")},
        "served_layer_ids": plan.served,
        "verifier": {"path": str(plan.verifier), "architecture": plan.manifest.model["architecture"],
                     "num_layers": plan.manifest.model["num_layers"],
                     "config_sha256": plan.manifest.model.get("config_sha256")},
        "draft_vocab_size": config.get("draft_vocab_size"),
        "checkpoint": ckpt.name, "device": plan.device, "seconds": round(seconds, 1),
        "train": plan.identity["train"], "versions": versions,
        "model_sha256": hashlib.sha256((tmp / WEIGHTS).read_bytes()).hexdigest(),
        # the drafter as the serving engine read it (vLLM >= 0.18), or null: not checked there
        "served_by": served_by,
    }
    write_json_atomic(tmp / RECORD, record)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return record


def run(cfg: Any) -> dict[str, Any]:
    from eagle3_extract.errors import raise_interrupted

    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, raise_interrupted)  # the trainer is stopped, not orphaned
    plan = preflight(cfg)
    try:
        print(f"{PROG}: {plan.manifest.counts.get('written')} samples of {plan.data} -> "
              f"{plan.out}/{DRAFTER_DIR} (layers {plan.served}, {plan.device}, speculators "
              f"{plan.trainer_versions['speculators']})", flush=True)
        if cfg.dry_run:
            print(f"{PROG}: dry run: preflight ok, nothing trained", flush=True)
            return {}
        write_run_json(plan.out, plan.identity)
        export_dir = _export(plan)
        d2t, t2d, size = _vocab(plan)
        _drop_damaged_checkpoints(plan)
        if _epochs_done(plan) < int(plan.train.epochs):  # a rerun resumes from the last
            _run_trainer(plan, trainer_args(plan, export_dir, d2t, t2d))
        else:
            print(f"{PROG}: all {plan.train.epochs} epochs saved: not retrained", flush=True)
        ckpt = _last_checkpoint(plan)
        record = _publish(plan, ckpt, plan.trainer_versions, time.monotonic() - t0)
        print(f"{PROG}: drafter in {plan.out / DRAFTER_DIR} (epoch checkpoint {ckpt.name}, "
              f"draft vocab {size}, {record['seconds']} s)", flush=True)
        return record
    finally:
        plan.lock.release()


def _task(cfg: Any) -> None:
    from eagle3_extract.hydra_app import run_guarded

    run_guarded(PROG, run, cfg, "; rerun the same command to resume from the last epoch checkpoint")


def main() -> None:
    from eagle3_extract.hydra_app import hydra_main

    hydra_main("train", PROG, _task)


if __name__ == "__main__":
    main()
