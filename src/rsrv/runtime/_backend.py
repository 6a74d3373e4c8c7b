"""Process-wide PJRT backend set-up. Call :func:`configure` before any device work.

XLA reads its allocator settings when the backend client is created, which JAX does
lazily on first use, so setting them here (before :func:`device`) takes effect.
"""

from __future__ import annotations

import os

import jax

_configured: tuple | None = None


def configure(
    backend: str = "cpu",
    *,
    mem_fraction: float = 0.9,
    preallocate: bool = True,
    allow_cpu_fallback: bool = False,
) -> None:
    """Select the platform and the device allocator policy. Idempotent for equal settings."""
    global _configured
    settings = (backend, mem_fraction, preallocate, allow_cpu_fallback)
    if _configured == settings:
        return
    if _configured is not None:
        raise RuntimeError(f"backend already configured as {_configured}, cannot change it")
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = repr(mem_fraction)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
    platforms = "cuda,cpu" if backend == "cuda" and allow_cpu_fallback else backend
    jax.config.update("jax_platforms", platforms)
    # Keep 64-bit inputs 64-bit: without this, device_put narrows int64/float64 arrays.
    jax.config.update("jax_enable_x64", True)
    _configured = settings


def device() -> jax.Device:
    """The single device this worker executes on."""
    if _configured is None:
        configure()
    return jax.devices()[0]


def platform() -> str:
    return device().platform
