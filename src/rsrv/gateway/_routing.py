"""Request routing: which replica a request goes to, and the in-flight work it leaves behind.

Every router answers ``route(model, replicas, units)`` with a :class:`Ticket`: ``order`` is
the workers to try (the choice first, then failover), and the caller calls ``release()``
once the request is answered, failed or abandoned (a second release does nothing). While a
ticket is live its charge counts on its worker in the shared :class:`InflightLedger`.

``units`` are the request's items: its extent along the model's batch axis (the row-major
index into the wire shape), 1 when unknown. Pure and single-threaded: no clock, no I/O, no
locks (the gateway runs on one trio thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType

from rsrv.gateway._costs import RoutingMeta


class WorkBasis(StrEnum):
    """What one request charges to its worker's in-flight work."""

    REQUESTS = "requests"
    ITEMS = "items"
    COMPUTE = "compute"


def quantize(load: float) -> int:
    """Loads are compared in nanosecond steps, so float noise never breaks a tie."""
    return round(load * 1e9)


def normalize_replicas(replicas: Iterable[str]) -> tuple[str, ...]:
    """Sorted, without duplicates. Raises ValueError when empty."""
    names = tuple(sorted(set(replicas)))
    if not names:
        raise ValueError("no replica to route to")
    return names


def check_units(units: int) -> int:
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ValueError(f"units must be an int >= 1, not {units!r}")
    return units


class Ticket:
    """One routing decision. ``order``: workers to try, choice first. ``worker``: where the
    charge sits now (the choice, or the worker named by :meth:`redirect`). ``run``: where
    the request stands in its model's fill run (lpt_packing, mode run), else None;
    ``hold``: what it waits at before it is sent (``_hold.RunGate``), else None.

    Release it exactly once when the request is over, success or not; further releases
    are ignored. Usable as a context manager (released on exit).
    """

    __slots__ = ("model", "order", "worker", "units", "charge", "run", "hold", "_ledger", "_live")

    def __init__(
        self,
        ledger: InflightLedger,
        model: str,
        order: list[str],
        units: int,
        charge: float,
    ) -> None:
        self._ledger = ledger
        self.model = model
        self.order = order
        self.worker = order[0]
        self.units = units
        self.charge = charge
        self.run = None
        self.hold = None
        self._live = True

    @property
    def live(self) -> bool:
        return self._live

    def release(self) -> bool:
        """Take the charge off; True the first time, False after."""
        if not self._live:
            return False
        self._live = False
        self._ledger._remove(self.model, self.worker, self.units, self.charge)
        return True

    def redirect(self, worker: str) -> None:
        """Move the charge to ``worker`` (a failover target). No-op once released."""
        if not self._live or worker == self.worker:
            return
        self._ledger._remove(self.model, self.worker, self.units, self.charge)
        self._ledger._add(self.model, worker, self.units, self.charge, routed=True)
        self.worker = worker

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "live" if self._live else "released"
        return f"Ticket({self.model!r} -> {self.worker!r}, units={self.units}, {state})"


class InflightLedger:
    """In-flight work per worker and outstanding items per (model, worker).

    A worker whose last ticket is released has its load snapped to exactly 0.0, so float
    residue never accumulates. ``routed`` and ``arrivals`` are cumulative counts.
    """

    def __init__(self) -> None:
        self._load: dict[str, float] = {}
        self._tickets: dict[str, int] = {}
        self._items: dict[str, dict[str, int]] = {}  # model -> worker -> items
        self._model_items: dict[str, int] = {}
        self._routed: dict[str, dict[str, int]] = {}  # model -> worker -> requests
        self._arrivals: dict[str, int] = {}

    def open(self, model: str, order: list[str], units: int, charge: float) -> Ticket:
        """Charge ``order[0]`` and count one arrival of ``model``."""
        self._arrivals[model] = self._arrivals.get(model, 0) + 1
        self._add(model, order[0], units, charge, routed=True)
        return Ticket(self, model, order, units, charge)

    def _add(self, model: str, worker: str, units: int, charge: float, *, routed: bool) -> None:
        self._load[worker] = self._load.get(worker, 0.0) + charge
        self._tickets[worker] = self._tickets.get(worker, 0) + 1
        per = self._items.setdefault(model, {})
        per[worker] = per.get(worker, 0) + units
        self._model_items[model] = self._model_items.get(model, 0) + units
        if routed:
            counts = self._routed.setdefault(model, {})
            counts[worker] = counts.get(worker, 0) + 1

    def _remove(self, model: str, worker: str, units: int, charge: float) -> None:
        left = self._tickets[worker] - 1
        if left:
            self._tickets[worker] = left
            self._load[worker] -= charge
        else:
            del self._tickets[worker]
            del self._load[worker]
        per = self._items[model]
        per[worker] -= units
        if not per[worker]:
            del per[worker]
        self._model_items[model] -= units
        if not self._model_items[model]:
            del self._model_items[model]

    def load(self, worker: str) -> float:
        """The worker's in-flight work under the basis each ticket was charged with."""
        return self._load.get(worker, 0.0)

    def loads(self) -> Mapping[str, float]:
        return MappingProxyType(dict(self._load))

    def inflight(self, worker: str) -> int:
        """Live tickets charged to ``worker``."""
        return self._tickets.get(worker, 0)

    def outstanding(self, model: str, worker: str) -> int:
        """Items of ``model`` in flight on ``worker``."""
        return self._items.get(model, {}).get(worker, 0)

    def model_outstanding(self, model: str) -> int:
        """Items of ``model`` in flight anywhere."""
        return self._model_items.get(model, 0)

    def routed(self, model: str, worker: str) -> int:
        """Requests of ``model`` routed (or redirected) to ``worker`` since start."""
        return self._routed.get(model, {}).get(worker, 0)

    def arrivals(self) -> Mapping[str, int]:
        """Requests routed per model since start (the arrival counts of the repack clock)."""
        return MappingProxyType(dict(self._arrivals))

    def forget(self, model: str) -> None:
        """Drop ``model``'s counts (it left every worker); nothing of it may be in flight."""
        assert not self._model_items.get(model), model
        self._arrivals.pop(model, None)
        self._routed.pop(model, None)
        self._items.pop(model, None)

    def forget_worker(self, worker: str) -> None:
        """Drop ``worker``'s routed counts (it left the fleet); what is in flight on it
        is released as usual."""
        for counts in self._routed.values():
            counts.pop(worker, None)


