"""Edit the patch series as git commits, then write it back.

    python tools/patch_workbench.py init /tmp/specwork   # pristine speculators + one commit per patch
    (edit, commit, rebase in /tmp/specwork: one commit per patch, subject = patch file name)
    python tools/patch_workbench.py export /tmp/specwork # rewrite patches/ from the commits

Headers (everything before the first `diff --git`/`---` line) are kept from the
existing patch file of the same name.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
FILES = ("speculators/data_generation/vllm_hidden_states_generator.py",
         "speculators/data_generation/custom_worker.py")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=workbench",
                           "-c", "user.email=workbench@localhost", *args],
                          check=True, capture_output=True, text=True).stdout


def series() -> list[str]:
    lines = (PATCHES / "series").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def init(repo: Path, wheel: Path) -> None:
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    with zipfile.ZipFile(wheel) as z:
        for f in FILES:
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            (repo / f).write_bytes(z.read(f))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pristine speculators 0.3.0")
    for name in series():
        subprocess.run(["patch", "-p1", "-s", "-d", str(repo), "-i", str(PATCHES / name)],
                       check=True)
        git(repo, "add", "-A")
        git(repo, "commit", "-qm", name)


def header(name: str) -> str:
    path = PATCHES / name
    if not path.exists():
        return f"{name}\n\n"
    text = path.read_text()
    cuts = [i for i in (text.find("\ndiff --git"), text.find("\n--- a/")) if i >= 0]
    if not cuts:  # a header-only file written by hand for a new commit
        return text.rstrip("\n") + "\n\n"
    return text[: min(cuts) + 1]


def export(repo: Path) -> None:
    commits = git(repo, "log", "--reverse", "--format=%H %s").splitlines()[1:]
    names = []
    for line in commits:
        sha, name = line.split(" ", 1)
        diff = git(repo, "diff", "--no-color", "--src-prefix=a/", "--dst-prefix=b/",
                   f"{sha}~1", sha)
        (PATCHES / name).write_text(header(name) + diff)
        names.append(name)
    (PATCHES / "series").write_text(
        "# Applied in order by `eagle3-patches apply` (src/eagle3_extract/patching.py)\n"
        + "".join(f"{n}\n" for n in names))
    print("\n".join(names))


if __name__ == "__main__":
    cmd, repo = sys.argv[1], Path(sys.argv[2])
    if cmd == "init":
        init(repo, Path(sys.argv[3]))
    elif cmd == "export":
        export(repo)
    else:
        sys.exit(__doc__)
