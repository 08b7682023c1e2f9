"""`eagle3-extract`: the Hydra main. Composes the config and hands it to the job.

One shard on one engine: job.run. `parallel.data_parallel_size > 1`: the
launcher (parallel.py), which runs this same command once per replica.
"""

from __future__ import annotations

import logging
import signal
import sys

from omegaconf import DictConfig

from .config import conf_dir
from .errors import Interrupted, JobError, PreflightError

log = logging.getLogger("eagle3_extract")


def _task(cfg: DictConfig) -> None:
    from . import job, parallel

    try:
        if int(cfg.parallel.data_parallel_size) > 1:
            rc = parallel.launch_hydra_job(cfg)
            if rc:
                sys.exit(rc)
            return
        parallel.die_with_launcher()  # a replica: no orphan outlives its launcher
        job.run(cfg)
    except PreflightError as e:
        log.error("preflight: %s", e)
        print(f"eagle3-extract: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (KeyboardInterrupt, Interrupted) as e:  # before the job's own handling began
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"eagle3-extract: interrupted by {signal.Signals(signum).name} before "
              "extraction started", file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    except JobError as e:
        log.error("%s", e)
        print(f"eagle3-extract: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def extract_main() -> None:
    """Console script `eagle3-extract` (Hydra: overrides, -m sweeps, --cfg job, ...)."""
    import hydra

    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_task)()


if __name__ == "__main__":
    extract_main()
