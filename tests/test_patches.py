"""The patch series and the program that applies it (the Dockerfile runs the same)."""

from __future__ import annotations

import base64
import csv
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_extract import patching

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"


def record_hashes(dist_info: Path) -> dict[str, str]:
    """sha256 (hex) of each file as shipped in the wheel, from its RECORD."""
    out = {}
    with open(dist_info / "RECORD") as f:
        for row in csv.reader(f):
            if len(row) >= 2 and row[1].startswith("sha256="):
                raw = base64.urlsafe_b64decode(row[1][7:] + "==")
                out[row[0]] = raw.hex()
    return out


@pytest.fixture
def fresh_target(tmp_path) -> Path:
    """A pristine speculators 0.3.0 install, proven pristine against its RECORD.

    Rebuilt from the (patched) install in this environment by reversing the
    series, so the test needs no network.
    """
    src_root = patching.default_target()
    target = tmp_path / "site"
    target.mkdir()
    shutil.copytree(src_root / "speculators", target / "speculators",
                    ignore=shutil.ignore_patterns("__pycache__", "_eagle3_patches.json"))
    (dist_info,) = src_root.glob("speculators-0.3.0.dist-info")
    shutil.copytree(dist_info, target / dist_info.name)
    for p in reversed(patching.read_series(PATCHES)):
        subprocess.run(["patch", "-R", "-p1", "-s", "-d", str(target), "-i", str(p)], check=True)
    shipped = record_hashes(target / dist_info.name)
    for f in {f for p in patching.read_series(PATCHES) for f in patching.targets(p)}:
        assert hashlib.sha256((target / f).read_bytes()).hexdigest() == shipped[f], f
    return target


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "eagle3_extract.patching", *args],
                          capture_output=True, text=True, env=env)


def file_hashes(target: Path) -> dict[str, str]:
    files = {f for p in patching.read_series(PATCHES) for f in patching.targets(p)}
    return {f: hashlib.sha256((target / f).read_bytes()).hexdigest() for f in files}


def test_series_lists_exactly_the_patch_files_each_with_a_header():
    series = patching.read_series(PATCHES)
    assert [p.name for p in series] == sorted(p.name for p in PATCHES.glob("*.patch"))
    for p in series:
        head = p.read_text().split("\ndiff --git", 1)[0]
        assert "Without it" in head and "Upstream" in head, f"{p.name}: header incomplete"


def test_apply_to_fresh_install_then_idempotent(fresh_target):
    before = file_hashes(fresh_target)
    res = run_cli("apply", "--target", str(fresh_target))
    assert res.returncode == 0, res.stderr
    assert "applied 5 patches" in res.stdout or "applied" in res.stdout
    after = file_hashes(fresh_target)
    assert after != before
    # Same result as the environment the tests run in.
    assert after == file_hashes(patching.default_target())
    manifest = patching.load_manifest(fresh_target)
    assert [s["name"] for s in manifest["series"]] == [p.name for p in patching.read_series(PATCHES)]
    assert manifest["series_sha256"] == patching.series_hash(PATCHES)
    assert manifest["versions"]["speculators"] == "0.3.0"
    mtimes = {f: os.stat(fresh_target / f).st_mtime_ns for f in after}
    again = run_cli("apply", "--target", str(fresh_target))
    assert again.returncode == 0 and "already applied" in again.stdout
    assert {f: os.stat(fresh_target / f).st_mtime_ns for f in after} == mtimes
    assert run_cli("check", "--target", str(fresh_target)).returncode == 0


def test_refuses_another_speculators_version(fresh_target):
    (meta,) = fresh_target.glob("speculators-*.dist-info/METADATA")
    meta.write_text(meta.read_text().replace("Version: 0.3.0", "Version: 0.4.0"))
    before = file_hashes(fresh_target)
    res = run_cli("apply", "--target", str(fresh_target))
    assert res.returncode != 0
    assert "speculators: installed 0.4.0" in res.stderr and "0.3.0" in res.stderr
    assert file_hashes(fresh_target) == before


def test_a_hunk_that_does_not_apply_names_patch_and_hunk_and_changes_nothing(
        fresh_target, tmp_path):
    broken = tmp_path / "patches"
    shutil.copytree(PATCHES, broken)
    victim = broken / "0001-verifier-norm-before-lm-head.patch"
    text = victim.read_text()
    # Corrupt one context line of the first hunk.
    i = text.index("\n ", text.index("+++ b/speculators/models/eagle3/core.py"))
    victim.write_text(text[: i + 2] + "XX" + text[i + 2:])
    before = file_hashes(fresh_target)
    res = run_cli("apply", "--target", str(fresh_target), "--patches", str(broken))
    assert res.returncode != 0
    assert "0001-verifier-norm-before-lm-head.patch does not apply" in res.stderr
    assert "Hunk #" in res.stderr
    assert file_hashes(fresh_target) == before  # the dry run protected the install
    assert patching.load_manifest(fresh_target) is None


def test_unlisted_or_missing_patch_is_an_error(tmp_path):
    d = tmp_path / "patches"
    shutil.copytree(PATCHES, d)
    (d / "9999-stray.patch").write_text("--- a/x\n+++ b/x\n")
    with pytest.raises(patching.PatchError, match="not listed"):
        patching.read_series(d)
    (d / "9999-stray.patch").unlink()
    (d / "series").write_text((d / "series").read_text() + "0006-missing.patch\n")
    with pytest.raises(patching.PatchError, match="missing"):
        patching.read_series(d)


def test_check_detects_a_modified_patched_file(fresh_target):
    assert run_cli("apply", "--target", str(fresh_target)).returncode == 0
    f = fresh_target / "speculators/models/eagle3/core.py"
    f.write_text(f.read_text() + "\n# local edit\n")
    res = run_cli("check", "--target", str(fresh_target))
    assert res.returncode != 0 and "changed since" in res.stderr


DRAFTER_NORM = """
import sys, torch
import speculators
assert speculators.__file__.startswith(sys.argv[2]), speculators.__file__
sys.path.insert(0, sys.argv[5])
from conftest import drafter
m = drafter(sys.argv[1])
x = torch.load(sys.argv[3])
torch.save(m.verifier_norm(x) if hasattr(m, "verifier_norm") else None, sys.argv[4])
"""


def test_trainer_targets_go_through_the_verifier_norm(fresh_target, tiny_paths, tmp_path):
    """speculators 0.3.0 computes targets as lm_head(last state); the patch adds the final
    norm that vLLM-captured (pre-norm) states need, with the verifier's own weights."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], dtype=torch.float32)
    with torch.no_grad():  # a norm weight of all ones (random init) would hide a wrong one
        hf.model.norm.weight.copy_(torch.rand_like(hf.model.norm.weight) + 0.5)
    verifier = tmp_path / "verifier"
    hf.save_pretrained(verifier)
    x = torch.randn(7, hf.config.hidden_size) * 3
    torch.save(x, tmp_path / "x.pt")
    want = hf.model.norm(x)

    def drafter_norm(site: Path):
        env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}" + os.environ.get("PYTHONPATH", ""))
        res = subprocess.run([sys.executable, "-c", DRAFTER_NORM, str(verifier), str(site),
                              str(tmp_path / "x.pt"), str(tmp_path / "y.pt"),
                              str(Path(__file__).parent)],
                             capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-2000:]
        return torch.load(tmp_path / "y.pt")

    assert drafter_norm(fresh_target) is None  # unpatched: no norm before verifier_lm_head
    assert run_cli("apply", "--target", str(fresh_target)).returncode == 0
    got = drafter_norm(fresh_target)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
