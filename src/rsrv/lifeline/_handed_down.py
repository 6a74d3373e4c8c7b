"""The configuration file a supervisor hands down to its children.

``rsrv node`` reads its node file (and its gateway file) once, and plans the node from
those bytes. Every process of a child, restarts included, reads the same bytes: a copy
in an unlinked file whose descriptor the child inherits (``RSRV_SUPERVISOR_CONFIG_FD``),
not the file on disk, which may have been edited meanwhile (a restarted worker would
listen on a port the gateway never dials, or fail on a typo and stop the whole node).
The child still names the file by its path, for its messages and its relative paths.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping

__all__ = ["CONFIG_FD_VARIABLE", "HandedDownConfig", "handed_down_config"]

CONFIG_FD_VARIABLE = "RSRV_SUPERVISOR_CONFIG_FD"


class HandedDownConfig:
    """``data`` in an unlinked file, open until :meth:`close`: its :attr:`fd` is what a
    child inherits. Raises OSError when no file can be made."""

    def __init__(self, data: bytes) -> None:
        self._file = tempfile.TemporaryFile()
        try:
            self._file.write(data)
            self._file.flush()
        except BaseException:
            self._file.close()
            raise

    @property
    def fd(self) -> int:
        return self._file.fileno()

    def close(self) -> None:
        """Close this process's descriptor (a child started meanwhile keeps its own)."""
        self._file.close()


def handed_down_config(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The bytes of the configuration file this process's supervisor handed down; None
    when it was given none. Raises ValueError naming the variable when the descriptor
    it names cannot be read."""
    text = env.get(CONFIG_FD_VARIABLE)
    if text is None:
        return None
    try:
        fd = int(text)
        size = os.fstat(fd).st_size
        chunks, done = [], 0
        while done < size:  # (positioned reads: the description is shared with siblings)
            chunk = os.pread(fd, size - done, done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
    except (ValueError, OSError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise ValueError(
            f"{CONFIG_FD_VARIABLE}={text!r}: cannot read the configuration the supervisor "
            f"handed down: {reason}"
        ) from None
    return b"".join(chunks)
