"""When lpt_packing repacks, the demand it packs, and when the fleet compacts afterwards.

Time here is *fleet compute*: device-seconds summed over workers, from the workers' counters
(:class:`~rsrv.gateway._costs.RoundDelta`). A repack is due once ``first_threshold`` compute
seconds accumulated (until the first compute-triggered repack), then every ``threshold``;
the startup placement and operator repacks reset the accumulator without consuming the first
budget. Each repack folds per-model arrival rates (``count / wall seconds``) into EWMAs whose
``dt`` is the compute elapsed. Wall time is whatever clock the caller passes as ``now``
(used for elapsed times and reported as is). Pure: no clock reads, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from rsrv.gateway._costs import ewma
from rsrv.gateway._placement import PlacementResult


class RepackTrigger(StrEnum):
    STARTUP = "startup"
    COMPUTE = "compute"
    OPERATOR = "operator"
    FLEET = "fleet"  # the ready workers, or which of them serve a model, changed


def _positive(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be > 0, not {value}")
    return float(value)


@dataclass(frozen=True)
class RepackWindow:
    """The span a repack closes: since the previous repack (or the clock's creation)."""

    trigger: RepackTrigger
    sequence: int  # 1 for the first repack
    wall_elapsed_seconds: float
    compute_seconds: float


@dataclass(frozen=True)
class RepackStatus:
    """The clock's part of the gateway's scheduling status. ``*_at`` are the caller's
    ``now`` values (None before the first)."""

    last_repack_at: float | None
    last_repack_wall_elapsed_seconds: float
    last_repack_compute_seconds: float
    last_trigger: RepackTrigger | None
    last_models_placed: int
    last_models_moved: int
    repack_count: int
    compute_accumulated_seconds: float
    active_threshold_seconds: float
    first_compute_repack_done: bool
    last_tick_at: float | None
    operator_repacks_requested: int
    operator_repacks_completed: int


class RepackClock:
    """Accumulates fleet compute and says when a repack is due.

    Operator requests coalesce: requests made before a repack runs share one sequence
    number, completed by the next repack (whatever its trigger).
    """

    def __init__(
        self, first_threshold: float = 60.0, threshold: float = 300.0, *, now: float = 0.0
    ) -> None:
        self.first_threshold = first_threshold
        self.threshold = threshold
        self._accum = 0.0
        self._since = now
        self._first_done = False
        self._count = 0
        self._requested = 0
        self._completed = 0
        self._last_tick: float | None = None
        self._last: RepackWindow | None = None
        self._last_at: float | None = None
        self._placed = 0
        self._moved = 0

    @property
    def first_threshold(self) -> float:
        return self._first

    @first_threshold.setter
    def first_threshold(self, value: float) -> None:
        self._first = _positive("first_threshold", value)

    @property
    def threshold(self) -> float:
        return self._steady

    @threshold.setter
    def threshold(self, value: float) -> None:
        self._steady = _positive("threshold", value)

    @property
    def active_threshold(self) -> float:
        return self._steady if self._first_done else self._first

    @property
    def compute_accumulated(self) -> float:
        return self._accum

    @property
    def first_compute_repack_done(self) -> bool:
        return self._first_done

    @property
    def repack_count(self) -> int:
        return self._count

    def wall_elapsed(self, now: float) -> float:
        """Wall seconds since the window opened (the last repack, or the clock's creation)."""
        return max(0.0, now - self._since)

    def advance(self, compute_seconds: float, now: float) -> None:
        """One discovery round consumed ``compute_seconds`` (>= 0) of fleet compute.
        Raises ValueError for a negative or non-finite amount."""
        if not (math.isfinite(compute_seconds) and compute_seconds >= 0):
            raise ValueError(f"compute_seconds must be finite and >= 0, not {compute_seconds}")
        self._accum += compute_seconds
        self._last_tick = now

    def request(self) -> int:
        """An operator asks for a repack; returns the sequence number that will serve it."""
        if self._requested == self._completed:
            self._requested += 1
        return self._requested

    @property
    def operator_requested(self) -> int:
        return self._requested

    @property
    def operator_completed(self) -> int:
        return self._completed

    def due(self, fleet_changed: bool = False) -> RepackTrigger | None:
        """startup (never repacked) > operator (a request pending) > compute (threshold)
        > fleet (``fleet_changed``: the workers the last placement used changed)."""
        if self._count == 0:
            return RepackTrigger.STARTUP
        if self._requested > self._completed:
            return RepackTrigger.OPERATOR
        if self._accum >= self.active_threshold:
            return RepackTrigger.COMPUTE
        if fleet_changed:
            return RepackTrigger.FLEET
        return None

    def complete(
        self,
        trigger: RepackTrigger | str,
        now: float,
        *,
        models_placed: int = 0,
        models_moved: int = 0,
    ) -> RepackWindow:
        """A repack ran at ``now``: closes the window, resets the accumulator, serves
        pending operator requests; a compute trigger consumes the first budget."""
        trigger = RepackTrigger(trigger)
        self._count += 1
        window = RepackWindow(trigger, self._count, self.wall_elapsed(now), self._accum)
        self._accum = 0.0
        self._since = now
        if trigger is RepackTrigger.COMPUTE:
            self._first_done = True
        self._completed = self._requested
        self._last, self._last_at = window, now
        self._placed, self._moved = models_placed, models_moved
        return window

    def status(self) -> RepackStatus:
        last = self._last
        return RepackStatus(
            last_repack_at=self._last_at,
            last_repack_wall_elapsed_seconds=last.wall_elapsed_seconds if last else 0.0,
            last_repack_compute_seconds=last.compute_seconds if last else 0.0,
            last_trigger=last.trigger if last else None,
            last_models_placed=self._placed,
            last_models_moved=self._moved,
            repack_count=self._count,
            compute_accumulated_seconds=self._accum,
            active_threshold_seconds=self.active_threshold,
            first_compute_repack_done=self._first_done,
            last_tick_at=self._last_tick,
            operator_repacks_requested=self._requested,
            operator_repacks_completed=self._completed,
        )


class ArrivalRates:
    """Per-model arrival rates (requests per wall second), EWMAs over compute time.

    :meth:`fold` takes cumulative per-model request counts (e.g.
    ``InflightLedger.arrivals()``) and differences them against the previous fold. A model
    adopts its first non-zero sample; a known model with no arrivals folds in 0. A count
    that went backwards re-baselines that model and skips it.
    """

    def __init__(self, halflife_compute_seconds: float = 300.0) -> None:
        self.halflife_compute_seconds = halflife_compute_seconds
        self._base: dict[str, int] = {}
        self._rate: dict[str, float] = {}

    @property
    def halflife_compute_seconds(self) -> float:
        return self._halflife

    @halflife_compute_seconds.setter
    def halflife_compute_seconds(self, value: float) -> None:
        self._halflife = _positive("halflife_compute_seconds", value)

    def rebase(self, totals: Mapping[str, int]) -> None:
        """Take ``totals`` as the baseline without a sample."""
        self._base = dict(totals)

    def fold(self, totals: Mapping[str, int], wall_elapsed: float, compute_elapsed: float) -> None:
        """One repack window. ``wall_elapsed`` <= 0 only re-baselines."""
        if wall_elapsed <= 0:
            self.rebase(totals)
            return
        for model in sorted(set(totals) | set(self._rate)):
            count = totals.get(model, 0) - self._base.get(model, 0)
            if count < 0:
                continue
            old = self._rate.get(model)
            if old is None and count == 0:
                continue
            self._rate[model] = ewma(old, count / wall_elapsed, compute_elapsed, self._halflife)
        self.rebase(totals)

    def forget(self, model: str) -> None:
        """Drop ``model`` (it left every worker; its arrival count is dropped too)."""
        self._base.pop(model, None)
        self._rate.pop(model, None)

    def rate(self, model: str) -> float:
        return self._rate.get(model, 0.0)

    def rates(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._rate))


