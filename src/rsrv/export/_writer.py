"""Writing a bundle: staged beside its directory, checked, then swapped in.

The files are written into a hidden staging directory next to ``out_dir``
(``.{name}-XXXX``, which repository scans ignore), checked there, and only then put in
place of ``out_dir`` in one step (Linux; elsewhere ``out_dir`` is missing for a moment,
see ``_swap_in``): a reader sees the old bundle or the new one, and a failure or an
interrupt at any point leaves the old one as it was. ``out_dir`` is replaced as a whole,
so a directory holding anything but a bundle's own files is refused, never deleted.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from rsrv.bundle import MANIFEST_NAMES, ORDER_KEY, Manifest, defines_bundle
from rsrv.export._errors import ExportError
from rsrv.versions import version_dir_number


def check_replaceable(out_dir: Path) -> None:
    """Raise :class:`ExportError` unless ``out_dir`` is absent, empty, or a bundle
    directory holding nothing but a bundle's own files (what an export would replace)."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if out_dir.is_symlink() or not out_dir.is_dir():
        what = "a symbolic link" if out_dir.is_symlink() else "not a directory"
        raise ExportError(f"{out_dir} is {what}, not a bundle directory. Nothing was written.")
    try:
        entries = sorted(out_dir.iterdir())
    except OSError as e:
        raise ExportError(f"{out_dir} cannot be read ({e}). Nothing was written.") from None
    if not entries:
        return  # (an empty directory: made to export into)
    versions = [e.name for e in entries if version_dir_number(e.name) is not None]
    if versions:
        raise ExportError(
            f"{out_dir} holds version directories ({', '.join(versions)}), which an export "
            f"would delete: export a version into {out_dir}/<N> instead. Nothing was written."
        )
    if not any(e.name in MANIFEST_NAMES for e in entries):
        raise ExportError(
            f"{out_dir} exists and holds no bundle (no manifest), which an export would "
            "delete: remove it or export elsewhere. Nothing was written."
        )
    others = [
        e.name
        for e in entries
        if e.name not in (*MANIFEST_NAMES, "__pycache__") and not defines_bundle(e.name)
    ]
    if others:
        raise ExportError(
            f"{out_dir} holds files a bundle export does not write ({', '.join(others)}), "
            "which replacing the bundle would delete: move them away or export elsewhere. "
            "Nothing was written."
        )


def write_bundle(
    out_dir: Path,
    manifest: Manifest,
    modules: dict[int, bytes],
    weight_names: list[str],
    weights: list[np.ndarray],
    model_py: str | None,
    verify: Callable[[Path], None],
) -> Path:
    """Write the bundle into a staging directory next to ``out_dir``, run ``verify`` on
    it, then swap it in (see the module docstring). Raises :class:`ExportError` when
    ``out_dir`` is not replaceable by then (:func:`check_replaceable`; check it before
    the work too, to fail early) and whatever ``verify`` raises; on any failure the
    staging directory is removed, and so are the parents of ``out_dir`` it made, and
    ``out_dir`` is left as it was."""
    from safetensors.numpy import save_file

    made = _make_parents(out_dir.parent)  # (removed again when refused)
    staging = None
    try:
        staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
        doc = {k: v for k, v in msgspec.to_builtins(manifest).items() if v not in (None, {}, [])}
        (staging / "manifest.yaml").write_bytes(msgspec.yaml.encode(doc))
        for n, data in modules.items():
            (staging / ("model.mlir" if n == 0 else f"model.b{n}.mlir")).write_bytes(data)
        tensors = {
            name: np.asarray(w, order="C")  # keeps 0-d weights 0-d
            for name, w in zip(weight_names, weights, strict=True)
        }
        save_file(
            tensors,
            str(staging / "weights.safetensors"),
            metadata={ORDER_KEY: json.dumps(weight_names)},
        )
        if model_py is not None:
            (staging / "model.py").write_text(model_py)
        staging.chmod(0o755)  # mkdtemp creates 0700; a bundle is meant to be shared
        for file in staging.iterdir():
            file.chmod(0o644)
        verify(staging)
        check_replaceable(out_dir)  # (as it is now: the caller's check came before the work)
        _swap_in(staging, out_dir)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        _remove_made(made)
        raise
    return out_dir


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; returns those it created, deepest
    first."""
    missing = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_made(made: list[Path]) -> None:
    """Remove the directories :func:`_make_parents` created, while empty (a refused
    export writes nothing)."""
    for d in made:
        try:
            d.rmdir()
        except OSError:
            return


def _swap_in(staging: Path, out_dir: Path) -> None:
    """Put ``staging`` in place of ``out_dir``: in one step where the system can swap
    two directories (Linux's ``renameat2`` with ``RENAME_EXCHANGE``), then the old one,
    now at ``staging``, is deleted. Elsewhere the old directory is renamed aside first,
    put back if the new one cannot be renamed in, then deleted: for that moment
    ``out_dir`` is missing."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    if _exchange(staging, out_dir):
        shutil.rmtree(staging, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-old-"))
    out_dir.rename(old)  # (onto an empty directory: allowed)
    try:
        staging.rename(out_dir)
    except BaseException:
        if not out_dir.exists():
            old.rename(out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap paths ``a`` and ``b`` atomically; False where the system or the file system
    cannot (then nothing happened). Raises OSError for any other failure."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # (not Linux, or a C library without it)
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))
