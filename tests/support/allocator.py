"""Allocator statistics shaped like a GPU's, replayed in order (the one stand-in the
weight tests use: CPU reports no allocator statistics, so the budget derived from the
device limit and the scratch measured at warm-up never run on CPU otherwise).

The keys are those XLA's GPU allocator reports through ``jax.Device.memory_stats()``;
the magnitudes are those of an 80 GB H100 with ``runtime.mem_fraction = 0.9``. They were
written by hand, not recorded: no GPU was available to this repository.
"""

from __future__ import annotations

from collections.abc import Iterable

#: ``bytes_limit`` of the allocator on an 80 GB H100 (81,559 MiB) at mem_fraction 0.9,
#: rounded down to 256 bytes.
H100_LIMIT = 76_968_728_832
MIB = 2**20
GIB = 2**30


def gpu_stats(
    in_use: int, peak: int, *, num_allocs: int, largest_alloc: int, limit: int = H100_LIMIT
) -> dict[str, int]:
    """One ``memory_stats()`` answer of a preallocating GPU allocator."""
    assert 0 <= in_use <= peak <= limit and largest_alloc <= peak
    return {
        "bytes_in_use": in_use,
        "peak_bytes_in_use": peak,
        "largest_alloc_size": largest_alloc,
        "num_allocs": num_allocs,
        "bytes_limit": limit,
        "bytes_reservable_limit": limit,
        "bytes_reserved": 0,
        "peak_bytes_reserved": 0,
        "largest_free_block_bytes": limit - in_use,
        "pool_bytes": limit,
        "peak_pool_bytes": limit,
    }


class Recording:
    """Builds the statistics of a sequence of executions, each read at its lease and
    right after it returns, keeping the counters consistent (monotonic peak, allocation
    count, largest allocation)."""

    def __init__(self, in_use: int = 0):
        self.in_use, self.peak, self.allocs, self.largest = in_use, in_use, 0, 0
        self.snapshots: list[dict[str, int]] = []

    def now(self) -> dict[str, int]:
        return gpu_stats(self.in_use, self.peak, num_allocs=self.allocs, largest_alloc=self.largest)

    def start(self) -> Recording:
        """The read when the worker starts (its byte limit)."""
        self.snapshots.append(self.now())
        return self

    def weights(self, nbytes: int) -> Recording:
        """Weights loaded (positive) or freed (negative) between reads."""
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        self.allocs += nbytes > 0
        self.largest = max(self.largest, nbytes)
        return self

    def execution(self, scratch: int) -> Recording:
        """One execution that needed ``scratch`` bytes above what was in use at its lease."""
        self.snapshots.append(self.now())
        self.peak = max(self.peak, self.in_use + scratch)
        self.allocs += 3  # inputs, the temporary buffer, outputs
        self.largest = max(self.largest, scratch)
        self.snapshots.append(self.now())
        return self


class RecordedAllocator:
    """An ``AllocatorStats`` answering ``memory_stats()`` with ``snapshots`` in order.

    Reading past the end is a test failure: the test says how many reads it expects.
    """

    def __init__(self, snapshots: Iterable[dict[str, int]]):
        self.snapshots = list(snapshots)
        self.reads = 0

    def memory_stats(self) -> dict[str, int]:
        assert self.reads < len(self.snapshots), (
            f"read {self.reads + 1} of allocator statistics; {len(self.snapshots)} recorded"
        )
        self.reads += 1
        return dict(self.snapshots[self.reads - 1])

    @property
    def left(self) -> int:
        return len(self.snapshots) - self.reads
