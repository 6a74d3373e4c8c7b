"""The device allocator's statistics, as the weight budget and the scratch measurement
read them (specs/weights.md §2).

Both read one narrow interface, :class:`AllocatorStats`: ``memory_stats()`` returns the
allocator's statistics as XLA reports them (``bytes_in_use``, ``peak_bytes_in_use``,
``bytes_limit``, ``bytes_reserved``, ``largest_alloc_size``, ``num_allocs``, ...), or
None where the backend reports none (CPU). A ``jax.Device`` is the real implementation;
the tests drive the same code with a recorded sequence of statistics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class AllocatorStats(Protocol):
    """Where the device allocator's statistics come from (a ``jax.Device``)."""

    def memory_stats(self) -> Mapping[str, int] | None: ...


def allocator_limit(allocator: AllocatorStats) -> int | None:
    """The allocator's byte limit (``bytes_limit``), or None where none is reported.

    Read once, when the worker starts: XLA fixes the limit when it creates the
    allocator (``runtime.mem_fraction`` of the device's memory). A missing, zero or
    negative value (some plugins report -1 for a field they do not track) is no limit.
    """
    limit = (allocator.memory_stats() or {}).get("bytes_limit")
    return int(limit) if limit is not None and limit > 0 else None


def measured_scratch(
    at_lease: Mapping[str, int] | None, after: Mapping[str, int] | None
) -> int | None:
    """Device memory one execution needed beyond what was in use when it started, in
    bytes, or None when the statistics cannot say.

    ``at_lease`` is read when the execution's weights were leased (resident, the device
    lock held, nothing else executing), ``after`` as soon as the execution returned.
    ``peak_bytes_in_use`` is the allocator's high-water mark since the process started,
    not since ``at_lease``, so it describes this execution only if the execution raised
    it: then the scratch is ``after.peak_bytes_in_use - at_lease.bytes_in_use``. An
    execution that stayed under an earlier high-water mark needed at most
    ``at_lease.peak_bytes_in_use - at_lease.bytes_in_use``, which says nothing about this
    model when memory in use has since dropped (after a compaction, say), so it gives
    no figure (None), as does a backend without statistics.
    """
    if not at_lease or not after:
        return None
    in_use = at_lease.get("bytes_in_use")
    peak_before = at_lease.get("peak_bytes_in_use")
    peak = after.get("peak_bytes_in_use")
    if in_use is None or peak_before is None or peak is None or min(in_use, peak) < 0:
        return None
    if peak <= peak_before:
        return None
    return max(0, int(peak - in_use))
