"""`parallel.data_parallel_size=N`: N engine replicas on one node, one process each, for
any command that runs shards (eagle3-extract, eagle3-regenerate).

Each replica is a plain run of the same command on its own shard, started as a child
process with the job's own overrides: nothing is shared but the output dir, which shards
already share safely (per-index files, per-shard manifests). A model that fits on fewer
devices than the node has (an 8B model on 8 GPUs) then runs 8 engines instead of one
TP=8 engine.

Replica r of a job that does shard (i, c) does shard (i + r*c, c*N): those are exactly
the samples with index % c == i, split N ways, so replicas of different jobs never
overlap and a later run with another N or c resumes from the same files.

The launcher gives each replica its own devices (CUDA_VISIBLE_DEVICES) or, on CPU, its
own cores, waits, and exits non-zero if any replica failed. A failed replica does not stop
the others: their files count on the rerun. Ctrl-C or SIGTERM stops them all. What runs
before the replicas (a preflight once, a dataset tokenized once) is the command's own
`launch` (extract/parallel.py, regenerate/job.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_extract.config import PreflightError

if TYPE_CHECKING:  # the schema's groups, as the job hands them (DictConfig at run time)
    from eagle3_extract.config import EngineConfig, ModelConfig

log = logging.getLogger("eagle3_extract")


# Overrides the parent sets for each replica (any the user gave are replaced).
REPLACED = ("shard.index", "shard.count", "parallel.data_parallel_size", "output.dir")


STOP_GRACE_S = 30.0


PARENT_ENV = "EAGLE3_DP_PARENT"


PROGRESS_EVERY_S = 60.0


def replica_shards(index: int, count: int, n: int) -> list[tuple[int, int]]:
    """(shard.index, shard.count) of each of the n replicas of shard (index, count)."""
    return [(index + r * count, count * n) for r in range(n)]


def devices_per_replica(engine: EngineConfig, model: ModelConfig) -> int:
    if str(engine.name) == "hf":
        return 1
    return int(model.tensor_parallel_size) * int(model.pipeline_parallel_size)


def visible_devices() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (ids or UUIDs)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no usable CUDA runtime: CPU
        return []


def split_devices(visible: list[str], n: int, per: int) -> list[list[str]]:
    """Disjoint groups of `per` devices for n replicas, or PreflightError."""
    if n * per > len(visible):
        raise PreflightError(
            f"parallel.data_parallel_size={n} x {per} devices per replica (model."
            f"tensor_parallel_size x pipeline_parallel_size) = {n * per} devices, but "
            f"{len(visible)} are visible ({','.join(visible) or 'none'}); lower "
            "parallel.data_parallel_size or the model's parallel sizes"
        )
    return [visible[r * per:(r + 1) * per] for r in range(n)]


def cpu_binds(cores: list[int], n: int, per: int) -> list[str] | None:
    """VLLM_CPU_OMP_THREADS_BIND per replica: disjoint cores, `|` between its ranks.

    None when there are fewer cores than workers (then vLLM binds as it likes).
    """
    if len(cores) < n * per:
        return None
    step = len(cores) // (n * per)
    groups = [cores[k * step:(k + 1) * step] for k in range(n * per)]
    return ["|".join(",".join(map(str, g)) for g in groups[r * per:(r + 1) * per])
            for r in range(n)]


def _quote(value: str) -> str:
    """A Hydra override value that stays one string (paths with spaces, commas, ...)."""
    return "'" + value.replace("'", "\\'") + "'"


def replica_overrides(overrides: list[str], shard: tuple[int, int], root: Path,
                      log_dir: Path) -> list[str]:
    """The job's overrides with this replica's shard, one replica, the resolved output dir
    (a `${now:...}` in output.dir must not differ between replicas) and its own log dir."""
    keep = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in REPLACED]
    return [*keep, f"shard.index={shard[0]}", f"shard.count={shard[1]}",
            "parallel.data_parallel_size=1", f"output.dir={_quote(str(root))}",
            f"hydra.run.dir={_quote(str(log_dir))}"]


@dataclass
class Replica:
    rank: int
    shard: tuple[int, int]
    env: dict[str, str]
    log_dir: Path
    proc: subprocess.Popen | None = None
    rc: int | None = None

    @property
    def console(self) -> Path:
        return self.log_dir / "console.log"


def plan_replicas(n: int, shard: tuple[int, int], engine: EngineConfig, model: ModelConfig,
                  log_root: Path) -> list[Replica]:
    """Shards, devices and environment of each of `n` replicas of the job's `shard` (index,
    count); raises PreflightError."""
    per = devices_per_replica(engine, model)
    shards = replica_shards(*shard, n)
    base = dict(os.environ)
    visible = [] if str(engine.device) == "cpu" else visible_devices()
    envs: list[dict[str, str]] = []
    if visible:
        for group in split_devices(visible, n, per):
            envs.append({**base, "CUDA_VISIBLE_DEVICES": ",".join(group)})
    else:
        cores = sorted(os.sched_getaffinity(0))
        binds = None if "VLLM_CPU_OMP_THREADS_BIND" in base else cpu_binds(cores, n, per)
        threads = str(max(1, len(cores) // n))
        for r in range(n):
            env = {**base}
            env.setdefault("OMP_NUM_THREADS", threads)
            if binds:
                env["VLLM_CPU_OMP_THREADS_BIND"] = binds[r]
            envs.append(env)
    for env in envs:
        env[PARENT_ENV] = str(os.getpid())
    return [Replica(r, shards[r], envs[r], log_root / f"replica-{r}") for r in range(n)]


class _Stopper:
    """SIGINT/SIGTERM: ask every replica to stop (SIGINT to its process group, so its
    engine workers go too), then SIGKILL after STOP_GRACE_S or on a second signal."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas
        self.signum: int | None = None
        self.since = 0.0
        self.killed = False
        self.old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum, self.since = signum, time.monotonic()
            log.warning("signal %d: stopping %d replicas", signum, len(self.replicas))
            self.send(signal.SIGINT)
        else:
            self.kill()

    def send(self, sig: int) -> None:
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self) -> None:
        if not self.killed:
            self.killed = True
            self.send(signal.SIGKILL)

    def tick(self) -> None:
        if self.signum is not None and time.monotonic() - self.since > STOP_GRACE_S:
            self.kill()

    def restore(self) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no console log)"


