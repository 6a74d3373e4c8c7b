"""Holding a fill run's requests at the gateway until the run is full.

A worker coalesces the queued requests of a model that reach it within its queue delay.
The requests of one run come through the gateway one after another, as their clients send
them; when they are spread over longer than the worker's delay, the worker splits the run
in two batches, and the halves come back apart and stay apart. With
``scheduling.routing_fill_hold_seconds`` (lpt_packing, fill mode ``run``), the requests
that open and join a run wait here until the run holds its quantum, or until the hold
time after it opened, whichever is first; then they go on together, and reach the worker
within a fraction of a millisecond of each other.

A run is held only when it can be expected to fill: when the model has at least a
quantum of units in flight (this run's included), as closed-loop clients whose answers
are coming back do. A lone client is never held. A new run releases the one before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

__all__ = ["RunGate", "RunHolds"]


class RunGate:
    """Where the requests of one run wait: until :meth:`open`, or ``deadline`` (trio
    time)."""

    __slots__ = ("deadline", "number", "_opened")

    def __init__(self, number: int, deadline: float):
        self.number = number  # the run's number (FillRouter)
        self.deadline = deadline
        self._opened = trio.Event()

    @property
    def opened(self) -> bool:
        return self._opened.is_set()

    def open(self) -> None:
        self._opened.set()

    async def wait(self) -> None:
        """Until the run is full or replaced, or its deadline; at once after either."""
        with trio.move_on_at(self.deadline):
            await self._opened.wait()


@dataclass
class RunHolds:
    """The gate of each model's current run, and counts of how holds ended: ``full``,
    ``timeout`` (the hold time passed first) or ``replaced`` (a new run opened first)."""

    seconds: float
    held: int = 0  # requests that waited at a gate
    outcomes: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("full", "timeout", "replaced"), 0)
    )
    _gates: dict[str, RunGate] = field(default_factory=dict)

    def gate(
        self, model: str, run: int, units: int, quantum: int, outstanding: int
    ) -> RunGate | None:
        """The gate of a request that just opened or joined run number ``run`` of
        ``model``, which now holds ``units`` of its ``quantum``, while the model has
        ``outstanding`` units in flight; None when it goes on at once."""
        gate = self._gates.get(model)
        if gate is None and (self.seconds <= 0 or units >= quantum or outstanding < quantum):
            return None  # nothing held, and this run is full or cannot be expected to fill
        now = trio.current_time()
        if gate is not None and gate.number != run:
            self._retire(model, "timeout" if now >= gate.deadline else "replaced")
            gate = None
        if units >= quantum:  # full: it goes, and so do the requests held
            if gate is not None:
                self._retire(model, "timeout" if now >= gate.deadline else "full")
            return None
        if gate is None:
            if self.seconds <= 0 or outstanding < quantum:
                return None
            gate = self._gates[model] = RunGate(run, now + self.seconds)
        elif now >= gate.deadline:
            return None
        self.held += 1
        return gate

    def forget(self, model: str) -> None:
        """``model`` is gone: release what waits for it."""
        if model in self._gates:
            self._retire(model, "replaced")

    def _retire(self, model: str, outcome: str) -> None:
        self._gates.pop(model).open()
        self.outcomes[outcome] += 1
