"""A model repository: a directory whose immediate subdirectories are bundles."""

from __future__ import annotations

from pathlib import Path

from rsrv.bundle._loader import Bundle, find_manifest, load_bundle
from rsrv.errors import BundleError


def discover(repo: Path) -> list[Path]:
    """Bundle directories in ``repo`` (those holding a manifest), sorted by name."""
    repo = Path(repo)
    if not repo.is_dir():
        raise BundleError(f"{repo}: model repository is not a directory")
    out = []
    for child in sorted(repo.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        try:
            if find_manifest(child) is None:
                continue
        except BundleError:
            pass  # two manifests: still a bundle, load_bundle reports it
        out.append(child)
    return out


def scan(repo: Path) -> dict[str, Bundle | BundleError]:
    """Load every bundle in ``repo``. A broken bundle maps to its error; others still load."""
    return {path.name: _try_load(path) for path in discover(repo)}


def _try_load(path: Path) -> Bundle | BundleError:
    try:
        return load_bundle(path)
    except BundleError as e:
        return e
