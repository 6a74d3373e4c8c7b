"""A model repository: a directory whose immediate subdirectories are models, each
holding one bundle (version 1) or numbered version directories of bundles."""

from __future__ import annotations

import logging
from pathlib import Path

from rsrv.bundle._loader import Bundle, load_bundle
from rsrv.bundle._manifest import MANIFEST_NAMES, decode_manifest
from rsrv.errors import BundleError
from rsrv.versions import VersionPolicy, version_dir_number

log = logging.getLogger("rsrv.bundle")


def has_manifest(path: Path) -> bool:
    """``path`` holds a manifest (one or more: load_bundle reports two), or something
    named as one (a dangling symbolic link: load_bundle says what is wrong with it, where
    skipping the directory would hide the model). Raises BundleError when it cannot be
    read (no permission: it may hold one)."""
    try:
        for name in MANIFEST_NAMES:
            try:
                (path / name).lstat()
            except (FileNotFoundError, NotADirectoryError):
                continue
            return True
        return False
    except OSError as e:
        raise BundleError(f"{path}: cannot be read: {e.strerror or e}") from None


def model_versions(model_dir: Path) -> dict[int, Path]:
    """Version number -> bundle directory of one model directory, ascending.

    A manifest directly in ``model_dir`` makes it the model's only version, 1. Otherwise
    its versions are the subdirectories named by a positive decimal number (no leading
    zero) that hold a manifest; other entries are ignored. A manifest beside version
    directories is ambiguous: BundleError, as is a version directory that cannot be read
    (its versions are not known).
    """
    model_dir = Path(model_dir)
    try:
        children = sorted(model_dir.iterdir())
    except OSError as e:
        raise BundleError(f"{model_dir}: cannot list the model directory: {e.strerror}") from None
    found = {}
    for child in children:
        number = version_dir_number(child.name)
        if number is not None and child.is_dir() and has_manifest(child):
            found[number] = child
    if has_manifest(model_dir):
        if found:
            listed = ", ".join(str(n) for n in sorted(found))
            raise BundleError(
                f"{model_dir}: a manifest directly in the model directory makes it version 1, "
                f"but it also holds version directories ({listed}); keep one layout"
            )
        return {1: model_dir}
    return dict(sorted(found.items()))


def version_policy_of(versions: dict[int, Path]) -> VersionPolicy | None:
    """The ``version_policy`` that the manifest of the highest-numbered version declares;
    None when it declares none or cannot be read (loading that version says why)."""
    if not versions:
        return None
    path = versions[max(versions)]
    for name in MANIFEST_NAMES:
        if (path / name).is_file():
            try:
                return decode_manifest(path / name).version_policy
            except BundleError:
                return None
    return None


def is_model_name(name: str) -> bool:
    """Whether a repository entry's name can name a model: UTF-8, as every name on the
    wire is (a directory named in another encoding is passed over, logged once)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        if name not in _passed_over:
            _passed_over.add(name)
            log.warning("model repository entry %r is not UTF-8: not a model", name)
        return False
    return True


_passed_over: set[str] = set()


def discover(repo: Path) -> list[Path]:
    """Model directories in ``repo`` (holding a manifest, or version directories that
    hold one, or that cannot be read), sorted by name. BundleError when ``repo`` is not
    a directory that can be listed."""
    repo = Path(repo)
    try:
        if not repo.is_dir():
            raise BundleError(f"{repo}: model repository is not a directory")
        children = sorted(repo.iterdir())
    except OSError as e:
        raise BundleError(f"{repo}: cannot list the model repository: {e.strerror}") from None
    out = []
    for child in children:
        if child.name.startswith(".") or not is_model_name(child.name):  # (hidden: no warning)
            continue
        try:
            if not child.is_dir():
                continue
            if has_manifest(child) or any(
                version_dir_number(v.name) is not None and v.is_dir() and has_manifest(v)
                for v in child.iterdir()
            ):
                out.append(child)
        except (OSError, BundleError):  # unreadable: loading it says why
            out.append(child)
    return out


def scan(repo: Path) -> dict[str, Bundle | BundleError]:
    """Load every model in ``repo``: its highest-numbered version. A broken bundle maps
    to its error; others still load."""
    return {path.name: _try_load(path) for path in discover(repo)}


def _try_load(path: Path) -> Bundle | BundleError:
    try:
        versions = model_versions(path)
        if not versions:
            raise BundleError(f"{path}: no manifest and no version directory holding one")
        return load_bundle(versions[max(versions)], path.name)
    except BundleError as e:
        return e
    except Exception as e:  # a check the loader lacks: still this bundle's failure only
        return BundleError(f"{path}: cannot be loaded: {type(e).__name__}: {e}")
