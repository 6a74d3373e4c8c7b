"""lpt_packing's per-round driver: the repack clock, arrival rates, placement, compaction.

Once per discovery round the gateway calls :meth:`RepackPlanner.tick` with the round's
compute (``RoundDelta.compute_seconds``), the cost snapshot, the ready workers and the
router's arrival counts. When a repack is due it returns a :class:`RepackOutcome`: the new
placement (hand ``result.assignment()`` to the router) and, when due, the CompactMemory
order. Pure: no clock reads, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rsrv.gateway._costs import RoutingMeta, resolve_halflife
from rsrv.gateway._placement import (
    ModelDemand,
    PlacementPolicy,
    PlacementResult,
    WorkerBudget,
    compute_placement,
)
from rsrv.gateway._repack import (
    ArrivalRates,
    CompactionCounter,
    CompactionMode,
    CompactionOrder,
    RepackClock,
    RepackTrigger,
    RepackWindow,
)


@dataclass(frozen=True)
class PackingSettings:
    """The lpt_packing knobs (runtime-mutable through :meth:`RepackPlanner.configure`).

    ``ema_halflife_compute_seconds`` 0 resolves to ``rebalance_compute_seconds``.
    Raises ValueError for a threshold that is not > 0, a negative half-life, an unknown
    compaction mode or an interval < 1.
    """

    first_rebalance_compute_seconds: float = 60.0
    rebalance_compute_seconds: float = 300.0
    ema_halflife_compute_seconds: float = 0.0
    compaction_mode: CompactionMode = CompactionMode.EAGER
    compaction_interval: int = 1
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)

    def __post_init__(self) -> None:
        RepackClock(self.first_rebalance_compute_seconds, self.rebalance_compute_seconds)
        halflife = self.ema_halflife_compute_seconds
        if not (math.isfinite(halflife) and halflife >= 0):
            raise ValueError(
                f"ema_halflife_compute_seconds must be finite and >= 0, not {halflife}"
            )
        CompactionCounter(self.compaction_mode, self.compaction_interval)
        object.__setattr__(self, "compaction_mode", CompactionMode(self.compaction_mode))

    @property
    def halflife_compute_seconds(self) -> float:
        """The resolved half-life (never 0); also the one to give the CostTracker."""
        return resolve_halflife(self.ema_halflife_compute_seconds, self.rebalance_compute_seconds)


@dataclass(frozen=True)
class RepackOutcome:
    window: RepackWindow
    result: PlacementResult
    compaction: CompactionOrder | None

    def summary(self) -> str:
        """One log line."""
        r, w = self.result, self.window
        return (
            f"lpt_packing: repack trigger={w.trigger} models={len(r.placements)} "
            f"moved={r.moved} held_by_hysteresis={r.held_by_hysteresis} "
            f"max_improvement={r.max_improvement:.3g} compute_seconds={w.compute_seconds:.3f} "
            f"wall_seconds={w.wall_elapsed_seconds:.3f}"
        )


def model_demands(
    meta: RoutingMeta,
    rates: ArrivalRates,
    holders: Mapping[str, Iterable[str]] | None = None,
) -> list[ModelDemand]:
    """One demand per model: ``u = arrival rate x cost per request`` (the fleet-mean or 1.0
    fallback when unmeasured; 0 without arrivals), its weight bytes (a meta's: its
    sub-models', which the worker it is placed on loads) and holders.

    ``holders``: model -> workers serving it (discovered routes); None takes the workers
    that reported each model in the last ModelControlStatus round.
    """
    if holders is None:
        holders = {name: m.holders for name, m in meta.models.items()}
    out = []
    for name in sorted(holders):
        rate = rates.rate(name)
        known = meta.get(name)
        out.append(
            ModelDemand(
                name=name,
                utilization=rate * meta.request_cost(name) if rate > 0 else 0.0,
                weight_bytes=known.weight_bytes if known else 0,
                holders=frozenset(holders[name]),
            )
        )
    return out


class RepackPlanner:
    """Owns the clock, the arrival rates, the compaction counter and the last placement."""

    def __init__(self, settings: PackingSettings | None = None, *, now: float = 0.0) -> None:
        self._settings = settings or PackingSettings()
        s = self._settings
        self.clock = RepackClock(
            s.first_rebalance_compute_seconds, s.rebalance_compute_seconds, now=now
        )
        self.rates = ArrivalRates(s.halflife_compute_seconds)
        self.compaction = CompactionCounter(s.compaction_mode, s.compaction_interval)
        self.last: PlacementResult | None = None
        self._placed_on: _Topology | None = None  # the fleet the last placement saw
        self._seen: _Topology | None = None  # the fleet of the previous round

    @property
    def settings(self) -> PackingSettings:
        return self._settings

    def configure(self, settings: PackingSettings) -> list[str]:
        """Apply new knobs (validated already by PackingSettings); returns warnings."""
        old, warnings = self._settings, []
        if settings.halflife_compute_seconds != old.halflife_compute_seconds:
            warnings.append(
                "the new EWMA half-life applies to future samples; history is not recomputed"
            )
        if (
            settings.first_rebalance_compute_seconds != old.first_rebalance_compute_seconds
            and self.clock.first_compute_repack_done
        ):
            warnings.append(
                "first_rebalance_compute_seconds has no effect: the first compute-triggered "
                "repack already ran"
            )
        self.clock.first_threshold = settings.first_rebalance_compute_seconds
        self.clock.threshold = settings.rebalance_compute_seconds
        if self.clock.compute_accumulated >= self.clock.active_threshold:
            warnings.append(
                f"{self.clock.compute_accumulated:.1f} compute seconds already accumulated, "
                f"at least the new budget {self.clock.active_threshold:g}: a repack runs at "
                "the next round"
            )
        self.rates.halflife_compute_seconds = settings.halflife_compute_seconds
        if (settings.compaction_mode, settings.compaction_interval) != (
            old.compaction_mode,
            old.compaction_interval,
        ):
            counted = self.compaction.count
            self.compaction = CompactionCounter(
                settings.compaction_mode, settings.compaction_interval
            )
            if settings.compaction_mode is not CompactionMode.OFF:
                self.compaction.count = counted
        self._settings = settings
        return warnings

    def request_repack(self) -> int:
        """An operator repack, served at the next :meth:`tick`; returns its sequence."""
        return self.clock.request()

    def tick(
        self,
        *,
        now: float,
        compute_seconds: float,
        meta: RoutingMeta,
        workers: Sequence[WorkerBudget],
        arrivals: Mapping[str, int],
        holders: Mapping[str, Iterable[str]] | None = None,
    ) -> RepackOutcome | None:
        """One discovery round. Returns the repack it ran, or None.

        ``workers``: the ready workers (with no worker nothing is repacked and a due
        repack waits). ``arrivals``: cumulative requests routed per model. A fleet
        repack runs when the ready workers, or the holders of a model, differ from what
        the last placement saw and have stayed so for a whole round (workers coming up
        one by one, or flapping, do not repack every round).
        Raises ValueError for a negative ``compute_seconds``.
        """
        self.clock.advance(compute_seconds, now)
        topology = _topology(workers, meta, holders)
        changed = topology != self._placed_on and topology == self._seen
        self._seen = topology
        trigger = self.clock.due(fleet_changed=changed)
        if trigger is None or not workers:
            return None
        if trigger is RepackTrigger.STARTUP:
            self.rates.rebase(arrivals)  # no window yet: rates start with the first one
        else:
            self.rates.fold(arrivals, self.clock.wall_elapsed(now), self.clock.compute_accumulated)
        previous = self.last.assignment() if self.last else None
        result = compute_placement(
            model_demands(meta, self.rates, holders), workers, previous, self._settings.placement
        )
        window = self.clock.complete(
            trigger, now, models_placed=len(result.placements), models_moved=result.moved
        )
        self.last, self._placed_on = result, topology
        return RepackOutcome(window, result, self.compaction.on_repack(result))


_Topology = tuple[frozenset[str], frozenset[tuple[str, frozenset[str]]]]


def _topology(
    workers: Sequence[WorkerBudget],
    meta: RoutingMeta,
    holders: Mapping[str, Iterable[str]] | None,
) -> _Topology:
    """What a placement depends on besides demand: the ready workers, and who holds
    each model."""
    if holders is None:
        holders = {name: m.holders for name, m in meta.models.items()}
    return (
        frozenset(w.name for w in workers),
        frozenset((model, frozenset(names)) for model, names in holders.items()),
    )
