"""The errors a user fixes by changing the config (the cli exits 2 with the message)."""


class PreflightError(Exception):
    """A problem found before the engine starts; the message names the key to change."""


class ConfigError(PreflightError):
    """A config value is out of range or not one of the allowed choices."""
