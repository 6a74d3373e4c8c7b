"""The repository watcher of ``model_control_mode: dynamic``.

Every ``model_poll_seconds`` it fingerprints each bundle (name, size and mtime of the
files that define it). A change is acted on only when the same new fingerprint is seen
on two consecutive polls, so a bundle that is still being written is never loaded:
a new bundle is loaded, a removed one unloaded, a changed one reloaded.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from rsrv.bundle import MANIFEST_NAMES

log = logging.getLogger(__name__)

_DEFINING = re.compile(r"^(model(\.b\d+)?\.mlir|model\.py|weights\.safetensors)$")
Fingerprint = tuple[tuple[str, int, int], ...]


def fingerprint(bundle: Path) -> Fingerprint | None:
    """The defining files of a bundle with their sizes and mtimes; None if it is gone."""
    try:
        files = sorted(
            p for p in bundle.iterdir() if p.name in MANIFEST_NAMES or _DEFINING.match(p.name)
        )
        if not any(p.name in MANIFEST_NAMES for p in files):
            return None
        return tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files)
    except (FileNotFoundError, NotADirectoryError):
        return None


def scan(repo: Path) -> dict[str, Fingerprint]:
    out = {}
    try:
        children = list(repo.iterdir())
    except FileNotFoundError:
        return out
    for child in children:
        if child.is_dir() and not child.name.startswith("."):
            fp = fingerprint(child)
            if fp is not None:
                out[child.name] = fp
    return out


class RepositoryWatcher:
    """Polls ``repo`` and calls ``load(path)`` / ``unload(name)`` on stable changes."""

    def __init__(
        self,
        repo: Path,
        interval: float,
        load: Callable[[Path], Awaitable[None]],
        unload: Callable[[str], Awaitable[None]],
    ):
        self.repo, self.interval = repo, interval
        self._load, self._unload = load, unload
        self.seen: dict[str, Fingerprint] = {}
        self.pending: dict[str, Fingerprint | None] = {}

    def seed(self) -> None:
        """Take the current repository as applied. Call it before the startup load, so
        that a bundle changing while it loads is seen as changed on the next polls."""
        self.seen = scan(self.repo)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.interval)
            await self.poll()

    async def poll(self) -> None:
        current = await trio.to_thread.run_sync(scan, self.repo)
        for name in sorted(set(current) | set(self.seen) | set(self.pending)):
            new, old = current.get(name), self.seen.get(name)
            if new == old:
                self.pending.pop(name, None)
                continue
            if name not in self.pending or self.pending[name] != new:
                self.pending[name] = new  # first sighting: wait for one more poll
                continue
            del self.pending[name]
            if new is None:
                del self.seen[name]
                log.info("bundle %s removed: unloading", name)
                await self._unload(name)
            else:
                self.seen[name] = new
                log.info("bundle %s %s: loading", name, "changed" if old else "added")
                await self._load(self.repo / name)