def run_replicas(overrides: list[str], replicas: list[Replica], root: Path, t0: float,
                 dry_run: bool, module: str, progress: Any, summary: Any) -> int:
    """Start `python -m module` per replica with the job's overrides, wait, return the exit
    status (0: every replica completed). `progress(root, replicas)` is the line logged every
    PROGRESS_EVERY_S, `summary(root, replicas, wall_s)` what is logged at the end."""
    n = len(replicas)
    stopper = _Stopper(replicas)
    try:
        for r in replicas:
            r.log_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", module,
                   *replica_overrides(overrides, r.shard, root, r.log_dir)]
            with open(r.console, "wb") as out:
                r.proc = subprocess.Popen(cmd, env=r.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
            dev = r.env.get("CUDA_VISIBLE_DEVICES") or r.env.get("VLLM_CPU_OMP_THREADS_BIND")
            log.info("replica %d: pid %d, shard %d/%d, devices %s, log %s", r.rank, r.proc.pid,
                     *r.shard, dev or "-", r.console)
            if stopper.signum is not None:
                stopper.send(signal.SIGINT)  # also reaches one started during the signal
                break
        last = time.monotonic()
        while any(r.proc is not None and r.rc is None for r in replicas):
            time.sleep(0.2)
            stopper.tick()
            for r in replicas:
                if r.proc is not None and r.rc is None and r.proc.poll() is not None:
                    r.rc = r.proc.returncode
                    level = logging.INFO if r.rc == 0 else logging.ERROR
                    log.log(level, "replica %d (shard %d/%d) exited %d", r.rank, *r.shard, r.rc)
                    if r.rc != 0 and stopper.signum is None:
                        log.error("replica %d console, last lines:\n%s", r.rank, _tail(r.console))
            if time.monotonic() - last > PROGRESS_EVERY_S:
                last = time.monotonic()
                log.info("progress: %s", progress(root, replicas))
    finally:
        if any(r.proc is not None and r.proc.poll() is None for r in replicas):
            stopper.kill()  # only after an exception in this loop
        for r in replicas:
            if r.proc is not None:
                r.proc.wait()
        stopper.restore()
    failed = [r.rank for r in replicas if r.rc != 0]
    line = progress(root, replicas)
    if stopper.signum is not None:
        log.error("stopped by signal %d: %s", stopper.signum, line)
        return 128 + stopper.signum
    if failed:
        log.error("replicas %s failed (rerun the same command to resume): %s", failed, line)
        return 1
    if dry_run:
        log.info("dry_run: %d replicas passed preflight in %.1fs", n, time.perf_counter() - t0)
        return 0
    summary(root, replicas, time.perf_counter() - t0)
    return 0


def launch_hydra_job(cfg: Any, launch: Any) -> int:
    """A command's `launch(cfg, overrides, log_root)` (extract/parallel.py's, regenerate's)
    from inside a Hydra job: its overrides, its log dir."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    return launch(cfg, list(hc.overrides.task), Path(hc.runtime.output_dir))


def die_with_launcher() -> None:
    """In a replica (Linux): SIGKILL it when its launcher dies, even by SIGKILL, so no
    orphan keeps its GPUs or races a rerun on the same shard (vLLM's workers follow the
    replica). A no-op in a job the launcher did not start."""
    parent = int(os.environ.pop(PARENT_ENV, "0") or 0)
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)
