"""Runs batches on the device for the scheduler: one execution at a time, in a thread."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import trio

from rsrv.runtime.model import zero_inputs
from rsrv.worker.models import ServedModel


class DeviceExecutor:
    """The scheduler's :class:`~rsrv.scheduler.Executor` over compiled models.

    A lock makes warm-up runs and dispatches take turns, so the device never runs two
    executions at once; the PJRT call itself runs in a trio worker thread.
    """

    def __init__(self, lookup: Callable[[str], ServedModel]):
        self._lookup = lookup
        self._device = trio.Lock()
        self._limiter = trio.CapacityLimiter(1)

    async def execute(self, model: str, batch_size: int,
                      inputs: list[np.ndarray]) -> list[np.ndarray]:
        served = self._lookup(model)
        async with self._device:
            return await trio.to_thread.run_sync(
                served.compiled.run, batch_size, inputs, served.weights, limiter=self._limiter)

    async def warm_up(self, served: ServedModel) -> dict[int, float]:
        """Run every compiled size once on zeros; return the measured seconds per size."""
        costs = {}
        compiled = served.compiled
        for size in sorted(compiled.executables):
            inputs = zero_inputs(compiled, size)
            async with self._device:
                start = time.perf_counter()
                await trio.to_thread.run_sync(compiled.run, size, inputs, served.weights,
                                              limiter=self._limiter)
                costs[size] = max(time.perf_counter() - start, 1e-6)
        return costs
