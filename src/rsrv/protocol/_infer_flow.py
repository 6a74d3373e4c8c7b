"""One inference request's life, whichever wire it came on: decode, the backend, encode,
and the count in the model's statistics under the status the client receives.

Both wires (``_inference``'s ModelInfer and ModelStreamInfer, ``_rest``'s ``/infer``)
run their requests through :func:`infer_counted`, so a request is counted the same way
whether it failed decoding, in the queue, in a hook or while its answer was encoded.

Decoding and encoding run on the event loop, unless they are expected to take longer than
:data:`OFFLOAD_SECONDS` (many BYTES elements or typed values, large shared-memory copies):
then in a worker thread, so that the loop goes on serving every other call meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

import numpy as np
import trio

from rsrv import threads
from rsrv.bundle import Tensor
from rsrv.protocol._backend import InferenceBackend, ServedModelView
from rsrv.protocol._calls import call_deadline, deadline_cut_off
from rsrv.protocol._status import grpc_status
from rsrv.protocol._tensors import BYTES_ELEMENT_SECONDS, COPY_BYTE_SECONDS

__all__ = ["OFFLOAD_SECONDS", "Prepared", "encode_seconds", "infer_counted", "off_loop"]

T = TypeVar("T")

#: Work expected to take longer than this leaves the event loop for a worker thread (a
#: hop there and back costs 0.1-0.2 ms on a small VM).
OFFLOAD_SECONDS = 1e-3


async def off_loop(seconds: float, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``: in a worker thread when expected to take ``seconds`` longer than
    :data:`OFFLOAD_SECONDS`, else here (no checkpoint then)."""
    if seconds > OFFLOAD_SECONDS:
        return await threads.run_sync(fn, *args)
    return fn(*args)


def encode_seconds(outputs: Mapping[str, np.ndarray]) -> float:
    """Roughly how long encoding ``outputs`` takes: BYTES elements built, other
    tensors copied (into the response, or into shared memory)."""
    total = 0.0
    for array in outputs.values():
        dtype = getattr(array, "dtype", None)
        if dtype is None:
            continue
        if dtype.kind in "OSU":
            total += array.size * BYTES_ELEMENT_SECONDS
        else:
            total += array.nbytes * COPY_BYTE_SECONDS
    return total


class Prepared(Protocol):
    """A request checked and ready to decode: ``seconds`` roughly how long
    ``materialize()`` (thread-safe) takes to give its inputs."""

    @property
    def seconds(self) -> float: ...

    def materialize(self) -> Mapping[str, np.ndarray]: ...


async def infer_counted(
    backend: InferenceBackend,
    served: ServedModelView,
    start: float,
    prepare: Callable[[float], tuple[Prepared, float | None]],
    finish: Callable[[Mapping[str, np.ndarray]], T],
    prepare_seconds: float = 0.0,
    finish_seconds: Callable[[Mapping[str, np.ndarray]], float] = encode_seconds,
) -> T:
    """``prepare(now)`` validates (returns the request ready to decode and its absolute
    deadline, None for none; ``now`` is trio's clock), its inputs are materialized, the
    backend runs them, ``finish(outputs)`` encodes. Preparing (expected to take
    ``prepare_seconds``), materializing and encoding (``finish_seconds(outputs)``) run
    in a worker thread when expected to take longer than :data:`OFFLOAD_SECONDS`. Every
    outcome is recorded once on ``backend`` with the seconds since ``start``
    (``time.perf_counter``): OK with the request's rows, or a failure under its status
    name (a cancelled call: DEADLINE_EXCEEDED when its own deadline cut it off, as
    :func:`deadline_cut_off` tells, else CANCELLED). Exceptions propagate unchanged."""
    try:
        with backend.hold(served) as held:  # (no checkpoint since the version was chosen)
            prepared, deadline = await off_loop(prepare_seconds, prepare, trio.current_time())
            inputs = await off_loop(prepared.seconds, prepared.materialize)
            outputs = await backend.infer(served, inputs, deadline, held)
        response = await off_loop(finish_seconds(outputs), finish, outputs)
        # (a thread, a hook's or the encoding's, finishes whatever the call's deadline:
        # one that passed meanwhile ends the call here, not answered OK)
        await trio.lowlevel.checkpoint_if_cancelled()
    except Exception as e:  # counted under the status the client receives
        backend.record(served, False, time.perf_counter() - start, grpc_status(e)[0].name, 0)
        raise
    except BaseException:  # cancelled: the deadline expired, or the call was abandoned
        status = "DEADLINE_EXCEEDED" if deadline_cut_off(call_deadline.get()) else "CANCELLED"
        backend.record(served, False, time.perf_counter() - start, status, 0)
        raise
    rows = _rows(served.bundle.signature.client_inputs, inputs)
    backend.record(served, True, time.perf_counter() - start, "OK", rows)
    return response


def _rows(specs: tuple[Tensor, ...], inputs) -> int:
    for spec in specs:
        if spec.batch_axis is not None and spec.name in inputs:
            return int(inputs[spec.name].shape[spec.batch_axis])
    return 1
