"""The scheduler's record of one registered model name."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rsrv.scheduler._costs import DecayedSum
from rsrv.scheduler._queue import RequestQueue, Version
from rsrv.scheduler._stats import StatsRecorder


@dataclass(slots=True)
class VersionCounters:
    """Executions of one version label (kept while the label is served, across
    replacements of it)."""

    dispatches: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)


@dataclass(eq=False, slots=True)
class ScheduledModel:
    """One model name: its current versions, its queue (shared by all its versions),
    fair-share bookkeeping and statistics. Hashable by identity.

    ``versions`` holds the current version of each label served side by side, in the
    order they were (re)registered; ``version`` is the last of them, the one a request
    that names no label runs on."""

    name: str
    index: int  # registration order, the last tie-breaker between models
    version: Version
    weight: float
    usage: DecayedSum
    versions: dict[str, Version] = field(default_factory=dict)
    counters: dict[str, VersionCounters] = field(default_factory=dict)
    queue: RequestQueue = field(default_factory=RequestQueue)
    stats: StatsRecorder = field(default_factory=StatsRecorder)
    tag: float = 0.0  # fair: virtual start time (device seconds per unit weight)
    idle_since: float = 0.0  # fair: when it last stopped being backlogged

    def next_size(self) -> tuple[Version, int] | None:
        """Version and compiled size of the batch this model would run now.

        Estimated from the queued rows, ``size_for(min(queued rows, max_rows))``,
        without walking the queue; planning may pick a smaller size when whole
        requests do not fill it.
        """
        head = self.queue.peek()
        if head is None:
            return None
        spec = head.version.spec
        return head.version, spec.size_for(min(self.queue.rows, spec.max_rows))

    def next_cost(self) -> float:
        """Learned cost of :meth:`next_size`; 0 when nothing is queued or known."""
        nxt = self.next_size()
        return 0.0 if nxt is None else nxt[0].costs.estimate(nxt[1])
