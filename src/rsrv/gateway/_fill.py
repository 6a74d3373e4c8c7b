"""lpt_packing routing within a model's replica set: fill one replica a quantum at a time.

A worker coalesces queued requests of a model into one batch, so the gateway sends a model's
requests to one replica in *runs* of about one batch before moving on: quantum
``Q = max(1, round(fill_factor x max_batch))`` items (1 when max_batch is unknown). Items are
rows along the model's batch axis (1 per request when unknown). Per model, the fill mode is:

* ``run`` (default): keep the current target until the run holds ``Q`` items, the target is
  *behind* (``out_target // Q > min_i out_i // Q``), or the model has nothing in flight; then
  open a new run on ``argmin(out_i // Q, [load_i], rotation)``;
* ``spread``: ``argmin(out_i, [load_i], rotation)``, per request;
* ``inflight`` (legacy): ``argmin((out_i // Q, -out_i), [load_i], rotation)``. It can park a
  model on one replica forever (fewer than Q items in flight always pick the fuller one).

``out_i`` is the model's items in flight on replica ``i``; ``load_i`` the worker's in-flight
work over all models (policy ``fill_least``; ``fill_rr`` leaves it out), compared in
nanosecond steps; rotation is the distance after the model's cursor, so exact ties rotate.
A request routed into a run carries its place in it (:class:`RunPlace`: which run, how
full), by which ``_hold`` holds the run until it is full. Pure: no clock, no I/O.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

from rsrv.config import MAX_FILL_FACTOR
from rsrv.gateway._costs import RoutingMeta
from rsrv.gateway._routing import (
    InflightLedger,
    RoundRobinRouter,
    Ticket,
    WorkBasis,
    check_units,
    normalize_replicas,
    quantize,
)


class FillMode(StrEnum):
    RUN = "run"
    SPREAD = "spread"
    INFLIGHT = "inflight"


class FillPolicy(StrEnum):
    FILL_LEAST = "fill_least"
    FILL_RR = "fill_rr"


INFLIGHT_WARNING = (
    "fill mode 'inflight' can park a model on one replica for good: while fewer than a "
    "quantum of its items are in flight, every request goes to the replica already holding "
    "the most; use 'run' to fill replicas in turn"
)


def fill_mode_warning(mode: FillMode | str) -> str | None:
    """The warning to log (once) and return to an operator selecting ``mode``, if any."""
    return INFLIGHT_WARNING if FillMode(mode) is FillMode.INFLIGHT else None


def _check_factor(factor: float) -> float:
    if not 0 < factor <= MAX_FILL_FACTOR:
        raise ValueError(f"fill_factor must be > 0 and <= {MAX_FILL_FACTOR:g}, not {factor}")
    return float(factor)


def fill_quantum(fill_factor: float, max_batch: int) -> int:
    """``max(1, round(fill_factor x max_batch))`` (ties to even), 1 when max_batch <= 0."""
    _check_factor(fill_factor)
    return 1 if max_batch <= 0 else max(1, round(fill_factor * max_batch))


@dataclass(frozen=True)
class FillPlan:
    """How one model fills its replicas: the mode and the quantum in items."""

    mode: FillMode = FillMode.RUN
    quantum: int = 1


@dataclass(frozen=True)
class ModelFill:
    """A per-model override; None inherits the gateway-wide setting."""

    mode: FillMode | None = None
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.mode is not None:
            object.__setattr__(self, "mode", FillMode(self.mode))
        if self.factor is not None:
            _check_factor(self.factor)


@dataclass(frozen=True)
class FillSettings:
    """Gateway-wide fill mode and factor, with per-model overrides.

    Raises ValueError for an unknown mode or a factor that is not > 0.
    """

    mode: FillMode = FillMode.RUN
    factor: float = 1.0
    models: Mapping[str, ModelFill] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", FillMode(self.mode))
        _check_factor(self.factor)
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def mode_for(self, model: str) -> FillMode:
        own = self.models.get(model)
        return own.mode if own and own.mode is not None else self.mode

    def factor_for(self, model: str) -> float:
        own = self.models.get(model)
        return own.factor if own and own.factor is not None else self.factor

    def plan(self, model: str, max_batch: int) -> FillPlan:
        return FillPlan(self.mode_for(model), fill_quantum(self.factor_for(model), max_batch))


def fill_charge(basis: WorkBasis, meta: RoutingMeta, model: str, units: int) -> float:
    """A request's load charge under lpt_packing: compute ``units x item_cost``, items
    ``units``, requests the model's cost per request (not multiplied by units)."""
    if basis is WorkBasis.COMPUTE:
        return units * meta.item_cost(model)
    if basis is WorkBasis.ITEMS:
        return float(units)
    return meta.request_cost(model)


def _distance(names: tuple[str, ...], cursor: str | None) -> list[int]:
    """Rotation distance of each name after ``cursor`` (the next name is 0)."""
    n = len(names)
    if cursor is None:
        return list(range(n))
    p = bisect_right(names, cursor) - 1
    return [(i - p - 1) % n for i in range(n)]


@dataclass
class _Run:
    cursor: str | None = None
    target: str | None = None
    units: int = 0
    number: int = 0  # runs opened so far


