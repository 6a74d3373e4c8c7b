"""Worker threads whose failures leave nothing large behind.

An exception raised in ``trio.to_thread.run_sync`` is re-raised through trio's own
frames, which hold it: it comes out in a reference cycle, and every frame it passed
through (the call's in the thread, the awaiting coroutines' on the loop) lives on with
all its locals (a request's bytes, its decoded tensors) after the caller has answered,
until Python's cycle collector happens to run, which on a quiet server can be never.
:func:`run_sync` returns such an exception from the thread as a value instead, and
raises it on the loop: no cycle forms, so the exception, its frames and what they hold
are freed as soon as the caller is done with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import trio

T = TypeVar("T")


async def run_sync(
    fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter | None = None
) -> T:
    """``fn(*args)`` in a worker thread (``limiter``: as trio's). What it raises is
    raised here as it was, traceback and chained exceptions included, in no reference
    cycle."""
    ok, box = await trio.to_thread.run_sync(_caught, fn, args, limiter=limiter)
    value = box.pop()  # (the box stays in trio's finished frames: it must not hold it)
    if ok:
        return value
    try:
        raise value
    finally:
        del value  # (this frame, in its traceback, must not hold it)


def _caught(fn: Callable[..., T], args: tuple) -> tuple[bool, list]:
    try:
        return True, [fn(*args)]
    except BaseException as e:
        del fn, args  # (the traceback keeps this frame: drop what it holds)
        return False, [e]
