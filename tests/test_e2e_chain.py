"""`make e2e`'s orchestration (dev/e2e.py run_chains): the chains run in order after the
real extraction, and a chain that fails stops the ones not started yet, so a broken step
is reported at once rather than after every other chain has spent its (GPU) time."""

from __future__ import annotations

import argparse

import pytest

from eagle3_extract.dev import e2e


def _args(**kw) -> argparse.Namespace:
    base = dict(no_control=True, fp8=False, curve=[480, 2000], jobs=1, compare_engine=None)
    return argparse.Namespace(**{**base, **kw})


def test_a_failed_chain_stops_the_chains_not_started(monkeypatch, tmp_path):
    ran: list[str] = []
    monkeypatch.setattr(e2e, "extract", lambda out, args, kind, layers, lane: ran.append(f"x-{kind}"))

    def measure(out, args, kind, served, lane):
        ran.append(f"m-{kind}")
        if kind == "real":
            raise SystemExit("e2e: acceptance exited 2")
        return {"kind": kind}

    monkeypatch.setattr(e2e, "train_and_measure", measure)
    with pytest.raises(SystemExit, match="acceptance exited 2"):
        e2e.run_chains(tmp_path, _args())
    assert ran == ["x-real", "m-real"]  # neither curve chain started


def test_the_chains_run_in_order_and_all_report(monkeypatch, tmp_path):
    ran: list[str] = []
    monkeypatch.setattr(e2e, "extract", lambda out, args, kind, layers, lane: ran.append(f"x-{kind}"))
    monkeypatch.setattr(e2e, "train_and_measure",
                        lambda out, args, kind, served, lane: ran.append(f"m-{kind}") or {"k": kind})
    reports = e2e.run_chains(tmp_path, _args())
    assert list(reports) == ["real", "curve-480", "curve-2000"]
    assert ran == ["x-real", "m-real", "x-curve-480", "m-curve-480", "x-curve-2000", "m-curve-2000"]


def test_the_real_drafter_alone_is_measured_again_by_the_compare_engine(monkeypatch, tmp_path):
    """--compare-engine: the real chain's drafter measured by a second acceptance engine
    (its own output dir, that engine in place of --acceptance-arg's), the others once."""
    ran: list[tuple] = []
    monkeypatch.setattr(e2e, "extract", lambda out, args, kind, layers, lane: None)
    monkeypatch.setattr(e2e, "train_and_measure",
                        lambda out, args, kind, served, lane: {"engine": "vllm_serve"})
    monkeypatch.setattr(e2e.Lane, "step", lambda self, module, *o: ran.append((module, *o)))
    acc = tmp_path / "acceptance-real-hf"
    acc.mkdir()
    (acc / "acceptance.json").write_text('{"engine": "hf"}')
    args = _args(curve=[480], compare_engine="hf", model="tiny", model_args=[], engine_args=[],
                 acceptance_args=["engine=vllm_serve", "acceptance.num_speculative_tokens=3"],
                 heldout=4, acceptance_tokens=8, max_tokens=8)
    reports = e2e.run_chains(tmp_path, args)
    assert reports["real"] == {"engine": "vllm_serve", "compared": {"engine": "hf"}}
    assert "compared" not in reports["curve-480"]
    (step,) = ran
    assert step[0] == "acceptance" and f"output.dir={acc}" in step
    assert "engine=hf" in step and "engine=vllm_serve" not in step
    assert "acceptance.num_speculative_tokens=3" in step


def test_a_pinned_regeneration_is_taken_by_its_hash_and_cut_to_samples(tmp_path):
    """--regenerated: the set is trusted by its sha256, not its name; its first --samples
    rows become the chain's answers, with the manifest extraction checks the tokenizer by."""
    import hashlib
    import json

    src = tmp_path / "set"
    src.mkdir()
    rows = [json.dumps({"messages": [{"role": "user", "content": str(i)}]}) + "\n"
            for i in range(5)]
    (src / "conversations.jsonl").write_text("".join(rows))
    (src / "manifest.json").write_text('{"kind": "eagle3-regenerate"}')
    pin = hashlib.sha256("".join(rows).encode()).hexdigest()
    dest = tmp_path / "out" / "regenerated"
    e2e.use_regenerated(src, pin, 3, dest)
    assert (dest / "conversations.jsonl").read_text() == "".join(rows[:3])
    assert json.loads((dest / "manifest.json").read_text())["kind"] == "eagle3-regenerate"
    assert sorted(p.name for p in dest.iterdir()) == ["conversations.jsonl", "manifest.json"]
    with pytest.raises(SystemExit, match="not the pinned"):
        e2e.use_regenerated(src, "0" * 64, 3, dest)
    with pytest.raises(SystemExit, match="fewer than --samples 6"):
        e2e.use_regenerated(src, pin, 6, dest)
    (src / "manifest.json").unlink()
    with pytest.raises(SystemExit, match="needs conversations.jsonl and manifest.json"):
        e2e.use_regenerated(src, pin, 3, dest)


def test_the_committed_regeneration_is_the_pinned_one():
    """The drafter check's answers (tests/fixtures/e2e-smollm2) hash to what the check pins,
    hold at least its samples, and carry SmolLM2's tokenizer identity."""
    import hashlib
    import json

    import test_gpu_rehearsal as check

    conv = check.REGENERATED / "conversations.jsonl"
    assert hashlib.sha256(conv.read_bytes()).hexdigest() == check.REGENERATED_SHA256
    assert len(conv.read_text().splitlines()) >= int(check.CHECK["SAMPLES"])
    manifest = json.loads((check.REGENERATED / "manifest.json").read_text())
    assert manifest["kind"] == "eagle3-regenerate" and manifest["model"]["path"] == "smollm2"
    assert manifest["identity"]["model"]["vocab_sha256"]
