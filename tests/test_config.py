"""Hydra config: groups compose, the schema rejects typos and wrong types, values checked."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3_extract.config import ASSETS, ConfigError, conf_dir, max_length, validate


def cfg_for(*overrides: str, hydra: bool = False):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def test_defaults(monkeypatch):
    monkeypatch.delenv("EAGLE3_OUTPUT_ROOT", raising=False)
    c = cfg_for()
    assert (c.model.name, c.model.path, c.model.tiny_config) == ("tiny", "tiny", "llama")
    assert (c.layers.name, c.layers.ids) == ("eagle3", None)
    assert c.dataset.name == "sample"
    assert c.dataset.path == str(ASSETS / "sample" / "conversations.jsonl")
    assert (c.output.format, c.output.files_per_dir) == ("safetensors", 10000)
    assert c.engine.name == "vllm"
    assert c.output.dir == "outputs/tiny/sample/eagle3"
    assert max_length(c.dataset, c.model) == c.model.max_model_len - 1
    validate(c)


@pytest.mark.parametrize("group,option,check", [
    ("model", "kimi_k25_int4", lambda c: c.model.path == "moonshotai/Kimi-K2.5"
     and c.model.tensor_parallel_size == 8 and c.model.trust_remote_code is True),
    ("model", "llama3_1_8b", lambda c: c.model.path == "meta-llama/Llama-3.1-8B-Instruct"),
    ("model", "qwen3_8b", lambda c: c.model.path == "Qwen/Qwen3-8B"),
    ("dataset", "sharegpt", lambda c: c.dataset.path == "anon8231489123/ShareGPT_Vicuna_unfiltered"
     and c.dataset.data_files == "ShareGPT_V3_unfiltered_cleaned_split.json"),
    ("dataset", "ultrachat", lambda c: c.dataset.path == "HuggingFaceH4/ultrachat_200k"
     and c.dataset.split == "train_sft"),
    ("output", "speculators_pt", lambda c: c.output.format == "speculators_pt"
     and not c.output.dir.endswith("pt")),
    ("engine", "hf", lambda c: c.engine.name == "hf"),
])
def test_every_group_option_composes_and_validates(group, option, check):
    c = cfg_for(f"{group}={option}")
    assert check(c)
    validate(c)
    OmegaConf.to_container(c, resolve=True, throw_on_missing=True)


def test_output_dir_follows_model_dataset_layers(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_OUTPUT_ROOT", str(tmp_path))
    c = cfg_for("model=qwen3_8b", "layers=explicit", "layers.ids=[1,3,5]", "dataset=local",
                "dataset.path=/data/My Chats.jsonl")
    assert c.output.dir == f"{tmp_path}/qwen3_8b/local-My_Chats/ids1-3-5"
    c = cfg_for("layers.ids=[2,4]")  # default group, custom ids: the name says so
    assert c.output.dir == f"{tmp_path}/tiny/sample/ids2-4"
    c = cfg_for("model.path=/models/Llama-3.1-8B", "output.dir=/x/y")
    assert c.model.name == "Llama-3.1-8B" and c.output.dir == "/x/y"


def test_hydra_run_and_sweep_dirs_live_under_output_dir(tmp_path):
    c = cfg_for(f"output.dir={tmp_path}/out", hydra=True)
    assert c.hydra.run.dir.startswith(f"{tmp_path}/out/logs/")
    subdir = OmegaConf.to_container(c.hydra.sweep)["subdir"]  # job.num is set per job
    assert subdir.startswith("${eagle3.logdir:${output.dir}}/")
    assert c.hydra.job.chdir is False


def test_typo_in_a_key_fails_naming_it():
    with pytest.raises(ConfigCompositionException, match="model.pth"):
        cfg_for("model.pth=/x")
    with pytest.raises(ConfigCompositionException, match="dataset.max_sample"):
        cfg_for("dataset.max_sample=3")


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(ConfigCompositionException, match="dataset.max_samples"):
        cfg_for("dataset.max_samples=many")
    with pytest.raises(ConfigCompositionException, match="layers.ids"):
        cfg_for("layers.ids=[1,x]")


def test_unknown_group_option_lists_the_choices():
    with pytest.raises(MissingConfigException, match="kimi_k25_int4"):
        cfg_for("model=kimi")


def test_explicit_layers_need_ids():
    c = cfg_for("layers=explicit")
    with pytest.raises(OmegaConfBaseException, match="layers.ids"):
        OmegaConf.to_container(c, resolve=True, throw_on_missing=True)
    assert cfg_for("layers=explicit", "layers.ids=[1,3]").layers.ids == [1, 3]


@pytest.mark.parametrize("override,key", [
    ("dataset.overlong=drop", "dataset.overlong"),
    ("output.format=npz", "output.format"),
    ("engine.name=sglang", "engine.name"),
    ("dataset.max_length=2048", "dataset.max_length"),  # > model.max_model_len - 1
    ("dataset.max_length=0", "dataset.max_length"),
    ("shard.index=2", "shard.index"),
    ("shard.count=0", "shard.count"),
    ("engine.token_budget=0", "engine.token_budget"),
    ("output.files_per_dir=0", "output.files_per_dir"),
    ("dataset.max_samples=0", "dataset.max_samples"),
])
def test_value_checks_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg_for(override))


def test_conf_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_CONF_DIR", str(tmp_path))
    assert conf_dir() == tmp_path.resolve()
    monkeypatch.delenv("EAGLE3_CONF_DIR")
    assert (conf_dir() / "config.yaml").is_file()


def _presets() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("preset", _presets())
def test_every_experiment_preset_composes_and_validates(preset):
    c = cfg_for(f"experiment={preset}")
    validate(c)
    OmegaConf.to_container(c, resolve=True, throw_on_missing=True)


def test_kimi_k25_chat_is_the_headline_job():
    assert "kimi_k25_chat" in _presets()
    c = cfg_for("experiment=kimi_k25_chat")
    assert (c.model.name, c.model.tensor_parallel_size, c.model.pipeline_parallel_size,
            c.model.trust_remote_code) == ("kimi_k25_int4", 1, 8, True)  # layout=pp8
    for layout, sizes in {"tp8": (8, 1), "tp4_pp2": (4, 2), "tp2_pp4": (2, 4)}.items():
        o = cfg_for("experiment=kimi_k25_chat", f"layout={layout}")
        assert (o.model.tensor_parallel_size, o.model.pipeline_parallel_size) == sizes
        validate(o)
    assert (c.layers.name, c.layers.ids) == ("eagle3", None)  # default EAGLE-3 layers
    assert c.dataset.max_length == c.model.max_model_len - 1
    assert c.engine.token_budget >= c.dataset.max_length


def test_a_sweep_runs_every_job_it_can_and_lists_the_failed(tmp_path):
    """`-m` over three values: a wrong layer id (the job's one line, exit 2) and a value
    of the wrong type (Hydra's composition) fail alone; the others run; the failed jobs
    are listed one line each at the end and the sweep exits non-zero."""
    import subprocess

    from test_job import BIN, COMMON, env

    r = subprocess.run([str(BIN), "-m", "engine=hf", *COMMON, f"hydra.sweep.dir={tmp_path}/m",
                        "layers.ids=[2,4,8],[2,4,99],[1,2,3]",
                        f"output.dir={tmp_path}/out-${{layers.name}}"],
                       env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stdout.count("done: ") == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    tail = r.stderr.strip().splitlines()[-2:]
    assert tail[0].endswith("1 of 3 sweep jobs failed:") and "layers.ids=[2,4,99]" in tail[1]
    assert "out of range" in tail[1], tail
    r = subprocess.run([str(BIN), "-m", "engine=hf", *COMMON[1:], f"hydra.sweep.dir={tmp_path}/n",
                        "dataset.max_samples=2,abc,3",
                        f"output.dir={tmp_path}/n-${{dataset.max_samples}}"],
                       env=env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stdout.count("done: ") == 2, r.stderr[-3000:]
    lines = [x for x in r.stderr.strip().splitlines() if "extract:" not in x or "sweep" in x]
    assert lines[-2].endswith("1 of 3 sweep jobs failed:"), lines
    assert "dataset.max_samples=abc" in lines[-1] and "could not be converted" in lines[-1]
    assert "Traceback" not in r.stderr


def test_the_trainers_python_resolves_from_the_project_not_the_cwd(tmp_path, monkeypatch):
    import shutil

    from eagle3_extract.config import project_dir
    from eagle3_extract.config import project_python

    monkeypatch.chdir(tmp_path)
    assert project_python(".venv-train/bin/python") == str(project_dir() / ".venv-train/bin/python")
    assert (project_dir() / "conf" / "train.yaml").is_file()
    assert project_python("/opt/venv-train/bin/python") == "/opt/venv-train/bin/python"
    assert project_python("python3") == shutil.which("python3")


@pytest.mark.parametrize("prog,config", [("eagle3-extract", "config"),
                                         ("eagle3-regenerate", "regenerate"),
                                         ("eagle3-train", "train"),
                                         ("eagle3-acceptance", "acceptance")])
def test_every_group_option_a_help_text_names_exists(prog, config):
    """`--help` examples name config options: each `group=option` there must exist
    (eagle3-train's named train=smoke, which does not)."""
    import re

    from omegaconf import OmegaConf

    text = OmegaConf.to_yaml(OmegaConf.load(conf_dir() / f"{config}.yaml")["hydra"]["help"])
    named = set(re.findall(r"(?<![\w.])([a-z_]+)=([A-Za-z0-9_]+)\b", text))
    groups = [(g, o) for g, o in named if (conf_dir() / g).is_dir()]
    assert groups, text
    for group, option in groups:
        assert (conf_dir() / group / f"{option}.yaml").is_file(), f"{prog} --help: {group}={option}"


def test_every_command_shares_one_hydra_config():
    """Run dir, sweep dirs, chdir and the sweeper are conf/hydra/eagle3.yaml's; a root
    config holds only its own help text and job name."""
    for name in ("config", "regenerate", "train", "acceptance"):
        root = OmegaConf.load(conf_dir() / f"{name}.yaml")
        assert {"hydra": "eagle3"} in [OmegaConf.to_container(d) if OmegaConf.is_config(d)
                                       else d for d in root.defaults], name
        assert set(root.hydra) <= {"help", "job"} and set(root.hydra.job) == {"name"}, name
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            h = compose(name, overrides={"train": ["data.dir=/x"],
                                         "acceptance": ["drafter.dir=/y"]}.get(name, []),
                        return_hydra_config=True).hydra
        assert h.sweeper._target_.endswith("KeepGoingSweeper") and h.job.chdir is False
        assert OmegaConf.to_container(h.run)["dir"].startswith("${eagle3.logdir:${output.dir}}")
