"""Routing metadata: what the gateway learns about each model from the workers' counters.

Once per discovery round the gateway hands :meth:`CostTracker.observe` one
:class:`WorkerReport` per worker that answered ModelControlStatus. The tracker differences the
cumulative counters per (worker, model) pair and keeps, per model:

* ``cost_per_request`` and ``cost_per_item``: EWMAs of ``d compute / d requests`` and
  ``d compute / d rows`` (rows = items along the batch axis). ``x <- x + a (sample - x)`` with
  ``a = 1 - 2^(-dt / h)``, where ``dt`` is the fleet compute seconds consumed since the
  model's previous sample and ``h`` the half-life in compute seconds. A model's first sample
  is adopted as is, so the first poll (baseline 0) adopts the lifetime average;
* ``max_batch``: the largest ``max_batch_size`` reported this round;
* ``batch_input`` / ``batch_axis``: the first non-empty report this round, by worker name; a
  round without one keeps the last known. The axis is the row-major (numpy) index into the
  wire shape, 0-based, as the worker's manifest and ModelControlStatus state it;
* ``weight_bytes`` and the set of workers that reported it this round (``holders``).

A counter that went backwards (the worker or the model restarted) re-baselines that pair and
its sample is skipped. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

DEFAULT_HALFLIFE_COMPUTE_SECONDS = 30.0


def resolve_halflife(halflife: float | None, rebalance_compute_seconds: float | None) -> float:
    """The EWMA half-life in compute seconds: ``halflife`` when > 0, else the rebalance
    budget when > 0, else 30."""
    for value in (halflife, rebalance_compute_seconds):
        if value is not None and value > 0:
            return float(value)
    return DEFAULT_HALFLIFE_COMPUTE_SECONDS


def ewma(old: float | None, sample: float, dt: float, halflife: float) -> float:
    """Fold ``sample`` into ``old`` after ``dt`` (same unit as ``halflife``); None adopts."""
    if old is None:
        return sample
    alpha = 1.0 - math.exp2(-max(dt, 0.0) / halflife)
    return old + alpha * (sample - old)


#: The most items one request is charged: a shape no worker accepts (say 2**62 rows)
#: must not swamp the in-flight loads, which are floats.
MAX_UNITS = 1 << 31


def batch_units(shape: Sequence[int] | None, axis: int) -> int:
    """A request's items: its extent along ``axis`` of ``shape``; 1 when unknown or < 1,
    at most MAX_UNITS."""
    if shape is None or not (0 <= axis < len(shape)):
        return 1
    return min(max(1, int(shape[axis])), MAX_UNITS)


@dataclass(frozen=True)
class ModelCounters:
    """One model's entry of a worker's ModelControlStatus (cumulative counters)."""

    name: str
    compute_seconds: float = 0.0
    requests_served: int = 0
    rows_served: int = 0
    weight_bytes: int = 0
    max_batch_size: int = 0
    batch_input_name: str = ""
    batch_axis: int = -1
    kind: str = ""  # "meta": its compute is its sub-models' (counted there)

    @classmethod
    def from_status(cls, status: Any) -> ModelCounters:
        """From a ``rsrv.control.v1.ModelStatus`` message (or anything with its fields)."""
        return cls(
            name=status.name,
            compute_seconds=float(status.compute_seconds),
            requests_served=int(status.requests_served),
            rows_served=int(status.rows_served),
            weight_bytes=int(status.weight_bytes),
            max_batch_size=int(status.max_batch_size),
            batch_input_name=status.batch_input_name,
            batch_axis=int(status.batch_axis),
            kind=status.kind,
        )


@dataclass(frozen=True)
class WorkerReport:
    """One worker's ModelControlStatus answer. ``weight_cache_budget_bytes`` 0 = none."""

    worker: str
    models: tuple[ModelCounters, ...] = ()
    weight_cache_budget_bytes: int = 0
    discipline: str = ""
    instance: str = ""  # new at each start of the worker process ("" unknown)

    @classmethod
    def from_response(cls, worker: str, response: Any) -> WorkerReport:
        """From a ``ModelControlStatusResponse`` message (or anything with its fields)."""
        return cls(
            worker=worker,
            models=tuple(ModelCounters.from_status(m) for m in response.models),
            weight_cache_budget_bytes=int(response.weight_cache_budget_bytes),
            discipline=response.discipline,
            instance=response.instance,
        )


