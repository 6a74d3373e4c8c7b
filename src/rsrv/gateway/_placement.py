"""lpt_packing placement: which workers hold which models.

Pure and deterministic: the same inputs give the same placement, with no clock and no I/O.

Each model brings a demand ``u`` (device-seconds per second: its arrival rate times its cost
per request, 0 for a cold model) and a weight footprint in bytes. Each worker has compute
capacity 1.0 and an optional weight budget. Models are packed largest first (descending
``u``, then descending bytes, then name) onto the worker with the least *pressure*::

    pressure(w) = max(compute_load(w) + charge, (assigned_bytes(w) + bytes) / budget(w))

(the memory term is 0 for an unconstrained worker); equal pressures go to the worker
holding fewer models, then to the smaller name, so cold models spread rather than stack on
the first worker. A model with ``k`` replicas charges
``u / k`` compute and its full bytes to each of its ``k`` workers and gets weight ``1/k`` on
each. Pressures are compared after quantizing to 1e-9, so float noise never decides.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

ALL_REPLICAS = -1
"""A replica count meaning "every worker" (clamped to the number of workers)."""


def parse_replicas(value: int | str) -> int:
    """A replica setting from config: a count >= 1, or ``"all"`` / -1 for every worker.

    Raises ValueError for anything else (0, < -1, another string, a bool).
    """
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return ALL_REPLICAS
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"replicas must be a count >= 1 or 'all', not {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"replicas must be a count >= 1 or 'all', not {value!r}")
    if value == ALL_REPLICAS or value >= 1:
        return value
    raise ValueError(f"replicas must be a count >= 1 or 'all' (-1), not {value}")


@dataclass(frozen=True)
class ModelDemand:
    """One model to place.

    ``holders``: the ready workers that serve it (None = every worker). A model held by only
    some workers is *drifted*: it is not packed but spread uniformly over its holders.
    """

    name: str
    utilization: float = 0.0
    weight_bytes: int = 0
    holders: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a model needs a name")
        if not math.isfinite(self.utilization) or self.utilization < 0:
            raise ValueError(f"model {self.name!r}: utilization must be finite and >= 0")
        if self.weight_bytes < 0:
            raise ValueError(f"model {self.name!r}: weight_bytes must be >= 0")
        if self.holders is not None and not isinstance(self.holders, frozenset):
            object.__setattr__(self, "holders", frozenset(self.holders))


@dataclass(frozen=True)
class WorkerBudget:
    """One ready worker. ``budget_bytes`` None or 0 = no weight budget (unconstrained)."""

    name: str
    budget_bytes: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a worker needs a name")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"worker {self.name!r}: budget_bytes must be >= 0")

    @property
    def constrained(self) -> bool:
        return bool(self.budget_bytes)


@dataclass(frozen=True)
class PlacementPolicy:
    """The packing knobs.

    ``replicas``: per-model overrides of ``default_replicas``; each a count >= 1 or
    ``ALL_REPLICAS``. ``hysteresis`` in [0, 1): a single-replica model stays on its previous
    worker while that worker's pressure is at most ``best * (1 + hysteresis)``.
    ``forbid_memory_oversubscription``: a model goes only where its bytes fit, falling back to
    every worker when it fits nowhere (soft mode when False: memory is only a pressure term).
    """

    default_replicas: int = 1
    replicas: Mapping[str, int] = field(default_factory=dict)
    hysteresis: float = 0.0
    forbid_memory_oversubscription: bool = True

    def __post_init__(self) -> None:
        parse_replicas(self.default_replicas)
        for name, count in self.replicas.items():
            try:
                parse_replicas(count)
            except ValueError as exc:
                raise ValueError(f"model {name!r}: {exc}") from None
        if not (0.0 <= self.hysteresis < 1.0):
            raise ValueError(f"hysteresis must be in [0, 1), not {self.hysteresis}")
        object.__setattr__(self, "replicas", MappingProxyType(dict(self.replicas)))

    def configured(self, model: str) -> int:
        """The model's configured replica count (``ALL_REPLICAS`` possible)."""
        return self.replicas.get(model, self.default_replicas)

    def effective(self, model: str, n_workers: int) -> int:
        """The replica count clamped to [1, n_workers] (0 when there is no worker)."""
        if n_workers <= 0:
            return 0
        count = self.configured(model)
        return n_workers if count == ALL_REPLICAS else max(1, min(count, n_workers))


