"""RepositoryModelLoad's ``file:`` parameters written into a model's directory."""

from __future__ import annotations

import os
import stat

from rsrv.worker._files import write


def test_written_files_follow_the_umask(tmp_path):
    """(A mode set with fchmod ignores the umask: 0644 under umask 077.) No temporary
    file is left beside it."""
    mask = os.umask(0o077)
    try:
        (path,) = write(tmp_path, "m", {"1/config.txt": b"x"}, True)
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_bytes() == b"x" and os.listdir(path.parent) == ["config.txt"]
