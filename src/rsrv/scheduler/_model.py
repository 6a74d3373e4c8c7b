"""The scheduler's record of one registered model name: its versions, queue and
counters, what it reports about them, and whether its batch waits for more requests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from rsrv.errors import NotFound
from rsrv.scheduler._costs import DecayedSum
from rsrv.scheduler._queue import RequestQueue, Version
from rsrv.scheduler._stats import SchedulingCounters, SchedulingStats, StatsRecorder, VersionStats


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
    running: bool = False  # fair: one of its batches is executing (it is not idle)

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

    def version_of(self, label: str | None) -> Version:
        """The current version of ``label`` (None: the default); NotFound if not served."""
        if label is None:
            return self.version
        version = self.versions.get(label)
        if version is None:
            raise NotFound(
                f"Request for unknown model: '{self.name}' version {label} is not found "
                f"(served versions: {', '.join(self.versions) or 'none'})"
            )
        return version

    def held_until(self, now: float) -> float | None:
        """When the batch is due, if it should wait for more requests now; None:
        dispatch it now. It waits while its head request's version has a queue delay
        ``D``, the queued rows are fewer than that version's ``max_rows``, and ``now``
        is before ``until = oldest arrival + D``, unless waiting until then would let a
        queued request expire (``until >= expiry``) or finish after its deadline or
        latency budget (``until + ĉ > deadline``, ``until + ĉ > enqueued + budget``,
        ``ĉ`` the learned cost of the batch it would run now)."""
        queue = self.queue
        head = queue.peek()
        if head is None:
            return None
        version = head.version
        delay = version.delay
        spec = version.spec
        if delay <= 0 or not spec.batched or queue.rows >= spec.max_rows:
            return None
        oldest = queue.oldest()
        assert oldest is not None
        until = oldest.enqueued + delay
        if now >= until:
            return None
        end = until + version.costs.estimate(spec.size_for(queue.rows))
        for r in queue.queued():  # fewer than max_rows requests, unless some have 0 rows
            if until >= r.expiry or (r.deadline is not None and end > r.deadline):
                return None
            budget = r.version.spec.latency_budget
            if budget is not None and end > r.enqueued + budget:
                return None
        return until

    # -- what it reports ----------------------------------------------------------------

    def counters_now(self) -> SchedulingCounters:
        """Its counters now (``Scheduler.counters``)."""
        s = self.stats
        return SchedulingCounters(
            weight=self.weight,
            requests=s.requests,
            rows=s.rows,
            dispatches=s.dispatches,
            compute_seconds=s.compute_seconds,
            queue_depth=self.queue.live,
            max_batch_size=self.version.spec.max_rows,
        )

    def stats_at(self, now: float) -> SchedulingStats:
        """Its statistics, the usage decayed to ``now`` (``Scheduler.stats``)."""
        counters = self.counters_now()
        s = self.stats
        return SchedulingStats(
            **{f: getattr(counters, f) for f in SchedulingCounters.__slots__},
            name=self.name,
            queued_rows=self.queue.rows,
            batch_sizes=dict(sorted(s.batch_sizes.items())),
            failures=dict(s.failures),
            wait_samples=tuple(s.waits),
            wait_percentiles=s.percentiles(),
            usage_ema=self.usage.at(now),
            costs=self.version.costs.snapshot(),
        )

    def version_stats(self, label: str) -> VersionStats:
        """Executions of version ``label`` (``Scheduler.version_stats``); NotFound if
        it is not served."""
        current = self.version_of(label)
        counters = self.counters[label]
        return VersionStats(
            version=label,
            dispatches=counters.dispatches,
            batch_sizes=dict(sorted(counters.batch_sizes.items())),
            costs=current.costs.snapshot(),
            max_batch_size=current.spec.max_rows,
        )
