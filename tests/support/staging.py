"""The two staging routes, and what each must look like on the CPU device.

Tests run every weight test on both routes (specs/weights.md §5):

* ``pageable`` (the CPU default): a ``system`` model's floor is an aligned numpy buffer
  and its device arrays alias it (PJRT adopted it: zero-copy);
* ``pinned`` (the accelerator route, selected on CPU): the floor is in ``pinned_host``
  memory and the device arrays are copies in ``device`` memory, distinct buffers.
"""

from __future__ import annotations

import jax
import numpy as np

from rsrv.runtime import Staging

ROUTES = [Staging.PAGEABLE, Staging.PINNED]
ROUTE_IDS = [r.value for r in ROUTES]


def pointer(a) -> int:
    """Where an array's bytes are: numpy (host) or jax (any memory space)."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.unsafe_buffer_pointer()


def assert_staged(route: Staging, host: list, on_device: list) -> None:
    """``on_device`` (a resident model's device arrays) relate to ``host`` (its staged
    floor) as ``route`` says: aliased on ``pageable``, copied out of ``pinned_host`` on
    ``pinned``. Zero-size tensors have no buffer to compare."""
    assert len(host) == len(on_device)
    for h, d in zip(host, on_device, strict=True):
        assert isinstance(d, jax.Array) and not d.is_deleted()
        assert d.sharding.memory_kind == "device"
        if route is Staging.PINNED:
            assert isinstance(h, jax.Array) and not h.is_deleted()
            assert h.sharding.memory_kind == "pinned_host"
        else:
            assert isinstance(h, np.ndarray)
        if h.size:
            aliased = pointer(h) == pointer(d)
            assert aliased is (route is Staging.PAGEABLE), (route, pointer(h), pointer(d))
