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

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from rsrv.runtime.weights import WeightsFile

ALIGN = 64


@dataclass(eq=False, slots=True)
class HostWeights:
    """A model's weights in host memory, in argument order."""

    arrays: list  # numpy views into one aligned buffer, or pinned_host jax arrays
    nbytes: int


def stage(wf: WeightsFile) -> HostWeights:
    """Read the weights file into one aligned buffer (sequential reads, one open)."""
    offsets, total = [], 0
    for w in wf.weights:
        offsets.append(total)
        total += -(-(w.end - w.start) // ALIGN) * ALIGN
    raw = np.empty(total + ALIGN, np.uint8)
    base = (-raw.ctypes.data) % ALIGN
    buf = raw[base : base + total]
    arrays = []
    with open(wf.path, "rb", buffering=0) as f:
        for w, off in zip(wf.weights, offsets, strict=True):
            size = w.end - w.start
            f.seek(wf.data_offset + w.start)
            if f.readinto(memoryview(buf[off : off + size])) != size:
                raise ValueError(f"{wf.path}: file is shorter than its header says")
            count = size // w.dtype.itemsize if w.dtype.itemsize else 0
            arrays.append(np.frombuffer(buf, w.dtype.numpy, count, off).reshape(w.shape))
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
