"""The inference path of one request, after decoding and before encoding:

client inputs -> preprocess (thread) -> scheduler queue -> device -> postprocess (thread)
-> client outputs. Hooks never run on the dispatch loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from contextlib import AbstractContextManager

import numpy as np
import trio

from rsrv import threads
from rsrv.bundle import Tensor, rows_mismatch
from rsrv.dtypes import DType
from rsrv.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from rsrv.scheduler import PinnedVersion, Scheduler
from rsrv.worker._meta import MetaRunner, MetaStats
from rsrv.worker._models import ModelSet, ServedModel
from rsrv.worker._statistics import RequestStatistics

#: Threads one model's pre- and postprocess hooks take at once (trio's default, so a
#: model's hooks run as concurrently as when they shared it); its further calls wait for
#: one. Each model has its own: slow hooks of one model never take the threads of
#: another's, nor those of loads and of the codec's large tensors.
HOOK_THREADS_PER_MODEL = 40


class Pipeline:
    """Request statistics are kept per model name (``statistics``: the metrics, for as
    long as the name is loaded) and per version (``version_statistics``: ModelStatistics,
    for as long as the version is served; a reload of it keeps counting)."""

    def __init__(self, models: ModelSet, scheduler: Scheduler, meta_concurrency: int = 4):
        self.models = models
        self.scheduler = scheduler
        self.statistics: dict[str, RequestStatistics] = {}
        self.version_statistics: dict[tuple[str, str], RequestStatistics] = {}
        self.meta = MetaRunner(self, meta_concurrency)
        self._hook_threads: dict[str, trio.CapacityLimiter] = {}

    def _hook_limiter(self, name: str) -> trio.CapacityLimiter:
        """The threads of ``name``'s hooks (HOOK_THREADS_PER_MODEL)."""
        limiter = self._hook_threads.get(name)
        if limiter is None:
            limiter = self._hook_threads[name] = trio.CapacityLimiter(HOOK_THREADS_PER_MODEL)
        return limiter

    def stats(self, name: str) -> RequestStatistics:
        stats = self.statistics.get(name)
        if stats is None:
            stats = self.statistics[name] = RequestStatistics()
        return stats

    def version_stats(self, name: str, version: str) -> RequestStatistics:
        stats = self.version_statistics.get((name, version))
        if stats is None:
            stats = self.version_statistics[name, version] = RequestStatistics()
        return stats

    def serving(self, served: ServedModel) -> None:
        """``served`` starts serving: its requests count in its name's statistics and its
        version's, as they are now (a reload of the version keeps counting in them; they
        are dropped, and no longer reported, when the version retires or the model
        unloads, so a request that outlives either is not counted in a later load's)."""
        served.statistics = (
            self.stats(served.name),
            self.version_stats(served.name, served.version),
        )
        if served.bundle.kind == "meta":
            served.meta_statistics = self.meta.stats.setdefault(served.name, MetaStats())

    def record(self, served: ServedModel, ok: bool, seconds: float, status: str, rows: int):
        """Count one request of ``served`` (``status`` as the client receives it)."""
        for stats in served.statistics:
            stats.record(ok, seconds, status, rows)

    def drop(self, name: str, version: str) -> None:
        """Forget a retired version's statistics."""
        self.version_statistics.pop((name, version), None)

    def forget(self, name: str) -> None:
        """Forget everything counted for ``name`` (unloaded)."""
        self.statistics.pop(name, None)
        self.meta.stats.pop(name, None)
        self._hook_threads.pop(name, None)
        for key in [k for k in self.version_statistics if k[0] == name]:
            del self.version_statistics[key]

    def hold(self, served: ServedModel) -> AbstractContextManager[PinnedVersion | None]:
        """The scheduler's pin of ``served`` (None for a meta model, whose calls each
        hold their own), taken at once: no checkpoint may come between choosing
        ``served`` and this."""
        if not served.compiled:
            return contextlib.nullcontext()
        pinned = self.scheduler.pinned(served.name, served.version)
        if pinned.key != served.key:
            pinned.release()
            raise Unavailable(f"model {served.name!r} changed; send the request again")
        return pinned

    async def infer(
        self,
        served: ServedModel,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline: float | None = None,
        held: PinnedVersion | None = None,
    ) -> dict[str, np.ndarray]:
        """Run one request on the loaded version ``served`` (held by :meth:`hold`, or
        held from now); ``inputs`` are validated client inputs."""
        name = served.name
        if served.bundle.kind == "meta":
            waiting = [c for c in served.bundle.signature.calls if not self.models.ready(c)]
            if waiting:
                raise Unavailable(
                    f"meta model {name!r} is not ready: waiting for model(s) {', '.join(waiting)}"
                )
            outputs, seconds = await self.meta.run(served, inputs, deadline)
            _check_made(served, served.bundle.signature.client_outputs, outputs, "meta hook")
            _check_client_rows(served, inputs, outputs, "meta hook")
            for stats in served.statistics:  # the device time of its sub-calls
                stats.compute_infer.add(seconds)
            served.meta_statistics.requests += 1
            served.meta_statistics.compute_seconds += seconds
            return {t.name: outputs[t.name] for t in served.bundle.signature.client_outputs}
        return (await self._run_model(served, inputs, deadline, front=False, held=held))[0]

    async def infer_sub(
        self, name: str, inputs: Mapping[str, np.ndarray], deadline: float | None
    ) -> tuple[dict[str, np.ndarray], float]:
        """A meta model's call: checked like a client request, queued ahead of fresh
        work; returns the outputs and the device seconds of its batch."""
        try:
            served = self.models.get(name)
            if served.bundle.kind == "meta":
                raise FailedPrecondition(f"meta models may not call other meta models ({name!r})")
            check_inputs(name, served.bundle.signature.client_inputs, inputs)
            return await self._run_model(served, inputs, deadline, front=True)
        except NotFound as e:  # unloaded since the meta request started
            raise Unavailable(f"call to {name!r}: {e}") from None

    async def _run_model(
        self,
        served: ServedModel,
        inputs: Mapping[str, np.ndarray],
        deadline: float | None,
        *,
        front: bool,
        held: PinnedVersion | None = None,
    ):
        if held is None:  # (a meta's call: held from now)
            with self.hold(served) as held:
                return await self._run_model(served, inputs, deadline, front=front, held=held)
        name = served.name
        both = served.statistics
        hooks = served.bundle.hooks
        start = trio.current_time()
        exec_inputs = dict(inputs)
        # The version chosen for the request is held (``held``) while its preprocess runs:
        # a reload or retirement meanwhile leaves it to run there.
        if hooks.preprocess:
            made = await threads.run_sync(
                hooks.preprocess.run, name, inputs, limiter=self._hook_limiter(name)
            )
            exec_inputs.update(made)
            _check_made(served, served.bundle.signature.executable_inputs, made, "preprocess")
            _check_rows_agree(served, exec_inputs)
        for stats in both:
            stats.compute_input.add(trio.current_time() - start)

        order = served.bundle.signature.executable_inputs
        result = await self.scheduler.submit(
            name,
            [exec_inputs[t.name] for t in order],
            deadline=deadline,
            front=front,
            version=held,
        )
        outputs = {
            t.name: a
            for t, a in zip(served.bundle.signature.executable_outputs, result.outputs, strict=True)
        }
        if hooks.postprocess:
            start = trio.current_time()
            made = await threads.run_sync(
                hooks.postprocess.run, name, outputs, limiter=self._hook_limiter(name)
            )
            _check_made(served, served.bundle.signature.client_outputs, made, "postprocess")
            outputs.update(made)
            _check_client_rows(served, inputs, outputs, "postprocess")
            for stats in both:
                stats.compute_output.add(trio.current_time() - start)
        # Recorded once the request has its outputs: per successful request, as Triton.
        for stats in both:
            stats.queue.add(result.queue_seconds)
            stats.compute_infer.add(result.compute_seconds)
        client = {t.name: outputs[t.name] for t in served.bundle.signature.client_outputs}
        return client, result.compute_seconds


