"""The config's one error type."""


class ConfigError(ValueError):
    """A config problem the user can fix; the message names the key, where it was set, and the fix."""
