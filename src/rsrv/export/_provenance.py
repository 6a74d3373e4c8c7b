"""The provenance record an export writes into the manifest (see specs/export.md).

``collect_provenance`` records the framework, the versions of the libraries that shaped
the modules, the git commit and dirty flag of the working tree the export runs in, and the
export time in UTC. The time honours ``SOURCE_DATE_EPOCH`` (reproducible-builds.org), so
two runs of one script on one commit can write identical manifests.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from rsrv.export._errors import ExportError

BASE_PACKAGES = ("jax", "jaxlib", "rsrv")


def collect_provenance(
    framework: str = "jax",
    packages: Iterable[str] = (),
    *,
    cwd: str | Path | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The automatic provenance record; ``extra`` entries are added (or override) last.

    ``packages`` are distributions whose versions are recorded besides jax, jaxlib and
    rsrv. ``git`` is omitted when ``cwd`` (default: the current directory) is not inside
    a git work tree or git is not installed.
    """
    record: dict[str, Any] = {
        "framework": framework,
        "versions": versions([*BASE_PACKAGES, *packages]),
    }
    git = git_state(cwd)
    if git is not None:
        record["git"] = git
    record["exported_at"] = export_time()
    record.update(extra)
    return record


def versions(packages: Iterable[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for name in packages:
        if name in found:
            continue
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def export_time() -> str:
    """Now in UTC, or SOURCE_DATE_EPOCH when set, as ``YYYY-MM-DDTHH:MM:SSZ``."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is not None:
        try:
            when = datetime.fromtimestamp(int(epoch), UTC)
        except (ValueError, OverflowError, OSError):
            raise ExportError(
                f"SOURCE_DATE_EPOCH={epoch!r} is not a number of seconds since 1970-01-01 UTC"
            ) from None
    else:
        when = datetime.now(UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def git_state(cwd: str | Path | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool}`` for the work tree holding ``cwd``, else None.

    Dirty means tracked files differ from the commit (untracked files do not count, so
    exporting into the work tree does not make it dirty).
    """
    where = str(cwd or Path.cwd())

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", where, *args], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    if not commit:
        return None
    status = git("status", "--porcelain", "--untracked-files=no")
    state: dict[str, Any] = {"commit": commit.strip()}
    if status is not None:
        state["dirty"] = bool(status.strip())
    return state
