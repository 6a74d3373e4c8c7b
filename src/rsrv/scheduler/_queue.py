"""Requests and the per-model queue that holds them until dispatch."""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import trio

from rsrv.errors import RsrvError

if TYPE_CHECKING:
    from rsrv.scheduler._costs import CostTable
    from rsrv.scheduler._executor import Result
    from rsrv.scheduler._model import ScheduledModel
    from rsrv.scheduler._spec import ModelSpec


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"  # taken into a batch that is executing
    DONE = "done"  # answered: result or error set


@dataclass(eq=False, slots=True)
class Version:
    """One registered version of a model: its spec and learned costs.

    Requests point at the version they were admitted for, so a replacement never
    changes how an already queued request is batched or which executable runs it.
    """

    spec: ModelSpec
    costs: CostTable
    delay: float = 0.0  # queue delay: spec.max_queue_delay, else the scheduler's default
    outstanding: int = 0  # requests queued or running
    retired: bool = False  # replaced or removed: no new requests


@dataclass(eq=False, slots=True)
class Request:
    model: ScheduledModel  # the model it was queued on
    version: Version
    inputs: list[np.ndarray]
    rows: int
    signature: tuple  # per input (dtype, shape without the batch axis): what may be concatenated
    enqueued: float
    deadline: float | None  # completion deadline, scheduler clock
    expiry: float  # must be dispatched before this: min(deadline, enqueued + dispatch timeout)
    order: tuple  # service order within the queue; smaller first
    state: State = State.QUEUED
    abandoned: bool = False  # its caller was cancelled while it executed
    done: trio.Event = field(default_factory=trio.Event)
    result: Result | None = None
    error: RsrvError | None = None

    def answer(self, result: Result | None = None, error: RsrvError | None = None) -> bool:
        """Set the outcome once; False if it was already answered."""
        if self.done.is_set():
            return False
        self.state, self.result, self.error = State.DONE, result, error
        self.done.set()
        return True

    def outcome(self) -> Result:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class RequestQueue:
    """One model's queued requests, in service order, plus arrival order.

    Service order is ``Request.order`` (a heap); arrival order (a deque) gives the
    oldest queued request. A request that leaves is only marked and skipped later, so
    every operation is O(log n) amortised; the marked ones are dropped as soon as they
    reach the front, and both records are rebuilt whenever marked entries outnumber the
    queued ones, so the queue never holds more than about twice what is queued (plus a
    small constant), however long it runs. ``live`` and ``rows`` count requests still
    QUEUED.
    """

    __slots__ = ("_heap", "_arrivals", "live", "rows")

    #: Marked entries tolerated before a rebuild, beyond the number of queued ones.
    SLACK = 64

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, Request]] = []
        self._arrivals: deque[Request] = deque()
        self.live = 0
        self.rows = 0

    def push(self, req: Request) -> None:
        """Queue a new request."""
        heapq.heappush(self._heap, (req.order, req))
        self._arrivals.append(req)
        self.live += 1
        self.rows += req.rows

    def restore(self, req: Request) -> None:
        """Put back a request that ``pop`` handed out but was not taken after all."""
        heapq.heappush(self._heap, (req.order, req))

    def peek(self) -> Request | None:
        """The next request in service order."""
        heap = self._heap
        while heap and heap[0][1].state is not State.QUEUED:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def pop(self) -> Request | None:
        """Remove the next request from service order; it stays QUEUED (and counted)
        until ``leave`` or ``restore``."""
        req = self.peek()
        if req is not None:
            heapq.heappop(self._heap)
        return req

    def leave(self, req: Request, state: State) -> None:
        """``req`` stops being queued (taken into a batch, withdrawn, failed)."""
        assert req.state is State.QUEUED
        req.state = state
        self.live -= 1
        self.rows -= req.rows
        arrivals = self._arrivals
        while arrivals and arrivals[0].state is not State.QUEUED:
            arrivals.popleft()
        limit = 2 * self.live + self.SLACK
        if len(arrivals) > limit or len(self._heap) > limit:
            self._rebuild()

    def _rebuild(self) -> None:
        """Drop every entry of a request that is no longer queued."""
        self._arrivals = deque(r for r in self._arrivals if r.state is State.QUEUED)
        self._heap = [e for e in self._heap if e[1].state is State.QUEUED]
        heapq.heapify(self._heap)

    def oldest(self) -> Request | None:
        """The queued request that arrived first."""
        arrivals = self._arrivals
        while arrivals and arrivals[0].state is not State.QUEUED:
            arrivals.popleft()
        return arrivals[0] if arrivals else None

    def any_queued(self, predicate: Callable[[Request], bool]) -> bool:
        """Whether ``predicate`` holds for some queued request (stops at the first)."""
        return any(r.state is State.QUEUED and predicate(r) for r in self._arrivals)

    def queued(self) -> list[Request]:
        """Every queued request, in arrival order."""
        return [r for r in self._arrivals if r.state is State.QUEUED]
