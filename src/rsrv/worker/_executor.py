"""Runs batches on the device for the scheduler: one execution at a time."""

from __future__ import annotations

import time

import numpy as np
import trio

from rsrv import threads
from rsrv.errors import NotFound
from rsrv.runtime import WeightManager, zero_inputs
from rsrv.worker._models import ServedModel


class DeviceExecutor:
    """The scheduler's :class:`~rsrv.scheduler.Executor` over compiled model versions.

    ``versions`` maps executable keys (``name@generation``) to loaded versions. A lock
    makes warm-up runs and dispatches take turns, so the device never runs two executions
    at once. The PJRT call runs in a trio worker thread (the device thread), except that
    an execution whose last measured duration was under ``inline_below`` seconds runs on
    the event loop's own thread: for a model that executes in tens of microseconds the
    two thread hand-offs cost more than the execution, while a longer one must not stall
    the loop. Every run is timed inside its thread, so a model that becomes slower moves
    back to the device thread at its next run. Weights are leased from the
    :class:`WeightManager` for the duration of an execution, and only once the lock is
    held: a run waiting for the device holds no weights, so at most one model is leased
    at a time and the budget always has room for the model about to run.
    """

    def __init__(self, weights: WeightManager, inline_below: float = 0.0):
        self.weights = weights
        self.inline_below = inline_below
        self.versions: dict[str, ServedModel] = {}
        self._device = trio.Lock()
        self._limiter = trio.CapacityLimiter(1)
        self._seconds: dict[tuple[str, int], float] = {}  # last run, per version and size

    async def execute(
        self, model: str, batch_size: int, inputs: list[np.ndarray]
    ) -> list[np.ndarray]:
        served = self.versions.get(model)
        if served is None:
            raise NotFound(f"model version {model!r} is not loaded")
        return await self._run(served, batch_size, inputs)

    async def prefetch(self, model: str) -> None:
        await self.weights.prefetch(model)

    def measured_seconds(self, model: str, batch_size: int) -> float | None:
        """The last run of ``model`` at ``batch_size``, timed in its thread: without
        the waits for the device and for its weights (seconds when they were evicted)."""
        return self._seconds.get((model, batch_size))

    def retire(self, model: str) -> None:
        """A replaced or removed version has drained: free its weights now."""
        self.versions.pop(model, None)
        self.weights.remove(model)
        for key in [k for k in self._seconds if k[0] == model]:
            del self._seconds[key]

    async def warm_up(self, served: ServedModel) -> dict[int, float]:
        """Run every compiled size once on zeros; return the measured seconds per size
        (the runs alone, as :meth:`measured_seconds`).

        Each run also measures the model's scratch memory from the allocator's
        statistics, read when its weights are leased and again when it returns
        (:meth:`WeightManager.measure_scratch`); CPU reports none, so there it is 0.
        """
        costs = {}
        for size in sorted(served.compiled.executables):
            inputs = zero_inputs(served.compiled, size)
            async with self.weights.measure_scratch(served.key):
                await self._run(served, size, inputs)
            # the run alone: the first one also waited for the weights to be copied
            costs[size] = max(self._seconds[(served.key, size)], 1e-6)
        return costs

    async def _run(self, served: ServedModel, size: int, inputs: list[np.ndarray]):
        key = served.key
        # (expected while it waits for the device: a prefetch meanwhile must not evict it)
        with self.weights.expected(key):
            async with self._device:
                try:
                    async with self.weights.lease(key) as weights:
                        last = self._seconds.get((key, size))
                        if last is not None and last < self.inline_below:
                            outputs, seconds = _timed(served, size, inputs, weights)
                        else:
                            outputs, seconds = await threads.run_sync(
                                _timed, served, size, inputs, weights, limiter=self._limiter
                            )
                        self._seconds[(key, size)] = seconds
                finally:  # (a failed run counts too: its weights were loaded all the same)
                    self.weights.after_execution()
        return outputs


def _timed(served: ServedModel, size: int, inputs, weights) -> tuple[list[np.ndarray], float]:
    start = time.perf_counter()
    outputs = served.compiled.run(size, inputs, weights)
    return outputs, time.perf_counter() - start
