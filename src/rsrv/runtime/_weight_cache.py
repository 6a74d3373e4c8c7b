"""The device weight cache: which models' weights are on the device, LRU under a budget.

Pure bookkeeping with no I/O and no locking: every caller (the transfer task, leases,
prefetch, compaction, residency changes) runs on the worker's single trio thread.
``budget`` None means the cache is off and every model stays resident.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import jax

from rsrv.runtime._staging import free

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Resident:
    arrays: list[jax.Array]
    nbytes: int
    leases: int = 0  # executions using these buffers right now; never evicted while > 0


@dataclass(slots=True)
class CacheCounters:
    loads: int = 0
    evictions: int = 0
    load_seconds: float = 0.0
    bytes_transferred: int = 0
    oversized_loads: int = 0


@dataclass(slots=True)
class WeightCache:
    budget: int | None  # bytes for evictable weights; None = cache off (all resident)
    lru: OrderedDict[str, Resident] = field(default_factory=OrderedDict)  # oldest first
    pinned: dict[str, Resident] = field(default_factory=dict)  # residency "device"
    counters: CacheCounters = field(default_factory=CacheCounters)

    @property
    def enabled(self) -> bool:
        return self.budget is not None

    @property
    def resident_bytes(self) -> int:
        """Bytes of evictable weights on the device (what the budget bounds)."""
        return sum(r.nbytes for r in self.lru.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(r.nbytes for r in self.pinned.values())

    def get(self, name: str) -> Resident | None:
        """The resident weights of ``name`` (marked most recently used), or None."""
        if name in self.pinned:
            return self.pinned[name]
        resident = self.lru.get(name)
        if resident is not None:
            self.lru.move_to_end(name)
        return resident

    def is_resident(self, name: str) -> bool:
        return name in self.pinned or name in self.lru

    def fits(self, nbytes: int, protected: frozenset[str] = frozenset()) -> bool:
        """Whether :meth:`make_room` can bring ``nbytes`` more within the budget."""
        if self.budget is None:
            return True
        held = sum(r.nbytes for n, r in self.lru.items() if r.leases or n in protected)
        return held + nbytes <= self.budget

    def make_room(self, nbytes: int, protected: frozenset[str] = frozenset()) -> list[str]:
        """Evict least recently used, unleased models until ``nbytes`` more fit.

        Models in ``protected`` (about to be used) are skipped like leased ones.

        Returns the evicted names. A model larger than the whole budget gets the room
        that can be made (everything evictable); :meth:`admit` says so.
        """
        evicted = []
        if self.budget is None:
            return evicted
        resident = self.resident_bytes
        for name in list(self.lru):
            if resident + nbytes <= self.budget:
                break
            if self.lru[name].leases == 0 and name not in protected:
                resident -= self.lru[name].nbytes
                self.evict(name)
                evicted.append(name)
        return evicted

    def _warn_if_over(self, nbytes: int) -> None:
        """What :meth:`admit` of ``nbytes`` past the budget says (and counts)."""
        assert self.budget is not None
        if nbytes > self.budget:
            self.counters.oversized_loads += 1
            log.warning(
                "model weights (%d bytes) exceed the whole weight cache budget (%d "
                "bytes); loading anyway after evicting every evictable model",
                nbytes,
                self.budget,
            )
        elif self.resident_bytes + nbytes > self.budget:
            log.warning(
                "loading %d bytes of weights exceeds the weight cache budget (%d "
                "bytes): %d bytes are held by models in use",
                nbytes,
                self.budget,
                self.resident_bytes,
            )

    def trim(self, protected: frozenset[str] = frozenset()) -> list[str]:
        """Evict least recently used, unleased, unprotected models until the resident
        bytes are within the budget again (the budget shrank); returns their names."""
        evicted = []
        if self.budget is None:
            return evicted
        resident = self.resident_bytes
        for name in list(self.lru):
            if resident <= self.budget:
                break
            if self.lru[name].leases == 0 and name not in protected:
                resident -= self.lru[name].nbytes
                self.evict(name)
                evicted.append(name)
        return evicted

    def admit(
        self,
        name: str,
        arrays: list[jax.Array],
        nbytes: int,
        seconds: float,
        *,
        pinned: bool = False,
    ) -> Resident:
        """Record freshly transferred weights (call :meth:`make_room` first). Past the
        budget (an oversized model, or models in use holding the room) it is admitted
        all the same, with a warning; an oversized one is counted."""
        resident = Resident(arrays, nbytes)
        if pinned or self.budget is None:
            self.pinned[name] = resident
        else:
            self._warn_if_over(nbytes)
            self.lru[name] = resident
        c = self.counters
        c.loads += 1
        c.load_seconds += seconds
        c.bytes_transferred += nbytes
        return resident

    def evict(self, name: str) -> bool:
        """Free ``name``'s evictable device weights now; False if not resident/evictable."""
        resident = self.lru.pop(name, None)
        if resident is None:
            return False
        free(resident.arrays)
        self.counters.evictions += 1
        return True

    def pin(self, name: str) -> bool:
        """Move a resident model out of the LRU: it is never evicted until unpinned."""
        resident = self.lru.pop(name, None)
        if resident is not None:
            self.pinned[name] = resident
        return resident is not None

    def unpin(self, name: str) -> Resident | None:
        """Move a pinned model into the LRU (it becomes evictable); returns it."""
        resident = self.pinned.pop(name, None)
        if resident is not None:
            self.lru[name] = resident
        return resident

    def drop(self, name: str) -> None:
        """Forget ``name`` entirely (unload): free its device weights, pinned or not."""
        resident = self.pinned.pop(name, None) or self.lru.pop(name, None)
        if resident is not None:
            free(resident.arrays)

    def clear(self) -> int:
        """Compaction: free every evictable model at once; returns how many were freed."""
        names = [n for n, r in self.lru.items() if r.leases == 0]
        for name in names:
            self.evict(name)
        return len(names)
