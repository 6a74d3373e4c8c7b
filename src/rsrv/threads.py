"""Worker threads whose failures leave nothing large behind.

An exception raised in ``trio.to_thread.run_sync`` is re-raised through trio's own
frames, which hold it: it comes out in a reference cycle, and every frame it passed
through (the call's in the thread, the awaiting coroutines' on the loop) lives on with
all its locals (a request's bytes, its decoded tensors) after the caller has answered,
until Python's cycle collector happens to run, which on a quiet server can be never.
:func:`run_sync` returns such an exception from the thread as a value instead, with the
locals of the thread's frames cleared, and raises it on the loop: no cycle forms.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import trio

T = TypeVar("T")


async def run_sync(
    fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter | None = None
) -> T:
    """``fn(*args)`` in a worker thread (``limiter``: as trio's). What it raises is
    raised here, with its traceback and the exceptions it chains, but without the locals
    of the frames it was raised through in the thread."""
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
        seen: set[int] = set()
        pending: list[BaseException | None] = [e]
        while pending:
            exc = pending.pop()
            if exc is None or id(exc) in seen:
                continue
            seen.add(id(exc))
            _clear_frames(exc.__traceback__)
            pending += [exc.__cause__, exc.__context__]
            if isinstance(exc, BaseExceptionGroup):
                pending += exc.exceptions
        del exc, pending, fn, args  # (the traceback keeps this frame: drop what it holds)
        return False, [e]


#: Frames of generators and coroutines: a chained exception may come from one the
#: caller keeps suspended, which clearing its frame would end.
_SUSPENDABLE = (
    inspect.CO_GENERATOR
    | inspect.CO_COROUTINE
    | inspect.CO_ASYNC_GENERATOR
    | inspect.CO_ITERABLE_COROUTINE
)


def _clear_frames(tb: TracebackType | None) -> None:
    """The locals of the plain functions' frames in ``tb`` dropped (not the running
    one's: this thread's own, which keeps only what :func:`_caught` leaves it)."""
    while tb is not None:
        if not tb.tb_frame.f_code.co_flags & _SUSPENDABLE:
            try:
                tb.tb_frame.clear()
            except RuntimeError:  # (still running)
                pass
        tb = tb.tb_next
