"""rsrv.threads: a worker thread's failure comes back whole, in no reference cycle."""

from __future__ import annotations

import gc
import traceback

import trio
from support.assertions import frames_holding

from rsrv.threads import run_sync


async def test_a_failure_comes_back_whole_and_in_no_reference_cycle():
    """trio re-raised it in a cycle through its own frames: the call's frames, and the
    request's bytes they held, lived on after it was handled, until a collection."""
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
        try:
            await run_sync(fails, big)
        except ExceptionGroup as e:
            assert isinstance(e.__context__, KeyError)
            assert "in fails" in "".join(traceback.format_exception(e))
            assert frames_holding(big) > before  # (while it is handled, fails' frame)
        assert frames_holding(big) == before  # handled: freed, no collection needed
    finally:
        gc.enable()


async def test_results_and_limiter_are_trios():
    limiter = trio.CapacityLimiter(1)
    assert await run_sync(lambda a, b: a + b, 2, 3, limiter=limiter) == 5
    assert limiter.borrowed_tokens == 0
