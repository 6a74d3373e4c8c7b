"""The configuration file a supervisor hands down to its children.

``rsrv node`` reads its node file (and its gateway file) once, and plans the node from
those bytes. Every process of a child, restarts included, reads the same bytes: a copy
in an unlinked file whose descriptor the child inherits (``RSRV_SUPERVISOR_CONFIG_FD``),
not the file on disk, which may have been edited meanwhile (a restarted worker would
listen on a port the gateway never dials, or fail on a typo and stop the whole node).
The copy stands for one file, named by its absolute path
(``RSRV_SUPERVISOR_CONFIG_PATH``): the child still names the file by that path, for its
messages and its relative paths, and a child given another file reads that one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import MutableMapping
from typing import NamedTuple

__all__ = [
    "CONFIG_FD_VARIABLE",
    "CONFIG_PATH_VARIABLE",
    "ConfigCopy",
    "HandedDownConfig",
    "handed_down_config",
]

CONFIG_FD_VARIABLE = "RSRV_SUPERVISOR_CONFIG_FD"
CONFIG_PATH_VARIABLE = "RSRV_SUPERVISOR_CONFIG_PATH"


class ConfigCopy(NamedTuple):
    """A configuration file as read: its absolute ``path`` and its ``data``."""

    path: str
    data: bytes


class HandedDownConfig:
    """``copy``'s data in an unlinked file, open until :meth:`close`; :attr:`variables`
    are what a child's environment needs to find it (with :attr:`fd` inherited).
    Raises OSError when no file can be made."""

    def __init__(self, copy: ConfigCopy) -> None:
        self._file = tempfile.TemporaryFile()
        try:
            self._file.write(copy.data)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise
        self.variables = {CONFIG_FD_VARIABLE: str(self.fd), CONFIG_PATH_VARIABLE: copy.path}

    @property
    def fd(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        """Close this process's descriptor (a child started meanwhile keeps its own)."""
        self._file.close()


def handed_down_config(
    path: str | os.PathLike[str] | None, env: MutableMapping[str, str] = os.environ
) -> bytes | None:
    """The bytes of the configuration file at ``path`` as this process's supervisor read
    them, when it handed them down for that file; None otherwise (no supervisor, or
    another file). The variables are taken out of ``env`` and the descriptor closed:
    what this process starts reads its own files. Raises ValueError naming the variable
    when the descriptor cannot be read."""
    text = env.pop(CONFIG_FD_VARIABLE, None)
    named = env.pop(CONFIG_PATH_VARIABLE, None)
    if text is None or path is None or named != os.path.abspath(path):
        return None
    try:
        fd = int(text)
        try:
            size = os.fstat(fd).st_size
            chunks, done = [], 0
            while done < size:  # (positioned reads: the description is shared with siblings)
                chunk = os.pread(fd, size - done, done)
                if not chunk:
                    break
                chunks.append(chunk)
                done += len(chunk)
        finally:
            os.close(fd)
    except (ValueError, OSError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ValueError(
            f"{CONFIG_FD_VARIABLE}={text!r}: cannot read the configuration the supervisor "
            f"handed down: {reason}"
        ) from None
    return b"".join(chunks)
