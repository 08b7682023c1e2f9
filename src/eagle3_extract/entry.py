"""How every command ends: one error path for all nine, whether Hydra parses the command
line (extract, regenerate, train, acceptance: hydra_app.py) or argparse does (status,
validate, verify and export, which read a finished run, and patches, the image build's).

Each command's `main` is a few lines: parse, call the library, print. What the user can
act on is one line on stderr, `PROG: ...`, never a traceback:
- a problem to fix before anything runs (PreflightError: a config value, a path, a run
  directory that is not one): `error: ...`, exit 2;
- a job that cannot go on (JobError): its own line and code;
- a path that cannot be read or written: the path and `fix its permissions`, exit 2;
- a full disk: the path, and that the same command resumes, exit 1;
- a reader gone from the pipe (`| head -1`): quiet, exit 141.
Anything else is a bug: its traceback is the report.
"""

from __future__ import annotations

import errno
import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from eagle3_extract.errors import JobError, PreflightError


def error_exit(e: BaseException, os_errors: bool = False) -> tuple[str, int] | None:
    """(the one line, the exit status) of an error the user can act on; None for a bug.
    `os_errors`: any other OSError is the environment too (a command that only reads and
    writes files), one line and exit 1."""
    if isinstance(e, PreflightError):
        return f"error: {e}", 2
    if isinstance(e, JobError):
        return str(e), e.exit_code
    if isinstance(e, PermissionError):
        return (f"error: {e.filename or '?'}: permission denied ({e.strerror or e}); fix "
                "its permissions or choose another path"), 2
    if isinstance(e, OSError) and (os_errors or e.errno in (errno.ENOSPC, errno.EDQUOT)):
        hint = ("free space there and rerun the same command: what was written is kept"
                if e.errno in (errno.ENOSPC, errno.EDQUOT) else
                "fix that and rerun the same command: what was written is kept")
        return f"error: {e.filename or '?'}: {e.strerror or e}; {hint}", 1
    return None


def _quiet_pipe() -> int:
    """stdout pointed at /dev/null, or Python's flush at exit would raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # 128 + SIGPIPE: what a C tool's death by SIGPIPE reports


def command(prog: str, os_errors: bool = False) -> Callable[[Any], Any]:
    """The decorator of an argparse command's `main(argv) -> int`: its errors go the one
    way every command's go (`error_exit`), printed as `PROG: line`."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(*args: Any, **kwargs: Any) -> int:
            try:
                rc = main(*args, **kwargs)
                sys.stdout.flush()  # what is still buffered fails here, not at exit
                return rc
            except BrokenPipeError:
                return _quiet_pipe()
            except Exception as e:  # noqa: BLE001 - mapped below, or raised as it was
                found = error_exit(e, os_errors)
                if found is None:
                    raise
                print(f"{prog}: {found[0]}", file=sys.stderr, flush=True)
                return found[1]

        return wrapper

    return wrap
