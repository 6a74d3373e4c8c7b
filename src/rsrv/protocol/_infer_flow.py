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
from typing import TypeVar

import numpy as np
import trio

from rsrv.bundle import Tensor
from rsrv.protocol._backend import InferenceBackend, ServedModelView
from rsrv.protocol._calls import call_deadline
from rsrv.protocol._status import grpc_status
from rsrv.protocol._tensors import codec_seconds

__all__ = ["OFFLOAD_SECONDS", "encode_seconds", "infer_counted"]

T = TypeVar("T")

#: Work expected to take longer than this leaves the event loop for a worker thread (a
#: hop there and back costs 0.1-0.2 ms on a small VM).
OFFLOAD_SECONDS = 1e-3


def encode_seconds(outputs: Mapping[str, np.ndarray]) -> float:
    """Roughly how long encoding ``outputs`` takes: BYTES elements built, other
    tensors copied (into the response, or into shared memory)."""
    total = 0.0
    for array in outputs.values():
        dtype = getattr(array, "dtype", None)
        if dtype is not None:
            shape, bytes_ = array.shape, dtype.kind in "OSU"
            total += codec_seconds(shape, bytes_, "copy", 0 if bytes_ else array.nbytes)
    return total


async def infer_counted(
    backend: InferenceBackend,
    served: ServedModelView,
    start: float,
    prepare: Callable[[float], tuple[Mapping[str, np.ndarray], float | None]],
    finish: Callable[[Mapping[str, np.ndarray]], T],
    *,
    decode_seconds: float = 0.0,
) -> T:
    """``prepare(now)`` decodes and validates (returns the inputs and the request's
    absolute deadline, None for none; ``now`` is trio's clock), the backend runs them,
    ``finish(outputs)`` encodes. Both run in a worker thread when expected to take longer
    than :data:`OFFLOAD_SECONDS` (``decode_seconds``: the wire's estimate for
    ``prepare``), so they must not need trio. Every outcome is recorded once on
    ``backend`` with the seconds since ``start`` (``time.perf_counter``): OK with the
    request's rows, or a failure under its status name (a cancelled call:
    DEADLINE_EXCEEDED when the call's own deadline has passed, else CANCELLED).
    Exceptions propagate unchanged."""
    try:
        with backend.hold(served) as held:  # (no checkpoint since the version was chosen)
            now = trio.current_time()
            if decode_seconds > OFFLOAD_SECONDS:
                inputs, deadline = await trio.to_thread.run_sync(prepare, now)
            else:
                inputs, deadline = prepare(now)
            outputs = await backend.infer(served, inputs, deadline, held)
        if encode_seconds(outputs) > OFFLOAD_SECONDS:
            response = await trio.to_thread.run_sync(finish, outputs)
        else:
            response = finish(outputs)
    except Exception as e:  # counted under the status the client receives
        backend.record(served, False, time.perf_counter() - start, grpc_status(e)[0].name, 0)
        raise
    except BaseException:  # cancelled: the deadline expired, or the call was abandoned
        expired = trio.current_time() >= call_deadline.get()
        status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
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
