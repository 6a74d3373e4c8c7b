"""The one exception the configuration package raises."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A node file, or the environment, does not describe a valid deployment.

    The message always starts with where the problem is: the node file's
    path (or ``<embedded default.toml>``), and, when the problem is a
    single field, its ``$.path`` or the environment variable's name. It is
    meant to be shown to the operator as is.
    """