@dataclass(frozen=True)
class Placement:
    """Where one model runs: ``workers`` sorted by name, ``weights`` aligned with them."""

    model: str
    workers: tuple[str, ...]
    weights: tuple[float, ...]
    utilization: float
    weight_bytes: int
    configured_replicas: int
    drifted: bool = False
    moved: bool = False
    held_by_hysteresis: bool = False

    def weight_on(self, worker: str) -> float:
        try:
            return self.weights[self.workers.index(worker)]
        except ValueError:
            return 0.0


@dataclass(frozen=True)
class PlacementResult:
    """A whole placement and what it changed.

    ``moved``: models whose worker set differs from a non-empty previous one.
    ``held_by_hysteresis``: models kept on a previous worker that was strictly worse than the
    best one. ``max_improvement``: the largest pressure reduction such a held model gave up
    (0.0 when none). ``changed_workers``: workers whose set of placed models changed.
    ``unplaced``: models no listed worker holds.
    """

    placements: Mapping[str, Placement]
    workers: tuple[WorkerBudget, ...]
    moved: int
    held_by_hysteresis: int
    max_improvement: float
    assigned_bytes: Mapping[str, int]
    compute_load: Mapping[str, float]
    oversubscribed: tuple[str, ...]
    changed_workers: tuple[str, ...]
    unplaced: tuple[str, ...] = ()

    def assignment(self) -> dict[str, tuple[str, ...]]:
        """model -> workers: the ``previous`` of the next call, and the router's placement."""
        return {name: p.workers for name, p in self.placements.items()}

    def models_on(self, worker: str) -> tuple[str, ...]:
        """The models placed on ``worker``, sorted."""
        return tuple(sorted(n for n, p in self.placements.items() if worker in p.workers))


def _q(value: float) -> int:
    return round(value * 1e9)


class _Ledger:
    """Compute and bytes charged to each worker so far."""

    def __init__(self, workers: Sequence[WorkerBudget]) -> None:
        self.budget = {w.name: (w.budget_bytes or 0) for w in workers}
        self.load = {w.name: 0.0 for w in workers}
        self.bytes = {w.name: 0 for w in workers}
        self.count = {w.name: 0 for w in workers}

    def fits(self, worker: str, nbytes: int) -> bool:
        cap = self.budget[worker]
        return cap <= 0 or self.bytes[worker] + nbytes <= cap

    def pressure(self, worker: str, charge: float, nbytes: int) -> float:
        cap = self.budget[worker]
        memory = (self.bytes[worker] + nbytes) / cap if cap > 0 else 0.0
        return max(self.load[worker] + charge, memory)

    def charge(self, worker: str, charge: float, nbytes: int) -> None:
        self.load[worker] += charge
        self.bytes[worker] += nbytes
        self.count[worker] += 1


def compute_placement(
    models: Iterable[ModelDemand],
    workers: Iterable[WorkerBudget],
    previous: Mapping[str, Sequence[str]] | None = None,
    policy: PlacementPolicy | None = None,
) -> PlacementResult:
    """Place every model on the ready ``workers``.

    ``previous``: model -> workers of the last placement (hysteresis, previous-member
    preference, moved and changed accounting). Models held by every worker are packed;
    drifted ones are spread over their holders first and their load counts against those
    workers. A model bigger than every budget is still placed. Deterministic for equal inputs.

    Raises ValueError for a duplicate model or worker name.
    """
    policy = policy or PlacementPolicy()
    previous = previous or {}
    pool = sorted(workers, key=lambda w: w.name)
    names = [w.name for w in pool]
    if len(set(names)) != len(names):
        raise ValueError("duplicate worker names")
    demands = list(models)
    if len({m.name for m in demands}) != len(demands):
        raise ValueError("duplicate model names")
    if not pool:
        return PlacementResult(
            MappingProxyType({}), (), 0, 0, 0.0, {}, {}, (), (), tuple(m.name for m in demands)
        )

    everyone = frozenset(names)
    ledger = _Ledger(pool)
    out: dict[str, Placement] = {}
    unplaced: list[str] = []
    packed: list[ModelDemand] = []
    for m in sorted(demands, key=lambda m: m.name):
        holders = everyone if m.holders is None else m.holders & everyone
        if holders == everyone:
            packed.append(m)
        elif not holders:
            unplaced.append(m.name)
        else:
            chosen = tuple(sorted(holders))
            for w in chosen:
                ledger.charge(w, m.utilization / len(chosen), m.weight_bytes)
            out[m.name] = _placement(m, chosen, policy, previous, drifted=True)

    held = 0
    max_improvement = 0.0
    packed.sort(key=lambda m: (-m.utilization, -m.weight_bytes, m.name))
    for m in packed:
        k = policy.effective(m.name, len(pool))
        before = [w for w in previous.get(m.name, ()) if w in everyone]
        forgone: float | None = None
        if k == 1:
            worker, forgone = _place_single(m, names, before, ledger, policy)
            chosen = (worker,)
            if forgone is not None:
                held += 1
                max_improvement = max(max_improvement, forgone)
        else:
            chosen = _place_many(m, k, names, before, ledger, policy)
        for w in chosen:
            ledger.charge(w, m.utilization / len(chosen), m.weight_bytes)
        out[m.name] = _placement(m, chosen, policy, previous, held=forgone is not None)

    return PlacementResult(
        placements=MappingProxyType(dict(sorted(out.items()))),
        workers=tuple(pool),
        moved=sum(p.moved for p in out.values()),
        held_by_hysteresis=held,
        max_improvement=max_improvement,
        assigned_bytes=MappingProxyType(dict(ledger.bytes)),
        compute_load=MappingProxyType(dict(ledger.load)),
        oversubscribed=tuple(
            w for w in names if ledger.budget[w] > 0 and ledger.bytes[w] > ledger.budget[w]
        ),
        changed_workers=_changed(names, out, previous),
        unplaced=tuple(unplaced),
    )


