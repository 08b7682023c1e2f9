"""`eagle3-extract`: the Hydra main. Composes the config and hands it to the job.

One shard on one engine: job.run. `parallel.data_parallel_size > 1`: the
launcher (extract/parallel.py over replicas.py), which runs this same command once per
replica.
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from eagle3_extract.config import conf_dir  # noqa: F401 - where the configs are, for tests and tools
from eagle3_extract.hydra_app import hydra_main, run_guarded


def _extract(cfg: DictConfig) -> None:
    from eagle3_extract import replicas
    from eagle3_extract.extract import job, parallel

    if int(cfg.parallel.data_parallel_size) > 1:
        rc = replicas.launch_hydra_job(cfg, parallel.launch)
        if rc:
            sys.exit(rc)
        return
    replicas.die_with_launcher()  # a replica: no orphan outlives its launcher
    job.run(cfg)


def _task(cfg: DictConfig) -> None:
    run_guarded("eagle3-extract", _extract, cfg, " before extraction started")


def extract_main() -> None:
    """Console script `eagle3-extract` (Hydra: overrides, -m sweeps, --cfg job, ...)."""
    hydra_main("config", "eagle3-extract", _task)


if __name__ == "__main__":
    extract_main()
