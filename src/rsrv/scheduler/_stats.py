"""Per-model counters, and the snapshots that ``Scheduler.stats`` and
``Scheduler.counters`` return."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

#: Queue waits kept per model for percentiles.
WAIT_SAMPLES = 1024


@dataclass(frozen=True, slots=True)
class SchedulingCounters:
    """One model's counters, cheap to take (no percentiles, no copies): what a status of
    every model reads (ModelControlStatus). Counts are cumulative since the model was
    added: ``requests`` / ``rows`` were answered with outputs (to a caller still
    waiting: one cancelled while its batch ran is not counted), ``dispatches`` executions
    were started, ``compute_seconds`` is their summed execute() wall time;
    ``queue_depth`` requests wait now; ``max_batch_size`` is the current version's
    effective max batch size."""

    weight: float
    requests: int
    rows: int
    dispatches: int
    compute_seconds: float
    queue_depth: int
    max_batch_size: int


@dataclass(frozen=True, slots=True)
class SchedulingStats(SchedulingCounters):
    """A snapshot of one model's scheduling statistics (all versions together): its
    counters, and ``batch_sizes`` (executions per compiled size), ``failures``
    (requests answered with an error, by status code; ``CANCELLED`` for withdrawn
    ones, and ones whose caller was cancelled while their batch ran), ``wait_samples``
    (the queue waits of the last dispatched requests, oldest first) summarised in
    ``wait_percentiles`` (keys ``p50``, ``p90``, ``p99``, ``max``; empty before any
    dispatch), ``usage_ema`` (the decayed sum of compute seconds, half-life
    ``ema_halflife_seconds``, now) and ``costs`` (the learned seconds per compiled size
    of the current version)."""

    name: str
    queued_rows: int
    batch_sizes: dict[int, int]
    failures: dict[str, int]
    wait_samples: tuple[float, ...]
    wait_percentiles: dict[str, float]
    usage_ema: float
    costs: dict[int, float]


@dataclass(frozen=True)
class VersionStats:
    """One version label of a model: its executions (``dispatches``, per compiled size
    in ``batch_sizes``) since the label was added, and its current version's learned
    ``costs`` and effective ``max_batch_size``."""

    version: str
    dispatches: int
    batch_sizes: dict[int, int]
    costs: dict[int, float]
    max_batch_size: int


class StatsRecorder:
    """Mutable counters behind :class:`SchedulingStats`."""

    __slots__ = (
        "requests",
        "rows",
        "dispatches",
        "compute_seconds",
        "batch_sizes",
        "failures",
        "waits",
        "_percentiles",
    )

    def __init__(self) -> None:
        self.requests = 0
        self.rows = 0
        self.dispatches = 0
        self.compute_seconds = 0.0
        self.batch_sizes: Counter[int] = Counter()
        self.failures: Counter[str] = Counter()
        self.waits: deque[float] = deque(maxlen=WAIT_SAMPLES)
        self._percentiles: dict[str, float] | None = {}  # None: to compute again

    def dispatched(self, size: int, waits: list[float]) -> None:
        self.dispatches += 1
        self.batch_sizes[size] += 1
        self.waits.extend(waits)
        self._percentiles = None

    def failed(self, code: str) -> None:
        self.failures[code] += 1

    def percentiles(self) -> dict[str, float]:
        """The waits' percentiles (a new dict), computed once per change of the waits
        (a scrape of many idle models reads them again and again)."""
        if self._percentiles is None and not self.waits:
            self._percentiles = {}
        elif self._percentiles is None:
            p50, p90, p99 = np.percentile(np.fromiter(self.waits, float), [50, 90, 99])
            self._percentiles = {
                "p50": float(p50),
                "p90": float(p90),
                "p99": float(p99),
                "max": float(max(self.waits)),
            }
        return dict(self._percentiles)
