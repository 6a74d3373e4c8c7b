"""rsrv.threads: a worker thread's failure comes back whole, holding none of its locals."""

from __future__ import annotations

import gc
import traceback

import pytest
import trio
from support.assertions import frames_holding

from rsrv.threads import run_sync


async def test_a_failure_keeps_its_chain_and_traceback_but_not_its_locals():
    big = bytearray(1 << 20)

    def fails(data):
        try:
            raise KeyError("first")
        except KeyError:
            raise ExceptionGroup("both", [ValueError("second")])  # noqa: B904

    gc.collect()
    gc.disable()
    before = frames_holding(big)
    try:
        with pytest.raises(ExceptionGroup) as info:
            await run_sync(fails, big)
        assert frames_holding(big) == before  # none of fails' frames
    finally:
        gc.enable()
    assert isinstance(info.value.__context__, KeyError)
    assert "in fails" in "".join(traceback.format_exception(info.value))


async def test_results_and_limiter_are_trios():
    limiter = trio.CapacityLimiter(1)
    assert await run_sync(lambda a, b: a + b, 2, 3, limiter=limiter) == 5
    assert limiter.borrowed_tokens == 0
