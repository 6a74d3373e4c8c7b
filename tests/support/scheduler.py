"""Helpers shared by the scheduler tests (this module holds no tests).

Time is trio's MockClock (the ``autojump_clock`` fixture), so an executor that
``await trio.sleep(cost)`` takes exactly ``cost`` seconds of scheduler time and
every test is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import trio
from trio.testing import wait_all_tasks_blocked

from rsrv.config._schema import SchedulerConfig
from rsrv.errors import RsrvError
from rsrv.scheduler import ModelSpec, Result, Scheduler


def config(**kw) -> SchedulerConfig:
    return SchedulerConfig(**kw)


def spec(name: str, sizes=(1, 4, 8), inputs: int = 1, outputs: int = 1, **kw) -> ModelSpec:
    axis = 0 if sizes else None
    return ModelSpec(name, tuple(sizes), (axis,) * inputs, (axis,) * outputs, **kw)


def rows(first: float, n: int, width: int = 3) -> np.ndarray:
    """``n`` rows, each distinct: row i holds ``first + i`` in every column."""
    return np.repeat(np.arange(first, first + n, dtype=np.float32)[:, None], width, axis=1)


def scaled(model: str, size: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Default executable: every output is its input times 10 (padding stays 0)."""
    return [x * 10 for x in inputs]


@dataclass
class Call:
    model: str
    size: int
    inputs: list[np.ndarray]
    start: float
    end: float = 0.0


class FakeExecutor:
    """Runs ``fn`` after sleeping ``cost(model, size)`` seconds; records every call.

    ``errors[model]``, when set, is raised instead of returning outputs.
    """

    def __init__(
        self,
        cost: Callable[[str, int], float] | float = 0.0,
        fn: Callable[[str, int, list[np.ndarray]], list[np.ndarray]] = scaled,
    ) -> None:
        self.cost = cost if callable(cost) else (lambda model, size, c=cost: c)
        self.fn = fn
        self.calls: list[Call] = []
        self.errors: dict[str, Exception] = {}
        self.running = 0

    async def execute(self, model: str, size: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
        call = Call(model, size, [np.array(x, copy=True) for x in inputs], trio.current_time())
        self.calls.append(call)
        self.running += 1
        assert self.running == 1, "two executions at once"
        try:
            await trio.sleep(self.cost(model, size))
        finally:
            self.running -= 1
            call.end = trio.current_time()
        if model in self.errors:
            raise self.errors[model]
        return self.fn(model, size, inputs)

    def device_time(self, model: str, since: float = 0.0, until: float = float("inf")) -> float:
        """Seconds ``model`` executed within [since, until)."""
        return sum(
            max(0.0, min(c.end, until) - max(c.start, since))
            for c in self.calls
            if c.model == model
        )

    def order(self) -> list[str]:
        return [c.model for c in self.calls]


def scheduler_of(
    *specs: ModelSpec, cost: Callable[[str, int], float] | float = 0.0, **settings
) -> tuple[FakeExecutor, Scheduler]:
    """A Scheduler (``settings``: SchedulerConfig fields) over a :class:`FakeExecutor`
    whose executions take ``cost`` seconds (or ``cost(model, size)``), serving ``specs``."""
    ex = FakeExecutor(cost=cost)
    sched = Scheduler(config(**settings), ex)
    for model in specs:
        sched.add_model(model)
    return ex, sched


@dataclass(eq=False)
class Outcome:
    result: Result | None = None
    error: RsrvError | None = None
    done: bool = False
    finished_at: float = field(default=float("nan"))


def submit(
    nursery: trio.Nursery, sched: Scheduler, model: str, inputs: list[np.ndarray], **kw
) -> Outcome:
    """Start one submit in the background; its outcome lands in the returned object."""
    out = Outcome()

    async def go() -> None:
        try:
            out.result = await sched.submit(model, inputs, **kw)
        except RsrvError as e:
            out.error = e
        out.done = True
        out.finished_at = trio.current_time()

    nursery.start_soon(go)
    return out


async def queued(
    nursery: trio.Nursery, sched: Scheduler, model: str, inputs: list[np.ndarray], **kw
) -> Outcome:
    """Like :func:`submit`, but returns once the request is queued (or answered), so
    requests queue in the order the test makes them."""
    out = submit(nursery, sched, model, inputs, **kw)
    await wait_all_tasks_blocked()
    return out


async def client_loop(
    sched: Scheduler,
    model: str,
    n_rows: int = 1,
    think: float = 0.0,
    waits: list[float] | None = None,
    version: str | None = None,
) -> None:
    """A closed-loop client: submit (to ``version``, or the default), wait for the
    answer, think, repeat."""
    x = rows(1, n_rows)
    while True:
        result = await sched.submit(model, [x], version=version)
        if waits is not None:
            waits.append(result.queue_seconds)
        if think:
            await trio.sleep(think)
