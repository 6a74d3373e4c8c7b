"""Host staging of a model's weights and the host-to-device copy.

A model's weights are staged in ONE host buffer with every tensor at a 64-byte aligned
offset. That layout is what makes the device copy cheap:

* on the CPU backend, PJRT adopts an aligned host array without copying it, so a
  "device load" of staged weights costs no memcpy at all (a misaligned array is copied);
* on an accelerator, staged weights are placed once in page-locked ``pinned_host``
  memory, so every later device load is a DMA straight from pinned memory, with no
  intermediate bounce buffer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from rsrv.bundle import WeightsFile

ALIGN = 64


@dataclass(eq=False, slots=True)
class HostWeights:
    """A model's weights in host memory, in argument order."""

    arrays: list  # numpy views into one aligned buffer, or pinned_host jax arrays
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
            if os.preadv(fd, [memoryview(buf[off : off + size])], wf.data_offset + w.start) != size:
                raise ValueError(f"{wf.path}: file is shorter than its header says")
            count = size // w.dtype.itemsize if w.dtype.itemsize else 0
            arrays.append(np.frombuffer(buf, w.dtype.numpy, count, off).reshape(w.shape))
    finally:
        if own:
            os.close(fd)
    return HostWeights(arrays, wf.nbytes)


def pin(host: HostWeights, device: jax.Device) -> HostWeights:
    """Move staged weights into pinned host memory where the device supports it."""
    if device.platform == "cpu":
        return host  # the CPU device adopts aligned host memory directly
    try:
        sharding = SingleDeviceSharding(device, memory_kind="pinned_host")
    except ValueError:  # no pinned_host memory space on this backend
        return host
    return HostWeights(jax.device_put(host.arrays, sharding), host.nbytes)


def to_device(host: HostWeights, device: jax.Device) -> list[jax.Array]:
    """Copy staged weights to device memory; returns when the copy is complete."""
    arrays = jax.device_put(host.arrays, SingleDeviceSharding(device))
    jax.block_until_ready(arrays)
    return arrays


def free(arrays: list[jax.Array]) -> None:
    """Release device buffers now rather than when Python collects them."""
    for a in arrays:
        if isinstance(a, jax.Array) and not a.is_deleted():
            a.delete()
