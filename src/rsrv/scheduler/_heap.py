"""A min-heap of distinct items whose keys can change.

The scheduler keeps only *backlogged* models in such heaps, so choosing the next
one costs O(log b) for b backlogged models, whatever the number registered.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class KeyedHeap(Generic[T]):
    """Items with updatable keys; the item with the smallest key is on top.

    ``set``, ``discard``, ``take``, ``peek`` and ``pop`` are O(log n) amortised. An update
    pushes a fresh entry and leaves the old one behind as stale (lazy deletion);
    ``peek`` drops stale entries as they surface, and the heap is rebuilt once stale
    entries outnumber live ones, so memory stays O(live items). Ties on the key are
    broken by insertion order; items themselves are never compared.
    """

    __slots__ = ("_heap", "_live", "_stamp")

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, T]] = []
        self._live: dict[T, tuple[Any, int]] = {}
        self._stamp = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: T) -> bool:
        return item in self._live

    def __iter__(self) -> Iterator[T]:
        """The live items, in no particular order."""
        return iter(list(self._live))

    def set(self, item: T, key: Any) -> None:
        """Insert ``item`` or change its key."""
        current = self._live.get(item)
        if current is not None and current[0] == key:
            return
        stamp = next(self._stamp)
        self._live[item] = (key, stamp)
        heapq.heappush(self._heap, (key, stamp, item))
        self._compact()

    def discard(self, item: T) -> None:
        """Remove ``item`` if present."""
        if self._live.pop(item, None) is not None:
            self._compact()

    def take(self, item: T) -> Any:
        """Remove ``item`` and return its key (None if absent); ``set(item, key)`` puts
        it back."""
        live = self._live.pop(item, None)
        if live is None:
            return None
        self._compact()
        return live[0]

    def peek(self) -> tuple[Any, T] | None:
        """``(key, item)`` with the smallest key, or None when empty."""
        heap = self._heap
        while heap:
            key, stamp, item = heap[0]
            live = self._live.get(item)
            if live is not None and live[1] == stamp:
                return key, item
            heapq.heappop(heap)
        return None

    def pop(self) -> tuple[Any, T] | None:
        """Remove and return ``(key, item)`` with the smallest key, or None."""
        top = self.peek()
        if top is not None:
            heapq.heappop(self._heap)
            del self._live[top[1]]
        return top

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [(key, stamp, item) for item, (key, stamp) in self._live.items()]
            heapq.heapify(self._heap)