def _place_single(
    m: ModelDemand,
    names: list[str],
    before: list[str],
    ledger: _Ledger,
    policy: PlacementPolicy,
) -> tuple[str, float | None]:
    """(worker, forgone improvement when held by hysteresis, else None)."""
    candidates = names
    if policy.forbid_memory_oversubscription:
        candidates = [w for w in names if ledger.fits(w, m.weight_bytes)] or names

    def pressure(w: str) -> float:
        return ledger.pressure(w, m.utilization, m.weight_bytes)

    best = min(candidates, key=lambda w: (_q(pressure(w)), ledger.count[w], w))
    # the previous home: the previous member still a candidate with the least pressure
    # (one worker after a single-replica placement; the best of several after k shrank to 1)
    homes = [w for w in before if w in candidates]
    if not homes:
        return best, None
    home = min(homes, key=lambda w: (_q(pressure(w)), ledger.count[w], w))
    p_home, p_best = pressure(home), pressure(best)
    if home == best or _q(p_home) > _q(p_best * (1.0 + policy.hysteresis)):
        return best, None
    if _q(p_home) <= _q(p_best):
        return home, None  # an equal choice: no hysteresis needed to stay
    return home, p_home - p_best


def _place_many(
    m: ModelDemand,
    k: int,
    names: list[str],
    before: list[str],
    ledger: _Ledger,
    policy: PlacementPolicy,
) -> tuple[str, ...]:
    share = m.utilization / k
    members = set(before)

    def rank(w: str) -> tuple[int, int, int, int, str]:
        spill = policy.forbid_memory_oversubscription and not ledger.fits(w, m.weight_bytes)
        return (
            int(spill),
            _q(ledger.pressure(w, share, m.weight_bytes)),
            0 if w in members else 1,
            ledger.count[w],
            w,
        )

    return tuple(sorted(sorted(names, key=rank)[:k]))


def _placement(
    m: ModelDemand,
    chosen: tuple[str, ...],
    policy: PlacementPolicy,
    previous: Mapping[str, Sequence[str]],
    *,
    drifted: bool = False,
    held: bool = False,
) -> Placement:
    chosen = tuple(sorted(chosen))
    before = set(previous.get(m.name, ()))
    return Placement(
        model=m.name,
        workers=chosen,
        weights=tuple(1.0 / len(chosen) for _ in chosen),
        utilization=m.utilization,
        weight_bytes=m.weight_bytes,
        configured_replicas=policy.configured(m.name),
        drifted=drifted,
        moved=bool(before) and before != set(chosen),
        held_by_hysteresis=held,
    )


def _changed(
    names: list[str], out: Mapping[str, Placement], previous: Mapping[str, Sequence[str]]
) -> tuple[str, ...]:
    now: dict[str, set[str]] = {w: set() for w in names}
    then: dict[str, set[str]] = {w: set() for w in names}
    for model, p in out.items():
        for w in p.workers:
            now[w].add(model)
    for model, ws in previous.items():
        for w in ws:
            if w in then:
                then[w].add(model)
    return tuple(w for w in names if now[w] != then[w])
