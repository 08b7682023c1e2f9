"""Is the extraction in a directory complete, and if not, what is missing: one answer
(`run_state`) for every command that asks (eagle3-status, validate, export, train, and a
shard that finishes the run and writes its merge).

A rerun with another shard layout resumes from the same files and leaves the old
layout's manifests behind; the layout written last is the run now (RunManifests). A run
is complete when every shard of that layout says so, one run_id names all of it, the
merge its last shard writes is there and no symbolic link stands where its files belong.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_extract.layout import (D2T_NPY, MANIFEST_JSON, MANIFEST_RE, RUN_JSON, T2D_NPY,
                                   TOKEN_FREQ_JSON, VOCAB_DIR, links)
from eagle3_extract.manifest import Manifest, read_run_json


@dataclass
class Problem:
    """One thing wrong: `where` is a file path relative to DIR, or "dataset"."""

    where: str
    code: str
    message: str


@dataclass
class RunManifests:
    """Every shard manifest of an output dir, by layout (shard count) and shard index.

    A rerun with another shard layout resumes from the same files and leaves the old
    layout's manifests behind. One rule says which layout is the run now, for every
    command that reads the dir (validate, status, export, train, verify): the one
    written last (`updated`, then the files' mtimes).
    """

    layouts: dict[int, dict[int, Manifest]]
    names: dict[int, list[str]]
    last_written: dict[int, tuple[str, int]]
    unreadable: list[tuple[str, str]]  # (file name, why)

    @property
    def current(self) -> int | None:
        """The shard count of the layout written last, or None without manifests."""
        if not self.layouts:
            return None
        return max(self.layouts, key=lambda c: self.last_written[c])

    def complete(self, count: int) -> bool:
        shards = self.layouts.get(count, {})
        return all(i in shards and shards[i].status == "complete" for i in range(count))


def read_manifests(root: Path) -> RunManifests:
    """The manifests in `root` (a symbolic link where one belongs is never read: the
    layout scans name it)."""
    run = RunManifests({}, {}, {}, [])
    paths = sorted((Path(e.path) for e in os.scandir(root)
                    if MANIFEST_RE.match(e.name) and not e.is_symlink()),
                   key=lambda p: (p.name != MANIFEST_JSON, p.name))
    for p in paths:
        try:
            m = Manifest.read(p)
            written = (str(m.updated or ""), p.stat().st_mtime_ns)
        except (OSError, ValueError) as e:
            run.unreadable.append((p.name, str(e)))
            continue
        count = m.shard_count
        run.layouts.setdefault(count, {})[m.shard_index] = m
        run.names.setdefault(count, []).append(p.name)
        run.last_written[count] = max(run.last_written.get(count, written), written)
    return run


def missing_merge(root: Path, manifests: list[Manifest]) -> list[str]:
    """The files a finished run merges from its shards (`token_freq.json` over several
    shards, `vocab/` when output.draft_vocab_size is set) that are not there: what a kill
    between the last shard's "complete" and its merge leaves. Rerunning any one shard of
    the run finds every file done and writes them."""
    if not manifests:
        return []
    m = manifests[0]
    missing = []
    if m.shard_count > 1 and not (root / TOKEN_FREQ_JSON).is_file():
        missing.append(TOKEN_FREQ_JSON)
    size = ((m.config or {}).get("output") or {}).get("draft_vocab_size")
    if size is not None and (m.model or {}).get("vocab_size", 1):
        missing += [f"{VOCAB_DIR}/{n}" for n in (D2T_NPY, T2D_NPY)
                    if not (root / VOCAB_DIR / n).is_file()]
    return missing


def merge_message(missing: list[str]) -> str:
    return (f"every shard is complete but the merge is missing ({', '.join(missing)}): "
            "rerun any one shard of the job with the same config (it finds every file "
            "done and writes the merge)")


def run_ids(root: Path, manifests: list[Manifest]) -> dict[str, list[str]]:
    """run_id -> the files that name it (run.json and each shard manifest): more than one
    is a directory holding two configs' data (left by a version before claim_run_json)."""
    out: dict[str, list[str]] = {}
    try:
        out.setdefault(str(read_run_json(root).get("run_id")), []).append(RUN_JSON)
    except (OSError, ValueError):
        pass
    for m in manifests:
        out.setdefault(str(m.run_id), []).append(m.file_name)
    return out


def mixed_runs_message(ids: dict[str, list[str]]) -> str:
    parts = "; ".join(f"{rid} in {', '.join(names[:3])}" for rid, names in ids.items())
    return (f"this directory mixes {len(ids)} runs of different configs ({parts}): written "
            "by an older eagle3-extract whose shards could start with different settings; "
            "its data cannot be trusted: extract again into a new output.dir")


@dataclass
class RunState:
    """What `run_state` found: the current layout's manifests and, when the run is not
    complete, why (`missing`, the first line of which is `why`)."""

    layouts: RunManifests
    manifests: list[Manifest]  # the current layout's
    problems: list[Problem] = field(default_factory=list)  # the run cannot be read as one
    warnings: list[Problem] = field(default_factory=list)  # an earlier layout's manifests
    not_complete: list[int] = field(default_factory=list)  # shards of the current layout
    merge: list[str] = field(default_factory=list)  # merge files missing, shards complete
    links: list[str] = field(default_factory=list)  # links where the run's files belong

    @property
    def unfinished(self) -> list[str]:
        """What the extraction has still to do (finish it: eagle3-status names the shards)."""
        out = [p.message for p in self.problems]
        if self.not_complete and not self.problems:
            count = self.manifests[0].shard_count
            out.append(f"shards {self.not_complete} of shard.count={count} are not complete")
        if self.merge:
            out.append(merge_message(self.merge))
        return out

    @property
    def missing(self) -> list[str]:
        """Everything that keeps the run from being complete: `unfinished`, then links."""
        if not self.links:
            return self.unfinished
        return self.unfinished + [
            f"{len(self.links)} symbolic links where the run's files belong (e.g. "
            f"{self.links[0]}); rerun the extraction to replace them"]

    @property
    def complete(self) -> bool:
        return not self.missing

    @property
    def why(self) -> str | None:
        missing = self.missing
        return missing[0] if missing else None


def run_state(root: Path, check_links: bool = True) -> RunState:
    """Is the run in `root` complete, and what is missing (RunState).

    While the current layout is unfinished, no mix of layouts is pieced together: code
    "mixed_layouts" names the shards that would finish it (their files are found).
    `check_links=False` skips the scan of the sample folders for links (a finishing
    shard's merge, which has just written them)."""
    run = read_manifests(root)
    problems = [Problem(name, "manifest", f"unreadable: {why}") for name, why in run.unreadable]
    state = RunState(run, [], problems)
    if not run.layouts:
        if not run.unreadable:
            problems.append(Problem("dataset", "manifest",
                                    "no manifest.json (nor shard manifests)"))
        return state
    current = run.current
    layouts = {c: list(shards.values()) for c, shards in run.layouts.items()}
    state.manifests = layouts[current]
    done = sorted(m.shard_index for m in layouts[current] if m.status == "complete")
    state.not_complete = sorted(set(range(current)) - set(done))
    if len(layouts) > 1 and state.not_complete:
        # Files of several layouts, the latest one unfinished: one layout is what the
        # checks (and export, and train) read, so say which shards would finish it.
        todo = state.not_complete
        others = ", ".join(f"shard.count={c} (shards {sorted(m.shard_index for m in ms)})"
                           for c, ms in sorted(layouts.items()) if c != current)
        problems.insert(0, Problem(
            "dataset", "mixed_layouts", f"this dir holds files of several shard layouts: "
            f"the latest, shard.count={current}, lacks complete shards {todo} (besides "
            f"{others}); run shard.count={current} shard.index=<each of {todo}>: files "
            "already there are re-checked, not redone, then validate again"))
        return state
    ids = run_ids(root, layouts[current])
    if len(ids) > 1:
        problems.insert(0, Problem("dataset", "mixed_runs", mixed_runs_message(ids)))
    for c in sorted(set(layouts) - {current}):
        state.warnings.append(Problem(
            "dataset", "stale_manifest", f"{run.names[c]} describe an earlier run with "
            f"shard.count={c}; checking against the later shard.count={current}"))
    if not state.not_complete:
        state.merge = missing_merge(root, state.manifests)
    if check_links:
        state.links = links(root)
    return state
