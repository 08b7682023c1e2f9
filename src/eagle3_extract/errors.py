"""The errors a user fixes by changing the config (the cli exits 2 with the message)."""

from __future__ import annotations

import os
import sys
from typing import Any


class PreflightError(Exception):
    """A problem found before the engine starts; the message names the key to change."""


class ConfigError(PreflightError):
    """A config value is out of range or not one of the allowed choices."""


class JobError(Exception):
    """A run that cannot go on (full disk, a signal): one line for the user, the manifest
    already says so. `exit_code`: what the command exits with."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(BaseException):
    """SIGTERM, raised in the main thread like SIGINT's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


def quiet_on_broken_pipe(main: Any) -> Any:
    """A console script's main that ends quietly when its reader is gone (`| head -1`):
    exit 141 (128 + SIGPIPE, what a C tool's death by SIGPIPE reports), no traceback.
    stdout is pointed at /dev/null first, or Python's flush at exit would raise again."""
    import functools

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            rc = main(*args, **kwargs)
            sys.stdout.flush()  # what is still buffered fails here, not at exit
            return rc
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return 141

    return wrapper
