"""What a scheduling-status RPC reports, assembled from the pure scheduling state.

:func:`model_views` and :func:`worker_views` read the router's ledger, the cost snapshot,
the last placement and the arrival rates; they change nothing. Under round_robin and
least_outstanding there is no placement: a model's replicas are its discovered routes,
``placed`` is False and the fill fields are empty.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rsrv.gateway._costs import RoutingMeta
from rsrv.gateway._fill import FillSettings
from rsrv.gateway._placement import ALL_REPLICAS, PlacementPolicy, PlacementResult
from rsrv.gateway._repack import ArrivalRates
from rsrv.gateway._routing import InflightLedger


@dataclass(frozen=True)
class ReplicaView:
    worker: str
    weight: float
    outstanding: int  # items in flight
    routed_total: int  # requests routed since start


@dataclass(frozen=True)
class ModelView:
    """``configured_replicas``: the setting (``ALL_REPLICAS`` = -1 for every worker);
    ``cost_seconds``: the measured cost per request (0.0 until measured)."""

    name: str
    configured_replicas: int
    effective_replicas: int
    replicas: tuple[ReplicaView, ...]
    utilization: float
    arrival_rate: float
    cost_seconds: float
    max_batch: int
    fill_mode: str
    fill_quantum: int
    weight_bytes: int
    placed: bool
    drifted: bool


@dataclass(frozen=True)
class WorkerView:
    """``inflight_compute``: the worker's in-flight work under the work basis.
    ``weight_budget_bytes`` 0 = no budget."""

    worker: str
    ready: bool
    models_placed: int
    inflight_compute: float
    assigned_weight_bytes: int
    weight_budget_bytes: int
    oversubscribed: bool


def model_views(
    *,
    ledger: InflightLedger,
    meta: RoutingMeta,
    routes: Mapping[str, Sequence[str]],
    result: PlacementResult | None = None,
    rates: ArrivalRates | None = None,
    fill: FillSettings | None = None,
    policy: PlacementPolicy | None = None,
    ready_workers: int = 0,
) -> tuple[ModelView, ...]:
    """One view per model discovered, placed or measured, sorted by name.

    ``routes``: model -> discovered workers. ``result``/``rates``/``fill``/``policy``: the
    lpt_packing state (None outside lpt_packing); there, a model's effective replicas
    are its configured count clamped to the ``ready_workers`` (what the next repack
    places, and what SetModelPlacement answers); elsewhere, the workers serving it.
    """
    placements = result.placements if result else {}
    names = sorted(set(routes) | set(placements) | set(meta.models))
    out = []
    for name in names:
        placement = placements.get(name)
        if placement:
            pairs = list(zip(placement.workers, placement.weights, strict=True))
        else:
            found = sorted(set(routes.get(name, ())))
            pairs = [(w, 1.0 / len(found)) for w in found]
        known = meta.get(name)
        rate = rates.rate(name) if rates else 0.0
        plan = fill.plan(name, meta.max_batch(name)) if fill else None
        out.append(
            ModelView(
                name=name,
                configured_replicas=policy.configured(name) if policy else ALL_REPLICAS,
                effective_replicas=(
                    policy.effective(name, ready_workers) if policy else len(pairs)
                ),
                replicas=tuple(
                    ReplicaView(w, weight, ledger.outstanding(name, w), ledger.routed(name, w))
                    for w, weight in pairs
                ),
                utilization=(
                    placement.utilization
                    if placement
                    else (rate * meta.request_cost(name) if rate > 0 else 0.0)
                ),
                arrival_rate=rate,
                cost_seconds=(known.cost_per_request or 0.0) if known else 0.0,
                max_batch=meta.max_batch(name),
                fill_mode=str(plan.mode) if plan else "",
                fill_quantum=plan.quantum if plan else 0,
                weight_bytes=known.weight_bytes if known else 0,
                placed=placement is not None,
                drifted=bool(placement and placement.drifted),
            )
        )
    return tuple(out)


def worker_views(
    *,
    ledger: InflightLedger,
    workers: Iterable[str],
    ready: Iterable[str] = (),
    budgets: Mapping[str, int] | None = None,
    result: PlacementResult | None = None,
) -> tuple[WorkerView, ...]:
    """One view per configured worker (plus any the placement or ledger knows), by name.

    ``budgets``: weight budget per worker (e.g. ``RoutingMeta.budgets``; else the
    placement's); 0 = none.
    """
    budgets = dict(budgets or {})
    ready = set(ready)
    names = set(workers) | set(ledger.loads())
    placed: dict[str, int] = {}
    if result:
        names |= {w.name for w in result.workers}
        for w in result.workers:
            budgets.setdefault(w.name, w.budget_bytes or 0)
        for p in result.placements.values():
            for w in p.workers:
                placed[w] = placed.get(w, 0) + 1
    oversubscribed = set(result.oversubscribed) if result else set()
    return tuple(
        WorkerView(
            worker=w,
            ready=w in ready,
            models_placed=placed.get(w, 0),
            inflight_compute=ledger.load(w),
            assigned_weight_bytes=result.assigned_bytes.get(w, 0) if result else 0,
            weight_budget_bytes=budgets.get(w, 0) or 0,
            oversubscribed=w in oversubscribed,
        )
        for w in sorted(names)
    )
