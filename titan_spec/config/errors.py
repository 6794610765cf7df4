"""The one error type of the config package (a module of its own: the schema, the loader,
the validation and the run mode all raise it, and none of them imports another for it)."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config problem, already phrased for the user (one line).

    ``key`` (dotted, e.g. 'optimizer.lr') is the key at fault where there is one:
    ``load_config`` uses it to name where the value came from (the file or the command line)."""

    def __init__(self, message: str, key: str = ""):
        super().__init__(message)
        self.key = key
