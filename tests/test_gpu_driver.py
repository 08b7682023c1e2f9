"""bench/device/gpu.py, the one driver of the GPU experiments, and bench/device/gpu_sites.py, the
rehearsal of the environments it layers there: run here, before GPU time is spent.

The rehearsal reads the bundle's own wheel metadata (tests/fixtures/gpu-bundle-metadata.json,
recorded from .gpu-bundle, checked against it where the bundle is here) and the device's
`pip list` (tests/fixtures/h200-pip-freeze.txt, brought back by a call) in the path order
the driver gives each process. The driver's round trip runs its real plan / call code on
a small experiment: pieces packed into calls, parts reassembled by sha256, a cold machine
or a stale piece refused in one line, the step's results archived."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "device"))

import gpu  # noqa: E402
import gpu_sites  # noqa: E402


def _meta() -> dict:
    return json.loads(gpu_sites.METADATA_FIXTURE.read_text())


def test_every_process_path_on_the_device_meets_its_packages_requirements():
    problems = gpu_sites.check(_meta(), gpu_sites.device_freeze())
    assert problems == []
    # what each path sees first: our CLI the kit's hub and the product's datasets 4, the
    # trainer the device's hub 1.x and its own datasets 5
    base = gpu_sites.device_freeze()
    cli, trainer = gpu_sites.visible("cli", _meta(), base), gpu_sites.visible("trainer", _meta(), base)
    assert cli["huggingface-hub"][0] == "0.36.2" and cli["datasets"][0] == "4.8.5"
    assert cli["transformers"][0].startswith("4.57") and cli["vllm"][0] == "0.16.0"
    assert trainer["huggingface-hub"][0] == base["huggingface-hub"]
    assert trainer["datasets"][0] == "5.1.0" and trainer["transformers"][0] == base["transformers"]
    assert "vllm" not in trainer


def test_the_layering_that_broke_train_on_the_device_fails_here(monkeypatch):
    """The chain's first GPU run: the trainer's site on our CLI's path behind the kit's
    (and no whlC), so datasets 5.1.0 imported the kit's huggingface-hub 0.36.2
    (ImportError: BucketNotFoundError)."""
    sites = {k: v for k, v in gpu_sites.SITES.items() if k != "whlC"}
    monkeypatch.setattr(gpu_sites, "SITES", sites)
    monkeypatch.setitem(gpu_sites.PATHS, "cli", ["/tmp/site", "/tmp/train-site", "src"])
    problems = gpu_sites.resolve("cli", _meta(), gpu_sites.device_freeze())
    assert any(p.startswith("cli: datasets 5.1.0 (/tmp/train-site (whlT)) needs huggingface-hub")
               and "has 0.36.2 first (/tmp/site (whlB))" in p for p in problems), problems


def test_an_unmet_requirement_not_accepted_by_name_is_a_conflict():
    meta = _meta()
    base = dict(gpu_sites.device_freeze())
    base["tqdm"] = "4.71.0"  # speculators 0.9.0 needs tqdm<=4.70.1
    assert any("speculators 0.9.0" in p and "tqdm" in p for p in gpu_sites.check(meta, base))
    del base["tqdm"]
    assert any("needs tqdm" in p and "not on the path" in p for p in gpu_sites.check(meta, base))


def test_the_device_python_path_is_the_declared_order():
    assert gpu_sites.pythonpath("cli", Path("/repo")) == "/tmp/site:/repo/src"
    assert gpu_sites.pythonpath("trainer", Path("/repo")) == "/tmp/train-site"
    for path in gpu_sites.PATHS.values():
        assert all(e == "src" or e in gpu_sites.SITES.values() for e in path)


@pytest.mark.skipif(not (gpu.BUNDLE / "whlB").is_dir(), reason="no .gpu-bundle here "
                    "(python3 bench/device/gpu.py bundle); the committed metadata is checked as is")
def test_the_recorded_metadata_is_the_bundle_s():
    assert gpu_sites.record(gpu.BUNDLE) == _meta()


def _wheel(path: Path, name: str, version: str) -> None:
    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


@pytest.fixture
def small_experiment(tmp_path, monkeypatch):
    """A checkout with one wheel group and a 5 MiB 'model' under a 2 MiB call: 3 calls."""
    root = tmp_path / "repo"
    (root / "bench" / "device" / "steps").mkdir(parents=True)
    (root / ".gpu-bundle" / "whlX").mkdir(parents=True)
    _wheel(root / ".gpu-bundle" / "whlX", "gpu_driver_probe", "1.0")
    gguf = tmp_path / "SmolLM2.gguf"
    gguf.write_bytes(bytes(range(256)) * (5 * 4096))
    (root / "bench" / "device" / "steps" / "probe.sh").write_text(
        'set -e\nfor m in $MODELS; do cmp "$GPU_STAGE/$m.gguf" %s; done\n'
        'python3 -c "import gpu_driver_probe as p; print(p.VERSION)" > "$RESULTS/probe.txt"\n'
        'echo "$PYTHONPATH" > "$RESULTS/path.txt"\necho "$MODELS" > "$RESULTS/models.txt"\n'
        % gguf)
    site = tmp_path / "site"
    monkeypatch.setattr(gpu, "ROOT", root)
    monkeypatch.setattr(gpu, "BUNDLE", root / ".gpu-bundle")
    monkeypatch.setattr(gpu, "STAGE", root / ".gpu-stage")
    monkeypatch.setattr(gpu, "DEVICE", tmp_path / "device")
    monkeypatch.setattr(gpu, "CALL_BYTES", 2 * 2**20)
    monkeypatch.setattr(gpu, "_tree_bytes", lambda: 0)
    monkeypatch.setattr(gpu, "_model_gguf", lambda name: gguf)
    monkeypatch.setattr(gpu_sites, "SITES", {"whlX": str(site)})
    monkeypatch.setitem(gpu_sites.PATHS, "cli", [str(site), "src"])
    monkeypatch.setitem(gpu.EXPERIMENTS, "probe", ["whlX", "model"])
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    return root, tmp_path


def test_the_driver_stages_installs_runs_and_collects(small_experiment, capsys):
    root, tmp = small_experiment
    calls = gpu.plan("probe", rehearse=False)
    assert len(calls) == 3 and calls[0][0]["name"] == "whlX"
    assert all(sum(p["bytes"] for p in c) <= 2 * 2**20 for c in calls)
    printed = capsys.readouterr().out
    assert "python3 bench/device/gpu.py call probe 3" in printed and ".gpu-stage/parts/smollm2/part.0" in printed
    with pytest.raises(SystemExit, match="start again at call 1"):
        gpu.call("probe", "3")  # a cold machine: calls 1 and 2 never ran here
    for i in (1, 2):
        assert gpu.call("probe", str(i)) == 0
    assert (tmp / "out" / "device-pip-freeze.txt").read_text()
    assert gpu.call("probe", "3") == 0
    with tarfile.open(tmp / "out" / "probe-results.tar.gz") as t:
        t.extractall(tmp / "back", filter="data")
    assert (tmp / "back" / "probe.txt").read_text().strip() == "1.0"
    assert (tmp / "back" / "path.txt").read_text().strip() == f"{tmp / 'site'}:{root / 'src'}"
    assert (tmp / "back" / "models.txt").read_text().strip() == "smollm2"
    assert not list((tmp / "device" / "stage").glob("*.parts"))  # reassembled, parts gone
    assert gpu.call("probe", "run") == 0  # the step again, nothing to install


def test_two_targets_stage_side_by_side_and_the_step_names_them(small_experiment):
    root, tmp = small_experiment
    calls = gpu.plan("probe", rehearse=False, models=["qwen25_coder_1_5b", "smollm2"])
    names = [p["name"] for c in calls for p in c]
    assert names[0] == "whlX" and "qwen25_coder_1_5b part 0" in names and "smollm2 part 2" in names
    wholes = [p["whole"]["file"] for c in calls for p in c if "whole" in p]
    assert wholes == ["qwen25_coder_1_5b.gguf", "smollm2.gguf"]
    for i in range(1, len(calls) + 1):
        assert gpu.call("probe", str(i)) == 0  # the step's cmp checks both reassembled files
    with tarfile.open(tmp / "out" / "probe-results.tar.gz") as t:
        t.extractall(tmp / "back", filter="data")
    assert (tmp / "back" / "models.txt").read_text().split() == ["qwen25_coder_1_5b", "smollm2"]


def test_a_stale_piece_is_refused_before_it_is_installed(small_experiment):
    root, _ = small_experiment
    gpu.plan("probe", rehearse=False)
    part = root / ".gpu-stage" / "parts" / "smollm2" / "part.1"
    part.write_bytes(b"x" + part.read_bytes()[1:])
    gpu.call("probe", "1")
    with pytest.raises(SystemExit, match="not the piece the plan staged"):
        gpu.call("probe", "2")


def test_plan_refuses_conflicting_sites_before_any_call(monkeypatch, tmp_path):
    monkeypatch.setitem(gpu_sites.PATHS, "cli", ["/tmp/site", "/tmp/train-site", "src"])
    monkeypatch.setattr(gpu_sites, "SITES", {k: v for k, v in gpu_sites.SITES.items() if k != "whlC"})
    monkeypatch.setattr(gpu_sites, "record", lambda bundle: _meta())
    monkeypatch.setattr(gpu, "_piece_path", lambda name: tmp_path)  # every piece "present"
    with pytest.raises(SystemExit, match="the sites conflict"):
        gpu.plan("train")


def test_the_step_scripts_are_the_experiments():
    steps = {p.stem for p in (ROOT / "bench" / "device" / "steps").glob("*.sh")}
    assert steps == set(gpu.EXPERIMENTS)
    for p in (ROOT / "bench" / "device" / "steps").glob("*.sh"):
        subprocess.run(["bash", "-n", str(p)], check=True)
    assert not list((ROOT / "bench").rglob("h200*.sh"))  # one driver, no script per experiment