@dataclass(frozen=True, slots=True)
class RunPlace:
    """Where a request stands in its model's run (mode run): the run's ``number``, the
    ``units`` the run holds with this request, its ``quantum``, and whether this
    request ``opened`` it."""

    number: int
    units: int
    quantum: int
    opened: bool


class FillRouter:
    """lpt_packing routing. :meth:`set_placement` after each repack, :meth:`set_meta` after
    each discovery round; then :meth:`route` per request.

    A model without a placement, or none of whose placed workers is among the discovered
    replicas, is routed round robin over the discovered replicas. The failover order is the
    choice, the other placed replicas by ``(out // Q, out, name)``, then discovered
    replicas outside the placement by name. Every ticket is charged by ``work_basis``
    (:func:`fill_charge`). Run state and outstanding counts survive a new placement.
    """

    needs_control = True
    needs_units = True

    def __init__(
        self,
        settings: FillSettings | None = None,
        policy: FillPolicy | str = FillPolicy.FILL_LEAST,
        work_basis: WorkBasis | str = WorkBasis.COMPUTE,
        meta: RoutingMeta | None = None,
        ledger: InflightLedger | None = None,
    ) -> None:
        self.ledger = ledger or InflightLedger()
        self.settings = settings or FillSettings()
        self.policy = policy
        self.work_basis = work_basis
        self.meta = meta or RoutingMeta()
        self._placement: dict[str, tuple[str, ...]] = {}
        self._runs: dict[str, _Run] = {}
        self._rr = RoundRobinRouter(self.ledger)

    @property
    def policy(self) -> FillPolicy:
        return self._policy

    @policy.setter
    def policy(self, value: FillPolicy | str) -> None:
        self._policy = FillPolicy(value)

    @property
    def work_basis(self) -> WorkBasis:
        return self._basis

    @work_basis.setter
    def work_basis(self, value: WorkBasis | str) -> None:
        """Raises ValueError for an unknown basis; live tickets keep their own charge."""
        self._basis = WorkBasis(value)

    def set_meta(self, meta: RoutingMeta) -> None:
        self.meta = meta

    def set_placement(self, assignment: Mapping[str, Sequence[str]]) -> None:
        """model -> placed workers (e.g. ``PlacementResult.assignment()``)."""
        self._placement = {m: tuple(sorted(set(ws))) for m, ws in assignment.items() if ws}

    def forget(self, model: str) -> None:
        """Drop ``model``'s run and rotation (it left every worker)."""
        self._runs.pop(model, None)
        self._rr.forget(model)

    def placement(self, model: str) -> tuple[str, ...]:
        return self._placement.get(model, ())

    def plan(self, model: str) -> FillPlan:
        return self.settings.plan(model, self.meta.max_batch(model))

    def route(self, model: str, replicas: Sequence[str], units: int = 1) -> Ticket:
        """``replicas``: the workers discovered serving ``model``. Raises ValueError for no
        replica or ``units`` < 1."""
        units = check_units(units)
        discovered = normalize_replicas(replicas)
        charge = fill_charge(self._basis, self.meta, model, units)
        found = set(discovered)
        members = tuple(w for w in self._placement.get(model, ()) if w in found)
        if not members:
            return self.ledger.open(model, self._rr.rotation(model, discovered), units, charge)
        plan = self.plan(model)
        chosen = members[0] if len(members) == 1 else self._choose(model, members, plan, units)
        q = plan.quantum
        out = self.ledger.outstanding
        rest = sorted(
            (w for w in members if w != chosen),
            key=lambda w: (out(model, w) // q, out(model, w), w),
        )
        outside = [w for w in discovered if w not in members]
        ticket = self.ledger.open(model, [chosen, *rest, *outside], units, charge)
        if len(members) > 1 and plan.mode is FillMode.RUN:
            run = self._runs[model]
            ticket.run = RunPlace(run.number, run.units, q, opened=run.units == units)
        return ticket

    def _choose(self, model: str, members: tuple[str, ...], plan: FillPlan, units: int) -> str:
        run = self._runs.setdefault(model, _Run())
        q = plan.quantum
        outs = [self.ledger.outstanding(model, w) for w in members]
        buckets = [o // q for o in outs]
        if self._policy is FillPolicy.FILL_LEAST:
            loads = [quantize(self.ledger.load(w)) for w in members]
        else:
            loads = [0] * len(members)
        dist = _distance(members, run.cursor)
        indices = range(len(members))

        if plan.mode is FillMode.RUN:
            if run.target in members:
                t = members.index(run.target)
                if (
                    run.units + units <= q  # (one that does not fit opens the next run)
                    and self.ledger.model_outstanding(model) > 0
                    and buckets[t] <= min(buckets)
                ):
                    run.units += units
                    return run.target
            i = min(indices, key=lambda i: (buckets[i], loads[i], dist[i]))
            run.cursor = run.target = members[i]
            run.units = units
            run.number += 1
            return members[i]

        if plan.mode is FillMode.SPREAD:
            keys = [(outs[i], loads[i]) for i in indices]
        else:
            keys = [(buckets[i], -outs[i], loads[i]) for i in indices]
        best = min(keys)
        tied = [i for i in indices if keys[i] == best]
        i = min(tied, key=lambda i: dist[i])
        if len(tied) > 1:  # the cursor moves on genuine ties only
            run.cursor = members[i]
        return members[i]
