#!/usr/bin/env python3
"""Write BUILD_INFO.json for the image and check it against the build's pins.

Run by the Dockerfile after the patch series is applied. It records what the image
really holds (installed distribution versions, read from the environment, not from
build args), the patch-series hash recomputed from the copied patches, the base image
reference with its digest, the CUDA version of the base image and the git commit. It
fails the build when an installed version differs from its pin (``--expect``) or when
the series hash passed as a build arg (the image label) differs from the patches that
were applied, so the labels can never describe a different image.

The job finds the file through the environment variable ``EAGLE3_BUILD_INFO``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from importlib import metadata
from pathlib import Path

RECORDED = (
    "vllm",
    "torch",
    "speculators",
    "transformers",
    "flashinfer-python",
    "triton",
    "datasets",
    "huggingface-hub",
    "safetensors",
    "hydra-core",
    "omegaconf",
    "eagle3-extract",
)


def installed_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def patch_manifest() -> dict | None:
    """The manifest `eagle3-patches apply` writes into the speculators install."""
    spec = importlib.util.find_spec("speculators")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = Path(loc) / "_eagle3_patches.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--series-hash", required=True, help="recomputed from the copied patches")
    ap.add_argument(
        "--expected-series-hash",
        default="",
        help="the build arg PATCH_SERIES_SHA256 (image label); empty: not given",
    )
    ap.add_argument("--base-image", default="")
    ap.add_argument("--git-commit", default="")
    ap.add_argument("--vllm-wheel-url", default="")
    ap.add_argument(
        "--expect",
        action="append",
        default=[],
        metavar="DIST=VERSION",
        help="fail unless DIST is installed at exactly VERSION",
    )
    args = ap.parse_args(argv)

    errors: list[str] = []
    versions = installed_versions(RECORDED)
    for item in args.expect:
        dist, _, want = item.partition("=")
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            have = None
        if have != want:
            errors.append(f"{dist}: installed {have!r}, pinned {want!r}")

    if args.expected_series_hash and args.expected_series_hash != args.series_hash:
        errors.append(
            "patch series hash: build arg PATCH_SERIES_SHA256="
            f"{args.expected_series_hash} but the copied patches hash to {args.series_hash}"
            " (build with `make build`, which computes it with docker/series-hash.sh)"
        )

    manifest = patch_manifest()
    if manifest is None:
        errors.append("no patch manifest (speculators/_eagle3_patches.json) after apply")
    elif manifest.get("series_sha256") != args.series_hash:
        errors.append(
            f"the patch manifest records series {manifest.get('series_sha256')}, "
            f"the copied patches hash to {args.series_hash}"
        )

    if errors:
        for e in errors:
            print(f"build-info: {e}", file=sys.stderr)
        return 1

    base = args.base_image
    info = {
        "versions": versions,
        "vllm_wheel_url": args.vllm_wheel_url or None,
        "patch_series_sha256": args.series_hash,
        "patch_manifest": manifest,
        "base_image": base,
        "base_image_digest": base.split("@", 1)[1] if "@" in base else None,
        "cuda_version": os.environ.get("CUDA_VERSION"),
        "python": sys.version.split()[0],
        "git_commit": args.git_commit or None,
    }
    args.out.write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
    print(json.dumps(info, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
