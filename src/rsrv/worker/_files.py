"""RepositoryModelLoad's ``file:`` parameters, written into the model's directory.

Triton's ``file:<path>`` parameters carry a model's files in the request. rsrv writes
them into ``<model_repo>/<model>/`` only when the node file allows it for that model
(``scheduler.models.<model>.allow_file_overrides``), and never anywhere else: a path is
``<file>`` or ``<version>/<file>`` with plain names, every directory on the way must be
a real directory (no symlink) inside the repository, and each file is written to a new
temporary file beside it, then renamed over the old one (a reader sees the old or the
new file, never half of one).
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from rsrv.errors import FailedPrecondition, InvalidArgument
from rsrv.versions import version_dir_number

MAX_NAME_BYTES = 255  # NAME_MAX


def write(repo: Path, name: str, files: Mapping[str, bytes], allowed: bool) -> list[Path]:
    """Write ``files`` ({relative path: contents}) into model ``name``'s directory of
    ``repo``; returns the paths written. FailedPrecondition when not ``allowed``,
    InvalidArgument for a path that would leave the model's directory."""
    listed = ", ".join(f"file:{p}" for p in sorted(files))
    if not allowed:
        raise FailedPrecondition(
            f"failed to load {name!r}: the request carries file overrides ({listed}), which "
            f"this worker refuses; set scheduler.models.{name}.allow_file_overrides = true "
            "in the node file to let RepositoryModelLoad write them into the model's "
            "directory in the repository"
        )
    parts = {path: _parts(name, path) for path in sorted(files)}
    root = Path(os.path.realpath(repo))
    written = []
    for path, (directories, filename) in parts.items():
        try:
            directory = _directory(root, [name, *directories])
            written.append(_replace(directory, filename, files[path]))
        except OSError as e:  # (naming the file as the client did: the repository's path
            # is the server's business)
            raise InvalidArgument(
                f"failed to load {name!r}: cannot write file:{path}: {e.strerror or e}"
            ) from None
    return written


def _parts(name: str, path: str) -> tuple[list[str], str]:
    parts = path.split("/")
    bad = (
        not 1 <= len(parts) <= 2
        or (len(parts) == 2 and version_dir_number(parts[0]) is None)
        or any(
            not p
            or p.startswith(".")
            or "\\" in p
            or "\0" in p
            or len(p.encode(errors="surrogateescape")) > MAX_NAME_BYTES
            for p in parts
        )
    )
    if bad:
        shown = path if len(path) <= 80 else path[:80] + "..."
        raise InvalidArgument(
            f"failed to load {name!r}: file:{shown} is not a path inside the model's "
            "directory: give file:<file> or file:<version>/<file>, with a version number "
            "and plain file names"
        )
    return parts[:-1], parts[-1]


def _directory(root: Path, names: list[str]) -> Path:
    """``root/names...``, created where missing; every step a real directory."""
    current = root
    for part in names:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            mode = os.lstat(current).st_mode
        if not stat.S_ISDIR(mode):  # a symlink or a file: never followed or replaced
            raise InvalidArgument(
                f"failed to load {names[0]!r}: {current.relative_to(root)} in the repository "
                "is not a plain directory; file overrides are not written through it"
            )
    return current


def _replace(directory: Path, filename: str, data: bytes) -> Path:
    target = directory / filename
    # (a name of its own, of bounded length: two loads writing the same file at once
    # each have theirs; the umask applies to the mode, as to any file the server makes)
    temporary = directory / f".rsrv-{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, 0o644)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temporary, target)  # renames over a symlink, never through it
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return target