class CompactionMode(StrEnum):
    EAGER = "eager"
    SCHEDULED = "scheduled"
    OFF = "off"


@dataclass(frozen=True)
class CompactionOrder:
    """CompactMemory to send: worker -> ``reload_models`` (empty under eager)."""

    reload: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(sorted(self.reload))


class CompactionCounter:
    """Counts repacks; fires when at least ``interval`` repacks were counted and this one
    moved a model, then starts over. ``off`` never counts nor fires."""

    def __init__(self, mode: CompactionMode | str = CompactionMode.EAGER, interval: int = 1):
        self.mode = CompactionMode(mode)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"compaction interval must be an int >= 1, not {interval!r}")
        self.interval = interval
        self.count = 0

    def advance(self, moved: bool) -> bool:
        """One repack; True when compaction is due now."""
        if self.mode is CompactionMode.OFF:
            return False
        self.count += 1
        if self.count >= self.interval and moved:
            self.count = 0
            return True
        return False

    def on_repack(self, result: PlacementResult) -> CompactionOrder | None:
        """:meth:`advance` with ``result.moved``; when due, the order for the workers whose
        model set changed (scheduled: each reloads the models now placed on it)."""
        if not self.advance(result.moved > 0):
            return None
        scheduled = self.mode is CompactionMode.SCHEDULED
        return CompactionOrder(
            MappingProxyType(
                {w: result.models_on(w) if scheduled else () for w in result.changed_workers}
            )
        )
