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


async def test_a_generator_the_caller_keeps_is_not_ended_by_a_chained_failure():
    """An exception chained from one a suspended generator holds (its frame in that
    exception's traceback): clearing every chained frame ended the generator."""

    def remembering():
        while True:
            try:
                raise ValueError("remembered")
            except ValueError as e:
                error = e
            yield error  # (suspended here, in error's traceback)

    kept = remembering()
    next(kept)

    def fails():
        raise RuntimeError("failed") from next(kept)

    with pytest.raises(RuntimeError):
        await run_sync(fails)
    assert isinstance(next(kept), ValueError)
