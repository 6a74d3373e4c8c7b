"""How the answers of several workers combine into the one a client gets: the
repository index (a union), statistics and control status (counters summed), system
shared-memory status (what every worker holds alike)."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.message import Message

from rsrv.protocol.generated.inference import grpc_service_pb2 as pb
from rsrv.protocol.generated.rsrv.control.v1 import control_pb2 as control_pb

__all__ = ["common_regions", "merge_control_status", "merge_index", "sum_statistics"]

_Row = pb.RepositoryIndexResponse.ModelIndex


def merge_index(
    answers: Iterable[tuple[str, pb.RepositoryIndexResponse]],
) -> pb.RepositoryIndexResponse:
    """The union of the workers' indexes (``(worker, answer)`` pairs), one row per model
    and version: READY when ready on some worker, its reason naming them (then each other
    worker's reason); else LOADING when loading somewhere; else the first worker's state,
    with every worker's reason. A worker's row without a version (an explicit-mode
    worker's "unloaded") joins the model's versioned rows when another worker has some."""
    where: dict[tuple[str, str], list[tuple[str, _Row]]] = {}
    for worker, answer in answers:
        for row in answer.models:
            where.setdefault((row.name, row.version), []).append((worker, row))
    versioned = {name for name, version in where if version}
    for name, version in [k for k in where if not k[1] and k[0] in versioned]:
        for key in [k for k in where if k[0] == name and k[1]]:
            where[key] += where[(name, version)]
        del where[(name, version)]
    merged = pb.RepositoryIndexResponse()
    for (name, version), rows in sorted(where.items()):
        rows.sort(key=lambda pair: pair[0])
        ready = [w for w, row in rows if row.state == "READY"]
        others = [f"{w}: {row.reason or row.state}" for w, row in rows if w not in ready]
        if ready:
            state, reason = "READY", "; ".join(["ready on " + ", ".join(ready), *others])
        else:  # LOADING somewhere says more than UNAVAILABLE elsewhere
            loading = any(row.state == "LOADING" for _, row in rows)
            state, reason = "LOADING" if loading else rows[0][1].state, "; ".join(others)
        merged.models.add(name=name, version=version, state=state, reason=reason)
    return merged


def common_regions(
    answers: Iterable[pb.SystemSharedMemoryStatusResponse],
) -> pb.SystemSharedMemoryStatusResponse:
    """The regions every answer holds alike (name, key, offset and size): those a
    request may use, whichever worker it is routed to."""
    first, *rest = answers
    merged = pb.SystemSharedMemoryStatusResponse()
    for name, region in first.regions.items():
        if all(name in other.regions and other.regions[name] == region for other in rest):
            merged.regions[name].CopyFrom(region)
    return merged


def sum_statistics(answers: Iterable[pb.ModelStatisticsResponse]) -> pb.ModelStatisticsResponse:
    """One entry per model and version, its counters summed over the answers."""
    merged: dict[tuple[str, str], pb.ModelStatistics] = {}
    for answer in answers:
        for stats in answer.model_stats:
            key = (stats.name, stats.version)
            if key in merged:
                _add(merged[key], stats)
            else:
                merged[key] = stats
    return pb.ModelStatisticsResponse(model_stats=[merged[k] for k in sorted(merged)])


def merge_control_status(
    answers: list[control_pb.ModelControlStatusResponse],
) -> control_pb.ModelControlStatusResponse:
    """The fleet's control status: weight-cache figures summed, one entry per model with
    its counters summed; the discipline and control mode of the first answer."""
    merged = control_pb.ModelControlStatusResponse(
        discipline=answers[0].discipline, control_mode=answers[0].control_mode
    )
    models: dict[str, control_pb.ModelStatus] = {}
    for answer in answers:
        merged.weight_cache_budget_bytes += answer.weight_cache_budget_bytes
        merged.weight_cache_resident_bytes += answer.weight_cache_resident_bytes
        merged.weight_cache_loads += answer.weight_cache_loads
        merged.weight_cache_evictions += answer.weight_cache_evictions
        for model in answer.models:
            if model.name in models:
                _add(models[model.name], model)
            else:
                models[model.name] = model
    merged.models.extend(models[name] for name in sorted(models))
    return merged


#: Fields that are not counters: kept from the first message, or the latest time.
# Identity fields: the first worker's value stands (a number here is a label, a size or an
# enum, not a counter).
_KEEP = frozenset(
    {
        "name",
        "version",
        "kind",
        "state",
        "batch_input_name",
        "batch_axis",
        "batch_size",
        "weight",
        "weight_bytes",
        "residency",
    }
)
_LATEST = frozenset({"last_inference"})
_LARGEST = frozenset({"max_batch_size"})


def _add(into: Message, other: Message) -> None:
    """Add ``other``'s counters into ``into``: numbers summed (times since the epoch
    take the latest), sub-messages recursively, repeated batch statistics matched by
    batch size."""
    for fd, value in other.ListFields():
        name = fd.name
        if name in _KEEP or fd.type == fd.TYPE_STRING:
            continue
        if fd.label == fd.LABEL_REPEATED:
            if name == "batch_stats":
                sizes = {b.batch_size: b for b in getattr(into, name)}
                for item in value:
                    if item.batch_size in sizes:
                        _add(sizes[item.batch_size], item)
                    else:
                        getattr(into, name).add().CopyFrom(item)
            continue  # memory usage, response maps: per worker, not additive
        if fd.type == fd.TYPE_MESSAGE:
            _add(getattr(into, name), value)
        elif fd.type == fd.TYPE_BOOL:
            setattr(into, name, getattr(into, name) or value)
        elif name in _LATEST or name in _LARGEST:
            setattr(into, name, max(getattr(into, name), value))
        else:
            setattr(into, name, getattr(into, name) + value)