def check_inputs(model: str, specs: tuple[Tensor, ...], tensors: Mapping[str, np.ndarray]):
    """Tensors handed over in-process (a meta's call to ``model``) must match its specs
    exactly, and agree on their rows, as a client's request must."""
    where = f"call to {model!r}"
    names = {t.name for t in specs}
    extra = sorted(set(tensors) - names)
    missing = sorted(names - set(tensors))
    if extra or missing:
        raise InvalidArgument(
            f"{where}: inputs {sorted(tensors)} do not match the model's inputs {sorted(names)}"
        )
    for spec in specs:
        array = tensors[spec.name]
        if not isinstance(array, np.ndarray) or array.dtype != spec.dtype.numpy:
            got = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
            raise InvalidArgument(
                f"{where}: input {spec.name!r} has dtype {got}, expected {spec.dtype.value}"
            )
        if not spec.accepts(array.shape):
            raise InvalidArgument(
                f"{where}: input {spec.name!r} has shape {list(array.shape)}, "
                f"expected {list(spec.shape)} (-1: any extent)"
            )
        if spec.batch_axis is not None and array.shape[spec.batch_axis] == 0:
            raise InvalidArgument(f"{where}: input {spec.name!r} has no rows (batch axis is 0)")
    mismatch = rows_mismatch(model, ((spec, tensors[spec.name].shape) for spec in specs))
    if mismatch is not None:
        raise InvalidArgument(f"{where}: {mismatch}")


