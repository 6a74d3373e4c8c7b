"""One inference request's life, whichever wire it came on: decode, the backend, encode,
and the count in the model's statistics under the status the client receives.

Both wires (``_inference``'s ModelInfer and ModelStreamInfer, ``_rest``'s ``/infer``)
run their requests through :func:`infer_counted`, so a request is counted the same way
whether it failed decoding, in the queue, in a hook or while its answer was encoded.
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

__all__ = ["infer_counted"]

T = TypeVar("T")


async def infer_counted(
    backend: InferenceBackend,
    served: ServedModelView,
    start: float,
    prepare: Callable[[], tuple[Mapping[str, np.ndarray], float | None]],
    finish: Callable[[Mapping[str, np.ndarray]], T],
) -> T:
    """``prepare()`` decodes and validates (returns the inputs and the request's absolute
    deadline, None for none), the backend runs them, ``finish(outputs)`` encodes. Every
    outcome is recorded once on ``backend`` with the seconds since ``start``
    (``time.perf_counter``): OK with the request's rows, or a failure under its status
    name (a cancelled call: DEADLINE_EXCEEDED when the call's own deadline has passed,
    else CANCELLED). Exceptions propagate unchanged."""
    try:
        inputs, deadline = prepare()
        outputs = await backend.infer(served, inputs, deadline)
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