@dataclass(frozen=True)
class RoundDelta:
    """What one :meth:`CostTracker.observe` round measured.

    ``compute_seconds``: fleet compute consumed since the previous round, over pairs seen
    before (a pair's first sighting and re-baselined pairs add nothing; a meta model's
    adds nothing either, since its sub-models' counters hold that device time), >= 0.
    ``requests``: requests completed per model over the same pairs.
    ``rebaselined``: (worker, model) pairs whose counters went backwards this round.
    """

    compute_seconds: float = 0.0
    requests: Mapping[str, int] = field(default_factory=dict)
    rebaselined: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ModelMeta:
    """What the gateway knows of one model. Costs are None until measured."""

    name: str
    cost_per_request: float | None = None
    cost_per_item: float | None = None
    max_batch: int = 0
    batch_input: str = ""
    batch_axis: int = -1
    weight_bytes: int = 0
    holders: frozenset[str] = frozenset()

    def units(self, shape_of: Callable[[str], Sequence[int] | None]) -> int:
        """A request's items: ``shape_of(input name)`` gives an input's wire shape or None
        (``InferHead.input_shape``, ``dict.get``); 1 when the batch input is unknown, absent
        or has no such axis. Never reads anything when the model has no batch input."""
        if not self.batch_input:
            return 1
        return batch_units(shape_of(self.batch_input), self.batch_axis)


def _positive_mean(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None and v > 0]
    return sum(known) / len(known) if known else None


@dataclass(frozen=True)
class RoutingMeta:
    """An immutable snapshot of the tracker, for routing and placement.

    ``budgets``: each reporting worker's weight budget in bytes (0 = none), last round.
    """

    models: Mapping[str, ModelMeta] = field(default_factory=dict)
    budgets: Mapping[str, int] = field(default_factory=dict)
    mean_cost_per_request: float | None = field(init=False, default=None)
    mean_cost_per_item: float | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        object.__setattr__(self, "budgets", MappingProxyType(dict(self.budgets)))
        metas = self.models.values()
        object.__setattr__(
            self, "mean_cost_per_request", _positive_mean(m.cost_per_request for m in metas)
        )
        object.__setattr__(
            self, "mean_cost_per_item", _positive_mean(m.cost_per_item for m in metas)
        )

    def get(self, model: str) -> ModelMeta | None:
        return self.models.get(model)

    def item_cost(self, model: str) -> float:
        """Seconds per item: the model's own (> 0), else the fleet mean, else 1.0; never 0."""
        meta = self.models.get(model)
        own = meta.cost_per_item if meta else None
        return _fallback(own, self.mean_cost_per_item)

    def request_cost(self, model: str) -> float:
        """Seconds per request: own (> 0), else the fleet mean, else 1.0; never 0."""
        meta = self.models.get(model)
        own = meta.cost_per_request if meta else None
        return _fallback(own, self.mean_cost_per_request)

    def max_batch(self, model: str) -> int:
        meta = self.models.get(model)
        return meta.max_batch if meta else 0


def _fallback(own: float | None, mean: float | None) -> float:
    if own is not None and own > 0:
        return own
    return mean if mean is not None else 1.0


@dataclass
class _Pair:
    compute: float = 0.0
    requests: int = 0
    rows: int = 0


@dataclass
class _Model:
    cost_per_request: float | None = None
    cost_per_item: float | None = None
    dt_request: float = 0.0  # fleet compute since the last request-cost sample
    dt_item: float = 0.0
    max_batch: int = 0
    batch_input: str = ""
    batch_axis: int = -1
    weight_bytes: int = 0
    holders: frozenset[str] = frozenset()