def work_charge(basis: WorkBasis, meta: RoutingMeta, model: str, units: int) -> float:
    """One request's charge for least_outstanding: requests 1, items ``units``, compute
    ``units x item_cost``."""
    if basis is WorkBasis.REQUESTS:
        return 1.0
    if basis is WorkBasis.ITEMS:
        return float(units)
    return units * meta.item_cost(model)


class RoundRobinRouter:
    """round_robin: each model's replicas in turn (sorted by name), the rest as failover.

    Tickets charge 1 per request (the status shows requests in flight); units are only
    recorded as outstanding items.
    """

    needs_control = False
    needs_units = False

    def __init__(self, ledger: InflightLedger | None = None) -> None:
        self.ledger = ledger or InflightLedger()
        self._cursor: dict[str, int] = {}

    def forget(self, model: str) -> None:
        self._cursor.pop(model, None)

    def rotation(self, model: str, replicas: Sequence[str]) -> list[str]:
        """Advance ``model``'s cursor; ``replicas`` rotated so the choice is first."""
        names = normalize_replicas(replicas)
        i = (self._cursor.get(model, -1) + 1) % len(names)
        self._cursor[model] = i
        return list(names[i:] + names[:i])

    def route(self, model: str, replicas: Sequence[str], units: int = 1) -> Ticket:
        """Raises ValueError for no replica or ``units`` < 1."""
        units = check_units(units)
        return self.ledger.open(model, self.rotation(model, replicas), units, 1.0)


class LeastOutstandingRouter:
    """least_outstanding: the replica with the least in-flight work wins, ties to the
    smaller name; the others follow by (work, name) as failover.

    Work is counted per worker over every model, by ``work_basis`` (see :func:`work_charge`);
    compute charges use the costs of the last :meth:`set_meta`.
    """

    def __init__(
        self,
        work_basis: WorkBasis | str = WorkBasis.COMPUTE,
        meta: RoutingMeta | None = None,
        ledger: InflightLedger | None = None,
    ) -> None:
        self.ledger = ledger or InflightLedger()
        self.work_basis = work_basis
        self.meta = meta or RoutingMeta()

    @property
    def work_basis(self) -> WorkBasis:
        return self._basis

    @work_basis.setter
    def work_basis(self, value: WorkBasis | str) -> None:
        """Raises ValueError for an unknown basis. Live tickets keep their own charge."""
        self._basis = WorkBasis(value)

    @property
    def needs_control(self) -> bool:
        """Whether routing needs ModelControlStatus polls (costs or batch axes)."""
        return self.work_basis is not WorkBasis.REQUESTS

    @property
    def needs_units(self) -> bool:
        """Whether ``route`` reads ``units`` (the requests basis never does)."""
        return self.work_basis is not WorkBasis.REQUESTS

    def set_meta(self, meta: RoutingMeta) -> None:
        self.meta = meta

    def forget(self, model: str) -> None:
        """Nothing per model is kept here."""

    def route(self, model: str, replicas: Sequence[str], units: int = 1) -> Ticket:
        """Raises ValueError for no replica or ``units`` < 1."""
        units = check_units(units)
        names = normalize_replicas(replicas)
        load = self.ledger.load
        order = sorted(names, key=lambda w: (quantize(load(w)), w))
        charge = work_charge(self.work_basis, self.meta, model, units)
        return self.ledger.open(model, order, units, charge)
