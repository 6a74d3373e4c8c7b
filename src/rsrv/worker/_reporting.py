"""Snapshots of a worker's state in the shapes the protocol reports them.

Read-only views over the model set, the pipeline's request statistics, the scheduler and
the weight manager, built when an RPC asks (ModelStatistics, RepositoryIndex,
ModelControlStatus); nothing here is on the request path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rsrv.bundle import discover
from rsrv.errors import BundleError
from rsrv.protocol import DURATIONS, ControlSnapshot, IndexEntry, ModelControl
from rsrv.protocol import ModelStatisticsSnapshot as Snapshot
from rsrv.worker._models import LoadState

if TYPE_CHECKING:
    from rsrv.worker._models import ServedModel
    from rsrv.worker._worker import Worker

#: The residency floors, least resident first.
FLOORS = ("unpinned", "system", "device")
_READY = str(LoadState.READY)


def statistics(worker: Worker, name: str, version: int | None) -> list[Snapshot]:
    """Triton's ModelStatistics: of every ready version of every model (no ``name``), of
    every ready version of ``name``, or of its ``version`` (NotFound / Unavailable like a
    request)."""
    models = worker.models
    if not name:
        return [
            _snapshot(worker, v.model)
            for n in sorted(models.entries)
            for v in models.entries[n].ready()
        ]
    if version is None:
        models.get(name)  # raises when no version is ready
        return [_snapshot(worker, v.model) for v in models.entries[name].ready()]
    return [_snapshot(worker, models.get(name, version))]


def _snapshot(worker: Worker, served: ServedModel) -> Snapshot:
    name = served.name
    worker.pipeline.stats(name)  # the name's series appear in /metrics from now on
    stats = worker.pipeline.version_stats(name, served.version)
    if served.bundle.kind == "meta":  # not scheduled itself: one execution per request
        executions, batches = stats.compute_infer.count, {}
    else:
        sched = worker.scheduler.version_stats(name, served.version)
        executions, batches = sched.dispatches, sched.batch_sizes

    return Snapshot(
        name=name,
        version=served.version,
        last_inference_ms=stats.last_inference_ms,
        inference_count=stats.inference_count,
        execution_count=executions,
        durations={d: getattr(stats, d) for d in DURATIONS},  # live: read at once
        batch_executions=batches,
    )


def repository_names(repo: Path) -> set[str]:
    """The model directories of ``repo``, by name; none when it cannot be listed. It
    reads the file system (a stat per model): callers run it in a thread."""
    try:
        return {p.name for p in discover(repo)}
    except (BundleError, OSError):
        return set()


def index(worker: Worker, in_repository: set[str]) -> list[IndexEntry]:
    """RepositoryIndex: one entry per version of every model entry (one without a
    version for a model no version of which was tried), except ready models that a
    loaded meta model calls (they serve only their metas); a meta waiting for a callee
    is UNAVAILABLE with the names it waits for. Every other name of ``in_repository``
    (the repository's model directories, in explicit mode) is listed UNAVAILABLE,
    reason "unloaded" (Triton's)."""
    models = worker.models
    hidden = {
        c
        for e in models.entries.values()
        if e.model
        for c in e.model.bundle.signature.calls
        if models.ready(c)
    }
    unloaded = in_repository - set(models.entries)
    out = []
    for name in sorted(set(models.entries) | unloaded):
        if name in unloaded:
            out.append(IndexEntry(name, "", "UNAVAILABLE", "unloaded"))
            continue
        if name in hidden:
            continue
        entry = models.entries[name]
        if not entry.versions:
            out.append(IndexEntry(name, "", str(entry.state), entry.reason))
            continue
        for number, version in sorted(entry.versions.items()):
            state, reason = str(version.state), version.reason or entry.problem
            if version.model is not None and not worker.model_ready(name, number):
                sig = version.model.bundle.signature
                waiting = [c for c in sig.calls if not models.ready(c)]
                state, reason = "UNAVAILABLE", f"waiting for model(s) {', '.join(waiting)}"
            out.append(IndexEntry(name, str(number), state, reason))
    return out


def control(worker: Worker) -> ControlSnapshot:
    """ModelControlStatus: the scheduler, the weight cache and every model entry."""
    cache = worker.weights.cache
    return ControlSnapshot(
        discipline=worker.config.scheduler.discipline,
        control_mode=worker.config.model_control_mode,
        weight_cache_budget_bytes=cache.budget or 0,
        weight_cache_resident_bytes=cache.resident_bytes,
        weight_cache_loads=cache.counters.loads,
        weight_cache_evictions=cache.counters.evictions,
        models=[_model(worker, name) for name in sorted(worker.models.entries)],
        instance=worker.instance,
    )


def _model(worker: Worker, name: str) -> ModelControl:
    entry = worker.models.entries[name]
    served = entry.model
    if served is None:
        return ModelControl(name=name, state=str(entry.state))
    # It has a served version: READY (entry.state would find that version again).
    if served.bundle.kind == "meta":
        return _meta(worker, served)
    sched = worker.scheduler.counters(name)
    batch_input, batch_axis = "", -1
    for t in served.bundle.signature.client_inputs:
        if t.batch_axis is not None:
            batch_input, batch_axis = t.name, t.batch_axis
            break
    return ModelControl(
        name=name,
        state=_READY,
        kind=served.bundle.kind,
        residency=served.residency,
        device_resident=worker.weights.cache.is_resident(served.key),
        host_resident=worker.weights.host_resident(served.key),
        weight_bytes=served.bundle.weight_bytes,
        weight=sched.weight,
        queue_depth=sched.queue_depth,
        compute_seconds=sched.compute_seconds,
        requests_served=sched.requests,
        rows_served=sched.rows,
        dispatches=sched.dispatches,
        max_batch_size=sched.max_batch_size,
        batch_input_name=batch_input,
        batch_axis=batch_axis,
    )


def _meta(worker: Worker, served: ServedModel) -> ModelControl:
    """A meta reports its sub-models' footprint, its least-resident floor, and the device
    time of its own sub-calls."""
    entries = worker.models.entries
    subs = [
        entries[c].model
        for c in served.bundle.signature.calls
        if c in entries and entries[c].model is not None
    ]
    meta = worker.pipeline.meta.stats.get(served.name)
    served_count = meta.requests if meta else 0
    cache = worker.weights.cache
    return ModelControl(
        name=served.name,
        # (as its RepositoryIndex row says: a meta waiting for the models it calls is not)
        state=_READY if worker.model_ready(served.name) else "UNAVAILABLE",
        kind="meta",
        residency=min((s.residency for s in subs), key=FLOORS.index) if subs else "",
        device_resident=bool(subs) and all(cache.is_resident(s.key) for s in subs),
        host_resident=bool(subs) and all(worker.weights.host_resident(s.key) for s in subs),
        weight_bytes=sum(s.bundle.weight_bytes for s in subs),
        compute_seconds=meta.compute_seconds if meta else 0.0,
        requests_served=served_count,
        rows_served=served_count,
        dispatches=served_count,
    )
