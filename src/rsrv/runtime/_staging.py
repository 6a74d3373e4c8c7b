"""Host staging of a model's weights, where the staged floor lives, and the device copy.

A model's weights are staged in ONE host buffer with every tensor at a 64-byte aligned
offset. Where that floor then lives is the **staging route**, decided once per worker by
:func:`staging_route` (``runtime.weight_staging``, specs/weights.md §5):

* ``Staging.PAGEABLE`` — the floor stays in the aligned (pageable) host buffer. The CPU
  backend's default: PJRT adopts an aligned host array as a device buffer without copying
  it, so a "device load" of staged weights moves no byte. (On an accelerator this route
  is valid too: each load is then a copy from pageable memory.)
* ``Staging.PINNED`` — the floor is moved once, at model load, into the device's
  ``pinned_host`` (page-locked) memory space, and every device load is a real copy from
  there into ``device`` memory: a DMA on an accelerator, a memcpy on the CPU backend,
  whose device also has the ``pinned_host`` and ``device`` memory spaces. The default
  wherever the device is not a CPU and has ``pinned_host`` memory; selectable on CPU,
  which is how the tests run the accelerator route without an accelerator.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from rsrv.bundle import WeightsFile

ALIGN = 64
PINNED_HOST = "pinned_host"


class Staging(enum.Enum):
    """Where a model's staged host floor lives; see the module docstring."""

    PAGEABLE = "pageable"
    PINNED = "pinned"

    def describe(self) -> str:
        """One line for the worker's log: what a device load does on this route."""
        if self is Staging.PINNED:
            return (
                "pinned: staged weights are placed once in pinned_host memory; every "
                "device load copies them into device memory"
            )
        return (
            "pageable: staged weights stay in an aligned host buffer; the CPU device "
            "adopts it without a copy (another device copies it on every load)"
        )


def memory_kinds(device: jax.Device) -> set[str]:
    """The memory spaces the device can address (CPU: device, pinned_host, unpinned_host)."""
    return {m.kind for m in device.addressable_memories()}


def staging_route(device: jax.Device, requested: str = "auto") -> Staging:
    """The staging route for ``device``: ``requested`` (``runtime.weight_staging``) if it
    names one, else the device's default, decided here and nowhere else.

    ``auto``: ``pageable`` on the CPU backend (zero-copy adoption), ``pinned`` on any
    other device that has a ``pinned_host`` memory space, ``pageable`` on one that has
    none. ``pinned`` on a device without ``pinned_host`` memory is a ValueError.
    """
    if requested == "auto":
        if device.platform != "cpu" and PINNED_HOST in memory_kinds(device):
            return Staging.PINNED
        return Staging.PAGEABLE
    route = Staging(requested)  # ValueError on an unknown name
    if route is Staging.PINNED and PINNED_HOST not in memory_kinds(device):
        raise ValueError(
            f"pinned staging needs a {PINNED_HOST} memory space; device {device} has "
            f"{', '.join(sorted(memory_kinds(device))) or 'none'}"
        )
    return route


@dataclass(eq=False, slots=True)
class HostWeights:
    """A model's weights in host memory, in argument order."""

    arrays: list  # numpy views into one aligned buffer (pageable), or pinned_host jax arrays
    nbytes: int


def stage(wf: WeightsFile, fd: int | None = None) -> HostWeights:
    """Read the weights file into one aligned buffer (sequential reads, one open).

    ``fd``, when given, is an open descriptor of the file to read instead of its path:
    it keeps reading the file as it was when opened even if the path is replaced.
    """
    offsets, total = [], 0
    for w in wf.weights:
        offsets.append(total)
        total += -(-(w.end - w.start) // ALIGN) * ALIGN
    raw = np.empty(total + ALIGN, np.uint8)
    base = (-raw.ctypes.data) % ALIGN
    buf = raw[base : base + total]
    arrays = []
    own = fd is None
    if own:
        fd = os.open(wf.path, os.O_RDONLY)
    try:
        for w, off in zip(wf.weights, offsets, strict=True):
            size = w.end - w.start
            _read_into(fd, memoryview(buf[off : off + size]), wf.data_offset + w.start, wf.path)
            count = size // w.dtype.itemsize if w.dtype.itemsize else 0
            arrays.append(np.frombuffer(buf, w.dtype.numpy, count, off).reshape(w.shape))
    finally:
        if own:
            os.close(fd)
    return HostWeights(arrays, wf.nbytes)


def _read_into(fd: int, view: memoryview, offset: int, path: object) -> None:
    """Fill ``view`` from ``fd`` at ``offset``: as many reads as it takes (Linux reads at
    most 2 GiB - 4 KiB at a time); ValueError when the file ends first."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ValueError(f"{path}: file is shorter than its header says")
        done += n


def pin(host: HostWeights, device: jax.Device) -> HostWeights:
    """Move staged weights into the device's ``pinned_host`` memory (the ``pinned``
    route's floor). On an accelerator this is a copy into page-locked memory; the CPU
    device adopts the aligned buffer there too."""
    sharding = SingleDeviceSharding(device, memory_kind=PINNED_HOST)
    arrays = jax.device_put(host.arrays, sharding)
    jax.block_until_ready(arrays)
    return HostWeights(arrays, host.nbytes)


def place(host: HostWeights, route: Staging, device: jax.Device) -> HostWeights:
    """The staged floor of a ``system`` model where ``route`` keeps it."""
    return pin(host, device) if route is Staging.PINNED else host


def to_device(host: HostWeights, device: jax.Device) -> list[jax.Array]:
    """Put staged weights in ``device`` memory; returns when the transfer is complete.

    From ``pinned_host`` arrays this is always a copy (a DMA on an accelerator). From a
    pageable numpy buffer it is a copy on an accelerator, while the CPU device adopts
    the 64-byte aligned buffer without copying it.
    """
    arrays = jax.device_put(host.arrays, SingleDeviceSharding(device))
    jax.block_until_ready(arrays)
    return arrays


def free(arrays: list[jax.Array]) -> None:
    """Release device buffers now rather than when Python collects them."""
    for a in arrays:
        if isinstance(a, jax.Array) and not a.is_deleted():
            a.delete()