class CostTracker:
    """Per-model costs and batch facts, learned from cumulative worker counters.

    Call :meth:`observe` once per discovery round, then :meth:`snapshot` for an immutable
    :class:`RoutingMeta`. Workers absent from a round keep their baselines (a worker that
    comes back is differenced against what it last reported), unless it reports another
    ``instance`` (a new process, whose counters started again: its first report is a
    baseline), or its counters went backwards.
    """

    def __init__(self, halflife_compute_seconds: float = 300.0) -> None:
        self.halflife_compute_seconds = halflife_compute_seconds
        self._pairs: dict[tuple[str, str], _Pair] = {}
        self._models: dict[str, _Model] = {}
        self._budgets: dict[str, int] = {}
        self._instances: dict[str, str] = {}

    @property
    def halflife_compute_seconds(self) -> float:
        return self._halflife

    @halflife_compute_seconds.setter
    def halflife_compute_seconds(self, value: float) -> None:
        """Takes effect from the next sample; history is not recomputed."""
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"halflife_compute_seconds must be > 0, not {value}")
        self._halflife = float(value)

    def observe(self, reports: Iterable[WorkerReport]) -> RoundDelta:
        """Fold one round of reports in. Raises ValueError for a worker reported twice."""
        reports = sorted(reports, key=lambda r: r.worker)
        if len({r.worker for r in reports}) != len(reports):
            raise ValueError("a worker is reported twice in one round")
        fleet_dt = 0.0
        requests: dict[str, int] = {}
        rebaselined: list[tuple[str, str]] = []
        sums: dict[str, list[float]] = {}  # model -> [d compute, d requests, d rows]
        seen: dict[str, list[tuple[str, ModelCounters]]] = {}
        for report in reports:
            if report.instance:
                if self._instances.get(report.worker, report.instance) != report.instance:
                    self.forget_worker(report.worker)  # a new process: counters start again
                self._instances[report.worker] = report.instance
            self._budgets[report.worker] = report.weight_cache_budget_bytes
            for c in report.models:
                seen.setdefault(c.name, []).append((report.worker, c))
                key = (report.worker, c.name)
                pair = self._pairs.get(key)
                now = _Pair(c.compute_seconds, c.requests_served, c.rows_served)
                self._pairs[key] = now
                base = pair or _Pair()
                dc = now.compute - base.compute
                dr = now.requests - base.requests
                dn = now.rows - base.rows
                if dc < 0 or dr < 0 or dn < 0:
                    rebaselined.append(key)
                    continue
                acc = sums.setdefault(c.name, [0.0, 0, 0])
                acc[0] += dc
                acc[1] += dr
                acc[2] += dn
                if pair is not None:
                    if c.kind != "meta":  # (its device time is its sub-models', counted)
                        fleet_dt += dc
                    requests[c.name] = requests.get(c.name, 0) + dr

        for name, model in self._models.items():
            if name not in seen:
                model.holders = frozenset()
        for name, entries in seen.items():
            self._facts(self._models.setdefault(name, _Model()), entries)
        for name, model in self._models.items():
            model.dt_request += fleet_dt
            model.dt_item += fleet_dt
            dc, dr, dn = sums.get(name, (0.0, 0, 0))
            if dr > 0:
                model.cost_per_request = ewma(
                    model.cost_per_request, dc / dr, model.dt_request, self._halflife
                )
                model.dt_request = 0.0
            if dn > 0:
                model.cost_per_item = ewma(
                    model.cost_per_item, dc / dn, model.dt_item, self._halflife
                )
                model.dt_item = 0.0
        return RoundDelta(fleet_dt, MappingProxyType(requests), tuple(rebaselined))

    @staticmethod
    def _facts(model: _Model, entries: list[tuple[str, ModelCounters]]) -> None:
        model.max_batch = max(c.max_batch_size for _, c in entries)
        model.weight_bytes = max(c.weight_bytes for _, c in entries)
        model.holders = frozenset(worker for worker, _ in entries)
        for _, c in entries:  # in worker-name order: the first non-empty report wins
            if c.batch_input_name and c.batch_axis >= 0:
                model.batch_input, model.batch_axis = c.batch_input_name, c.batch_axis
                break

    def forget_worker(self, worker: str) -> None:
        """Drop ``worker``'s baselines and budget (it left the fleet; if it comes back,
        its first report is a baseline)."""
        for key in [k for k in self._pairs if k[0] == worker]:
            del self._pairs[key]
        self._budgets.pop(worker, None)
        self._instances.pop(worker, None)

    def forget_model(self, model: str) -> None:
        """Drop everything known about ``model`` (e.g. after it left every worker)."""
        self._models.pop(model, None)
        for key in [k for k in self._pairs if k[1] == model]:
            del self._pairs[key]

    def snapshot(self) -> RoutingMeta:
        return RoutingMeta(
            models={
                name: ModelMeta(
                    name=name,
                    cost_per_request=m.cost_per_request,
                    cost_per_item=m.cost_per_item,
                    max_batch=m.max_batch,
                    batch_input=m.batch_input,
                    batch_axis=m.batch_axis,
                    weight_bytes=m.weight_bytes,
                    holders=m.holders,
                )
                for name, m in sorted(self._models.items())
            },
            budgets=dict(sorted(self._budgets.items())),
        )
