"""Compile StableHLO with PJRT, with a persistent executable cache on disk.

The cache key covers the module bytes and everything that changes the machine code
(jax/jaxlib version, platform and its version, device kind), so a restart, or a second
bundle with an identical module, loads the executable instead of compiling it again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jaxlib
from jax._src.lib import xla_client

from rsrv.runtime._backend import device

log = logging.getLogger(__name__)
_KEY_VERSION = b"rsrv-exe-1"


@dataclass(frozen=True, slots=True)
class CompileResult:
    executable: object  # jaxlib LoadedExecutable
    seconds: float
    cached: bool


class Compiler:
    """Compiles modules for the configured device; thread-safe (each call is independent)."""

    def __init__(self, cache_dir: Path | None = None):
        self._device = device()
        self._client = self._device.client
        self._devices = xla_client.DeviceList((self._device,))
        self._cache = Path(cache_dir) / "executables" if cache_dir else None
        self._salt = hashlib.sha256(
            b"\0".join(
                [
                    _KEY_VERSION,
                    jax.__version__.encode(),
                    jaxlib.__version__.encode(),
                    self._client.platform.encode(),
                    self._client.platform_version.encode(),
                    self._device.device_kind.encode(),
                ]
            )
        ).digest()

    def compile(self, source: bytes | str) -> CompileResult:
        """Compile ``source`` (StableHLO text or portable bytecode), or load it from cache."""
        start = time.perf_counter()
        options = xla_client.CompileOptions()
        path = self._entry(source)
        if path is not None and path.is_file():
            try:
                exe = self._client.deserialize_executable(path.read_bytes(), self._devices, options)
                return CompileResult(exe, time.perf_counter() - start, True)
            except Exception as e:  # a stale or truncated entry: recompile and replace it
                log.warning("ignoring unreadable compilation cache entry %s: %s", path, e)
        exe = self._client.compile_and_load(source, self._devices, options)
        if path is not None:
            self._store(path, self._client.serialize_executable(exe))
        return CompileResult(exe, time.perf_counter() - start, False)

    def _entry(self, source: bytes | str) -> Path | None:
        if self._cache is None:
            return None
        data = source.encode() if isinstance(source, str) else source
        return self._cache / f"{hashlib.sha256(self._salt + data).hexdigest()}.bin"

    @staticmethod
    def _store(path: Path, blob: bytes) -> None:
        """Write atomically so a concurrent reader never sees a partial entry."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:  # the cache is an optimisation; never fail a load over it
            log.warning("cannot write compilation cache entry %s: %s", path, e)
