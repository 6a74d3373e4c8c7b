"""The repository watcher of ``model_control_mode: dynamic``.

Every ``model_poll_seconds`` it fingerprints each model directory: the name, size,
mtime, inode and ctime of the files that define each of its bundles (the directory
itself, or each of its version directories). A change is acted on only when the same
new fingerprint is seen on two consecutive polls, so a bundle that is still being
written is never loaded: a new model is loaded, a removed one unloaded, a changed one
reloaded (the worker rebuilds only the versions whose own fingerprint changed, loads
added ones beside them and retires removed ones). Each model's change runs as a task of
its own: a slow load (a long compile, a slow ``model.py``) delays no other model's
change and no poll; the loader's per-model lock keeps one model's changes in the order
they were seen.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from rsrv.bundle import MANIFEST_NAMES, defines_bundle, is_model_name
from rsrv.versions import version_dir_number

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, int, int, int, int], ...]  # name, size, mtime, inode, ctime


def fingerprint(bundle: Path) -> Fingerprint | None:
    """The defining files of a bundle with their sizes, mtimes, inodes and ctimes: a file
    replaced by one of the same size and mtime, as reproducible builds and ``cp -p``
    make, has another inode, or reuses the freed one with a new ctime (which a ``chmod``
    or a hard link elsewhere changes too: a reload then, served by the compilation
    cache, rather than new weights missed); None if it is gone.
    One that cannot be read (no permission, a symbolic link loop) has a fingerprint of
    its own, saying so: a change (loading it reports the error, and keeps what it
    serves), neither gone nor the same."""
    try:
        files = sorted(
            p for p in bundle.iterdir() if p.name in MANIFEST_NAMES or defines_bundle(p.name)
        )
        if not any(p.name in MANIFEST_NAMES for p in files):
            return None
        return tuple(
            (p.name, (st := p.stat()).st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
            for p in files
        )
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        return (("<unreadable>", e.errno or 0, 0, 0, 0),)


ModelFingerprint = tuple[tuple[str, Fingerprint], ...]


def model_fingerprint(model: Path) -> ModelFingerprint | None:
    """The fingerprints of a model directory's bundles: ("", ...) for a bundle directly
    in it, (version, ...) for each version directory; None if it holds none. Raises
    OSError when the directory exists but cannot be listed."""
    out = []
    own = fingerprint(model)
    if own is not None:
        out.append(("", own))
    try:
        children = sorted(model.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return None
    for child in children:
        if version_dir_number(child.name) is not None:
            fp = fingerprint(child)
            if fp is not None:
                out.append((child.name, fp))
    return tuple(out) or None


class Unreadable(str):
    """What :func:`scan` gives a model whose directory cannot be read now: why."""


def scan(repo: Path) -> dict[str, ModelFingerprint | Unreadable]:
    """The fingerprint of each model in ``repo``, or :class:`Unreadable` for one whose
    directory cannot be read now. Raises OSError when ``repo`` exists but cannot be
    listed."""
    out: dict[str, ModelFingerprint | Unreadable] = {}
    try:
        children = list(repo.iterdir())
    except FileNotFoundError:
        return out
    for child in children:
        if child.name.startswith(".") or not is_model_name(child.name):  # (hidden: no warning)
            continue
        try:
            if child.is_dir():
                fp = model_fingerprint(child)
                if fp is not None:
                    out[child.name] = fp
        except OSError as e:
            out[child.name] = Unreadable(e)
    return out


Spawn = Callable[..., object]  # trio.Nursery.start_soon


class RepositoryWatcher:
    """Polls ``repo`` and calls ``load(path)`` / ``unload(name)`` on stable changes, each
    in a task of its own."""

    def __init__(
        self,
        repo: Path,
        interval: float,
        load: Callable[[Path], Awaitable[None]],
        unload: Callable[[str], Awaitable[None]],
    ):
        self.repo, self.interval = repo, interval
        self._load, self._unload = load, unload
        self.seen: dict[str, ModelFingerprint] = {}
        self.pending: dict[str, ModelFingerprint | None] = {}
        self.unreadable: dict[str, str] = {}  # model (or "" for the repository) -> why

    def seed(self) -> None:
        """Take the current repository as applied. Call it before the startup load, so
        that a bundle changing while it loads is seen as changed on the next polls."""
        try:
            self.seen = {
                n: fp for n, fp in scan(self.repo).items() if not isinstance(fp, Unreadable)
            }
        except OSError:
            self.seen = {}  # (the startup load says why)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as changes:
            task_status.started()
            while True:
                await trio.sleep(self.interval)
                await self.poll(changes.start_soon)

    async def poll(self, spawn: Spawn) -> None:
        """One look at the repository; ``spawn(fn, *args)`` starts each change it acts
        on (``load`` or ``unload``). One that cannot be read changes nothing."""
        try:
            current = await trio.to_thread.run_sync(scan, self.repo)
        except OSError as e:
            self._unreadable("", f"model repository {self.repo}", e)
            return
        self._unreadable("", "", None)
        for name in sorted(set(current) | set(self.seen) | set(self.pending)):
            new, old = current.get(name), self.seen.get(name)
            self._unreadable(name, f"model directory {self.repo / name}", new)
            if isinstance(new, Unreadable):
                continue  # left as it was, pending or not
            if new == old:
                self.pending.pop(name, None)
                continue
            if name not in self.pending or self.pending[name] != new:
                self.pending[name] = new  # first sighting: wait for one more poll
                continue
            del self.pending[name]
            if new is None:
                del self.seen[name]
                log.info("model %s removed: unloading", name)
                spawn(self._unload, name)
            else:
                self.seen[name] = new
                log.info("model %s %s: loading", name, "changed" if old else "added")
                spawn(self._load, self.repo / name)

    def _unreadable(self, key: str, what: str, error: object) -> None:
        """Log once when ``key`` becomes unreadable (``error`` an OSError or
        :class:`Unreadable`), and once when it is readable again."""
        unreadable = isinstance(error, (OSError, Unreadable))
        if unreadable and key not in self.unreadable:
            self.unreadable[key] = what
            log.warning("%s cannot be read (%s): left as it is until it can", what, error)
        elif not unreadable and key in self.unreadable:
            log.info("%s is no longer unreadable", self.unreadable.pop(key))
