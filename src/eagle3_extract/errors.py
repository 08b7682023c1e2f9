"""The errors a user fixes by changing the config (the cli exits 2 with the message)."""

from __future__ import annotations



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