def _check_made(
    served: ServedModel, specs: tuple[Tensor, ...], made: dict[str, np.ndarray], hook: str
) -> None:
    """A hook's outputs must match the manifest exactly (dtype, rank, fixed extents); a
    BYTES one may come as numpy bytes or str (``S``, ``U``: what ``np.asarray`` makes
    of a list of them) or an object array of bytes or str, and is made here what a
    client gets: an object array of bytes."""
    for spec in specs:
        array = made.get(spec.name)
        if array is None:
            continue
        where = f"model {served.name!r}: {hook} produced {spec.name!r}"
        if spec.dtype is DType.BYTES:
            array = made[spec.name] = _bytes_objects(array, where)
        if array.dtype != spec.dtype.numpy:
            raise Internal(f"{where} with dtype {array.dtype}, expected {spec.dtype.value}")
        if not spec.accepts(array.shape):
            expected = ["n" if i == spec.batch_axis else d for i, d in enumerate(spec.shape)]
            raise Internal(f"{where} with shape {list(array.shape)}, expected {expected}")
        if (
            hook == "preprocess"
            and spec.batch_axis is not None
            and not array.shape[spec.batch_axis]
        ):
            raise Internal(f"{where} with no rows (batch axis of extent 0)")


def _check_rows_agree(served: ServedModel, exec_inputs: Mapping[str, np.ndarray]) -> None:
    """The executable inputs a preprocess made (and those it passed through) agree on
    their rows: else the hook's error (Internal), not the client's."""
    rows = {
        exec_inputs[t.name].shape[t.batch_axis]
        for t in served.bundle.signature.executable_inputs
        if t.batch_axis is not None
    }
    if len(rows) > 1:
        raise Internal(
            f"model {served.name!r}: preprocess made executable inputs of {sorted(rows)} "
            "rows; they must agree"
        )


def _check_client_rows(
    served: ServedModel,
    inputs: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
    hook: str,
) -> None:
    """The client outputs (made by ``hook`` or passed through) have the request's rows
    along their batch axes, as ``n`` on client tensors means (bundle.md §3): else the
    hook's error (Internal), never an answer of other rows."""
    sig = served.bundle.signature
    rows = next(
        (inputs[t.name].shape[t.batch_axis] for t in sig.client_inputs if t.batch_axis is not None),
        None,
    )
    if rows is None:
        return
    for t in sig.client_outputs:
        if t.batch_axis is not None and (got := outputs[t.name].shape[t.batch_axis]) != rows:
            raise Internal(
                f"model {served.name!r}: client output {t.name!r} has {got} rows along its "
                f"batch axis after the {hook}; the request has {rows}"
            )


def _bytes_objects(array: np.ndarray, where: str) -> np.ndarray:
    """A BYTES tensor as a client receives it: an object array of ``bytes`` (``str``
    encoded as UTF-8). Internal for an element that is neither; other dtypes are
    returned as they are (the dtype check names them)."""
    if array.dtype.kind == "U":
        return np.char.encode(array, "utf-8").astype(object)
    if array.dtype.kind == "S":
        return array.astype(object)
    if array.dtype != object:
        return array
    flat = array.reshape(-1)
    if all(type(v) is bytes for v in flat):
        return array
    out = np.empty(array.shape, object)
    out_flat = out.reshape(-1)  # (a view: filling it fills out)
    for i, value in enumerate(flat):
        if isinstance(value, str):
            value = value.encode()
        elif isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value)
        else:
            raise Internal(
                f"{where} with element {i} a {type(value).__name__}; BYTES elements are "
                "bytes or str"
            )
        out_flat[i] = value
    return out
