"""A Hydra sweeper that runs every job of a sweep it can (`-m`).

Hydra's basic sweeper stops at the first job that fails: our jobs end a failure with
sys.exit (one line, exit 2), which is not an Exception to Hydra and ends the process;
and a value of the wrong type in the second job fails the whole sweep, before any job,
in Hydra's multi-line text. This one composes each job's config first (a job whose
config cannot be composed is a failed job, in one line), runs the rest one by one
(eagle3_extract.hydra_app.run_guarded raises SweepJobFailed instead of exiting in a
sweep), then lists the failed jobs one line each and exits with the highest status.

Selected by the root configs' `override hydra/sweeper: keep_going`
(conf/hydra/sweeper/keep_going.yaml). Hydra finds plugins only in this namespace package.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf


def _line(e: BaseException) -> str:
    from eagle3_extract.hydra_app import SweepJobFailed, one_line

    return e.line if isinstance(e, SweepJobFailed) else one_line(e)


class KeepGoingSweeper(BasicSweeper):
    def sweep(self, arguments: List[str]) -> Any:
        from eagle3_extract.hydra_app import SweepJobFailed

        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides(self._parse_config() + list(arguments))
        jobs = [job for batch in self.split_arguments(overrides, None) for job in batch]
        swept = {o.get_key_element() for o in overrides if o.is_sweep_override()}

        def name(job: list[str]) -> str:  # the job by the values it sweeps
            return " ".join(o for o in job if o.split("=", 1)[0] in swept) or " ".join(job)

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        prog = str(self.config.hydra.help.app_name)
        failed: list[tuple[int, list[str], str, int]] = []
        runnable: list[tuple[int, list[str]]] = []
        for num, job in enumerate(jobs):
            try:
                self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
                runnable.append((num, job))
            except Exception as e:  # noqa: BLE001 - a job that cannot be composed fails alone
                line = f"{_line(e)} (see the keys with: {prog} --cfg job)"
                print(f"{prog}: error: sweep job ({name(job)}): {line}", file=sys.stderr,
                      flush=True)
                failed.append((num, job, line, 2))
        # one launch, as Hydra's sweeper does: a launcher that runs jobs at once (submitit,
        # SLURM) still does; jobs are numbered among those launched
        results = self.launcher.launch([job for _, job in runnable], initial_job_idx=0) \
            if runnable else []
        for (num, job), ret in zip(runnable, results):
            if ret.status == JobStatus.FAILED:
                err = ret._return_value
                code = err.exit_code if isinstance(err, SweepJobFailed) else 1
                if not isinstance(err, SweepJobFailed):  # not our one line yet
                    print(f"{prog}: error: sweep job ({name(job)}): "
                          f"{type(err).__name__}: {_line(err)}", file=sys.stderr, flush=True)
                failed.append((num, job, _line(err), code))
        failed.sort()
        if failed:
            print(f"{prog}: {len(failed)} of {len(jobs)} sweep jobs failed:", file=sys.stderr)
            for _, job, line, _ in failed:
                print(f"  {name(job)}: {line}", file=sys.stderr)
            sys.stderr.flush()
            sys.exit(max(code for *_, code in failed))
        return [results]
