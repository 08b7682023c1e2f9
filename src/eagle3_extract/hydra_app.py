"""The Hydra plumbing of the commands that run a job (extract, regenerate, train,
acceptance): compose the config (a typo or a wrong type fails before anything starts),
quiet the engines' logs, and end the job the way every command ends (entry.py: one line
and an exit status). Imports nothing of the commands."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, NoReturn

from omegaconf import DictConfig

from eagle3_extract.config import conf_dir
from eagle3_extract.entry import error_exit
from eagle3_extract.errors import Interrupted, PreflightError

log = logging.getLogger("eagle3_extract")


def quiet_engine_logs(verbose: bool) -> None:
    """vLLM's own INFO lines (dozens per start) only with verbose=true; its warnings and
    errors always. Set before vLLM is imported; workers inherit it."""
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def log_to_file(message: str) -> None:
    """An error in the job's log file (Hydra's) only: stderr has its one line, and the
    console handler would print it a second time on stdout."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers + log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


class SweepJobFailed(Exception):
    """A job of a `-m` sweep that failed, its one line already printed: raised where a
    single run exits, so that the sweep goes on (hydra_plugins/eagle3_sweeper)."""

    def __init__(self, line: str, exit_code: int):
        super().__init__(line, exit_code)
        self.line, self.exit_code = line, exit_code


def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_guarded(prog: str, fn: Any, cfg: DictConfig, interrupted: str) -> None:
    """Run a job's `fn(cfg)` with the exits every command of ours shares: a preflight or
    config error is one line and exit 2, a signal 128 + its number, a JobError its own code.
    In a `-m` sweep the same line is printed and SweepJobFailed raised instead of exiting,
    so that the sweep runs its other jobs. A watcher removes the shared memory the job's
    processes leave if they are SIGKILLed."""
    try:
        _run_guarded(prog, fn, cfg, interrupted)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if code and code < 128 and _in_sweep():  # a signal still ends the whole sweep
            raise SweepJobFailed(getattr(e, "line", f"exit status {code}"), code) from None
        raise


class _JobExit(SystemExit):
    """The job's exit, with the one line it printed (what a sweep lists)."""

    def __init__(self, line: str, code: int):
        super().__init__(code)
        self.line = line


def _fail(prog: str, line: str, code: int) -> NoReturn:
    print(f"{prog}: {line}", file=sys.stderr, flush=True)
    raise _JobExit(line, code)


def _run_guarded(prog: str, fn: Any, cfg: DictConfig, interrupted: str) -> None:
    from eagle3_extract import shm_watch

    quiet_engine_logs(bool(cfg.verbose))
    shm_watch.start()
    try:
        fn(cfg)
    except (KeyboardInterrupt, Interrupted) as e:  # before the job's own handling began
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{prog}: interrupted by {signal.Signals(signum).name}{interrupted}",
              file=sys.stderr, flush=True)
        sys.exit(128 + signum)
    except Exception as e:  # noqa: BLE001 - every command's one error path (entry.py)
        found = error_exit(e)
        if found is None:
            raise
        line, code = found
        log_to_file(f"preflight: {e}" if isinstance(e, PreflightError) else line)
        _fail(prog, line, code)


# Hydra's own flags; those that take a value take the next argument.
_FLAGS_WITH_VALUE = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd",
                     "--cfg", "-c", "--package", "-p", "--experimental-rerun"}
_NO_COMPOSE = {"--help", "-h", "--hydra-help", "--version", "--info", "-i",
               "--shell-completion", "-sc"}


def overrides_of(argv: list[str]) -> list[str] | None:
    """The Hydra overrides on a command line; None when it only asks for help."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in _NO_COMPOSE:
            return None
        elif a in _FLAGS_WITH_VALUE:
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def config_problem(overrides: list[str], config_name: str = "config",
                   prog: str = "eagle3-extract", skip_sweeps: bool = False) -> str | None:
    """What is wrong with the overrides, in one line, or None.

    Composes the config once as Hydra will (a sweep with its first value of each
    swept key) so that a misspelt key or a wrong type is reported in one line with
    exit 2, not in Hydra's multi-line text; and refuses `+key=...` additions of keys
    the schema does not have (Hydra adds them silently), except under the free-form
    `engine.vllm_args` and `hydra`. `skip_sweeps`: a `-m` run leaves the swept keys to
    the sweeper, which fails only the jobs whose value is wrong.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        return f"cannot parse the overrides: {str(e).splitlines()[0]}"
    first, added = [], []
    for o in parsed:
        key = o.key_or_group
        if key == "hydra" or key.startswith("hydra.") or (skip_sweeps and o.is_sweep_override()):
            continue
        prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(o.type.name, "")
        try:
            value = (next(iter(o.sweep_string_iterator()), None) if o.is_sweep_override()
                     else o.get_value_element_as_str())
        except Exception:  # noqa: BLE001 - an interval sweep etc.: Hydra checks it itself
            continue
        pkg = f"@{o.package}" if o.package else ""
        first.append(f"{prefix}{key}{pkg}" + ("" if value is None else f"={value}"))
        is_group = (conf_dir() / key.split(".")[0]).is_dir() and "." not in key
        if prefix in ("+", "++") and not is_group and not key.startswith("engine.vllm_args."):
            added.append(key)
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3"):
            cfg = compose(config_name, overrides=first)
        unresolvable(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        return f"{one_line(e)} (see the keys with: {prog} --cfg job)"
    for key in added:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        known = sorted(k for k in (node.keys() if OmegaConf.is_dict(node) else []) if k != leaf)
        near = __import__("difflib").get_close_matches(leaf, known, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{near[0]}? " if near else ""
        return (f"+{key}: {parent or 'the config'} has no key {leaf!r}; {hint}"
                "(extra vLLM engine arguments go under +engine.vllm_args.<name>)")
    return None


def one_line(e: BaseException) -> str:
    """A Hydra or OmegaConf error (the validation error behind Hydra's) in one line, with
    the key it is about."""
    cause = e.__cause__ if e.__cause__ is not None else e
    msg = " ".join(str(cause).split("\n")[0].split())
    key = getattr(cause, "full_key", None)
    return f"{key}: {msg}" if key and key not in msg else msg


def unresolvable(cfg: Any) -> None:
    """Raise the first interpolation of the job's config that cannot be resolved (an unset
    `${oc.env:...}`, a key that does not exist): Hydra would resolve it later, for its run
    dir, in a traceback. A value left `???` for the job to name is not one."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue

    def walk(node: Any) -> None:
        for key in node.keys() if OmegaConf.is_dict(node) else range(len(node)):
            try:
                value = node[key]
            except (InterpolationToMissingValueError, MissingMandatoryValue):
                continue
            if OmegaConf.is_config(value):
                walk(value)

    walk(cfg)


def hydra_main(config_name: str, prog: str, task: Any) -> None:
    """A Hydra main over conf/<config_name>.yaml whose config errors are one line, exit 2."""
    import hydra

    overrides = overrides_of(sys.argv[1:])
    if overrides is not None:
        sweep = any(a in ("-m", "--multirun") for a in sys.argv[1:])
        problem = config_problem(overrides, config_name, prog, skip_sweeps=sweep)
        if problem:
            print(f"{prog}: error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)
    hydra.main(config_path=str(conf_dir()), config_name=config_name, version_base="1.3")(task)()
