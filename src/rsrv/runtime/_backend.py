"""Process-wide PJRT backend set-up. Call :func:`configure` before any device work.

XLA reads its allocator settings when the backend client is created, which JAX does
lazily on first use, so setting them here (before :func:`device`) takes effect.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

_configured: tuple | None = None


class DeviceUnavailable(RuntimeError):
    """The configured backend has no device this process can use."""


@dataclass(frozen=True)
class DeviceInfo:
    """The device a worker really got.

    ``platform`` and ``kind`` as PJRT reports them (``"gpu"``, ``"NVIDIA H100 80GB
    HBM3"``); ``id`` the device's ordinal in this process; ``visible`` the
    ``CUDA_VISIBLE_DEVICES`` the process ran with, which names the physical device;
    ``fallback`` true when the backend asked for was cuda and the CPU answered instead.
    """

    platform: str
    kind: str
    id: int
    visible: str | None
    fallback: bool

    def describe(self) -> str:
        where = f" (CUDA_VISIBLE_DEVICES={self.visible})" if self.visible is not None else ""
        return f"{self.platform} device {self.id}, {self.kind}{where}"


def configure(
    backend: str = "cpu",
    *,
    mem_fraction: float = 0.9,
    preallocate: bool = True,
    allow_cpu_fallback: bool = False,
    visible_device: str | None = None,
) -> None:
    """Select the platform and the device allocator policy. Idempotent for equal settings.

    ``visible_device`` (a cuda backend only): the one device, an ordinal or a UUID, the
    process may see; it becomes ``CUDA_VISIBLE_DEVICES``, so it is device 0 here. Must
    run before anything touches a device; raises RuntimeError when asked to change
    settings already applied.
    """
    global _configured
    settings = (backend, mem_fraction, preallocate, allow_cpu_fallback, visible_device)
    if _configured == settings:
        return
    if _configured is not None:
        raise RuntimeError(f"backend already configured as {_configured}, cannot change it")
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = repr(mem_fraction)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if preallocate else "false"
    if backend == "cuda" and visible_device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_device
    platforms = "cuda,cpu" if backend == "cuda" and allow_cpu_fallback else backend
    jax.config.update("jax_platforms", platforms)
    # Keep 64-bit inputs 64-bit: without this, device_put narrows int64/float64 arrays.
    jax.config.update("jax_enable_x64", True)
    # A CPU execution runs on the calling thread: handing each one to PJRT's own thread
    # and waiting for it costs more than a small model's execution (figure 1: +13% req/s
    # at c = 1 under h2load, paired). It does not affect accelerator backends.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    _configured = settings


def open_device() -> DeviceInfo:
    """Start the configured backend and report the device this worker executes on.

    Raises DeviceUnavailable, with one line saying what to do, when the backend has no
    usable device (no CUDA plugin installed, no GPU, a driver that fails).
    """
    if _configured is None:
        configure()
    assert _configured is not None
    backend, allow_cpu_fallback = _configured[0], _configured[3]
    try:
        first = jax.devices()[0]
    except Exception as e:  # PJRT reports a missing plugin or driver in many ways
        text = str(e).strip()
        detail = text.splitlines()[0] if text else "JAX found no device for it"
        raise DeviceUnavailable(
            f"backend {backend!r} has no usable device ({detail}): install the CUDA build "
            "(pip install -e '.[cuda]' in a checkout, or 'rsrv[cuda]') on a machine with "
            "an NVIDIA GPU, or set runtime.allow_cpu_fallback"
        ) from None
    on_cuda = backend == "cuda" and first.platform != "cpu"  # (not a fallback)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if on_cuda else None
    return DeviceInfo(
        first.platform,
        first.device_kind,
        first.id,
        visible,
        fallback=backend == "cuda" and allow_cpu_fallback and first.platform == "cpu",
    )


def device() -> jax.Device:
    """The single device this worker executes on."""
    if _configured is None:
        configure()
    return jax.devices()[0]


def platform() -> str:
    return device().platform
