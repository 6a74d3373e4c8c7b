"""Meta models: Python orchestration between model calls.

A meta bundle's ``@rsrv.meta`` hook runs in a worker thread with the request's inputs
and a ``call(model, {name: array}) -> {name: array}`` function. Each call re-enters the
scheduler as an ordinary request of that model (it may coalesce with other traffic),
ordered ahead of fresh work, carrying the meta request's deadline. While the Python glue
runs, the device serves other models. A meta's compute is the sum of its sub-calls'.
Specification: specs/meta.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from rsrv import threads
from rsrv.errors import DeadlineExceeded, FailedPrecondition

if TYPE_CHECKING:
    from rsrv.worker._models import ServedModel
    from rsrv.worker._pipeline import Pipeline


@dataclass(slots=True)
class MetaStats:
    requests: int = 0  # answered with outputs (counted by Pipeline.infer, once checked)
    compute_seconds: float = 0.0  # device time of those sub-calls (Pipeline.infer too)


class MetaRunner:
    """Runs meta requests, at most ``concurrency`` at a time."""

    def __init__(self, pipeline: Pipeline, concurrency: int):
        self.pipeline = pipeline
        self.limiter = trio.CapacityLimiter(concurrency)
        # The hooks' own threads: a parked meta must never hold one of trio's default
        # threads, which its sub-calls' pre/postprocess hooks (and weight staging) need.
        self._threads = trio.CapacityLimiter(concurrency)
        self.stats: dict[str, MetaStats] = {}

    async def run(
        self, served: ServedModel, inputs: Mapping[str, np.ndarray], deadline: float | None
    ) -> tuple[dict[str, np.ndarray], float]:
        """Run one meta request; returns its outputs and its sub-calls' device seconds."""
        hook = served.bundle.hooks.meta
        declared = served.bundle.signature.calls
        token = trio.lowlevel.current_trio_token()
        hook_thread: list[int] = []  # ident of the thread running the hook
        compute = []  # sub-call device seconds, appended from the hook's thread via trio

        async def sub_call(model: str, tensors: Mapping[str, np.ndarray]):
            if deadline is not None and trio.current_time() >= deadline:
                raise DeadlineExceeded(
                    f"meta model {served.name!r}: deadline passed before its call to {model!r}"
                )
            outputs, seconds = await self.pipeline.infer_sub(model, tensors, deadline)
            compute.append(seconds)
            return outputs

        def call(model: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            if model not in declared:
                raise FailedPrecondition(
                    f"meta model {served.name!r} called undeclared model {model!r}; "
                    f"add it to meta.calls (declared: {', '.join(declared) or 'none'})"
                )
            if not isinstance(tensors, Mapping):
                raise TypeError("call(model, tensors) takes a dict of numpy arrays by name")
            if hook_thread and threading.get_ident() == hook_thread[0]:
                # In the request's task: cancelling the request cancels the call.
                return trio.from_thread.run(sub_call, model, _read_only(tensors))
            # From a thread of the glue's own: trio runs it, not bound to the request.
            return trio.from_thread.run(sub_call, model, _read_only(tensors), trio_token=token)

        def run_hook() -> dict[str, np.ndarray]:
            hook_thread.append(threading.get_ident())
            return hook.run(served.name, inputs, call)

        if deadline is not None and trio.current_time() >= deadline:
            raise DeadlineExceeded(
                f"meta model {served.name!r}: the request's deadline has already passed"
            )
        with trio.move_on_at(deadline if deadline is not None else math.inf) as waiting:
            await self.limiter.acquire()
        if waiting.cancelled_caught:
            raise DeadlineExceeded(
                f"meta model {served.name!r}: deadline passed while waiting "
                "for a meta slot (scheduler.meta_concurrency)"
            )
        try:
            outputs = await threads.run_sync(run_hook, limiter=self._threads)
        finally:
            self.limiter.release()
        return outputs, sum(compute)


def _read_only(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The glue's tensors as the sub-model's hooks see a client's: read-only views (its
    hooks changed the glue's own arrays in place)."""
    out = {}
    for name, value in tensors.items():
        if isinstance(value, np.ndarray):
            value = value.view()
            value.flags.writeable = False
        out[name] = value
    return out
